from sparsegen.kv.policies.h2o import H2O
from sparsegen.kv.policy import register_policy


def pyramid_budgets(budget: int, layers: int, ratio: int = 20) -> list[int]:
    """Budgets falling linearly from the first layer to the last (which gets ``budget / ratio``), summing to
    ``layers * budget``: PyramidKV's allocation (Cai et al., 2024; its beta = 20)."""
    if layers == 1:
        return [budget]
    low = budget / ratio
    high = 2 * budget - low
    raw = [high - (high - low) * i / (layers - 1) for i in range(layers)]
    floors = [max(1, int(b)) for b in raw]
    short = layers * budget - sum(floors)
    for i in sorted(range(layers), key=lambda i: floors[i] - raw[i])[:max(short, 0)]:  # largest remainders first
        floors[i] += 1
    return floors


@register_policy
class Pyramid(H2O):
    """H2O's rule (recent + heavy hitters, half each) under PyramidKV's allocation (Cai et al., "PyramidKV: Dynamic
    KV Cache Compression based on Pyramidal Information Funneling", 2024): lower layers, whose attention is spread
    wide, hold more; upper layers, whose attention is concentrated, hold less; the same total. ``budget`` is the
    mean per layer; each layer's storage is sized by its own budget."""

    name = "pyramid"

    def __init__(self, budget: int, sinks: int = 0):
        super().__init__(budget, sinks=sinks)  # each layer splits its own budget half recent, half heavy

    def for_layer(self, index: int, layers: int) -> H2O:
        budget = pyramid_budgets(self.budget, layers)[index]
        return H2O(budget, sinks=min(self.sinks, budget - 1))

    def describe(self):
        return {**super().describe(), "per_layer": "pyramid"}
