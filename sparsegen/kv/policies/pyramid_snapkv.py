from sparsegen.kv.policies.pyramid import pyramid_budgets
from sparsegen.kv.policies.snapkv import SnapKV
from sparsegen.kv.policy import register_policy


@register_policy
class PyramidSnapKV(SnapKV):
    """PyramidKV as its authors' code and kvpress's ``PyramidKVPress`` run it: SnapKV's rule (the observation
    window's pooled votes, the window kept) under ``pyramid``'s allocation, budgets falling linearly from the first
    layer to the last (1/20 of the mean ``budget``). Where the last layer's budget would not hold the window, every
    layer holds ``budget`` (their fallback to SnapKV)."""

    name = "pyramid-snapkv"

    def for_layer(self, index: int, layers: int) -> SnapKV:
        budgets = pyramid_budgets(self.budget, layers)
        budget = budgets[index] if min(budgets) >= self.window + self.sinks else self.budget
        return SnapKV(budget, window=self.window, sinks=self.sinks)

    def describe(self):
        return {**super().describe(), "per_layer": "pyramid"}
