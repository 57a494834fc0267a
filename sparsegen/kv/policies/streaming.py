import math

from sparsegen.kv.policy import Policy, TokenView, register_policy


@register_policy
class Streaming(Policy):
    """StreamingLLM: the first ``sinks`` tokens (attention sinks) plus the most recent ones."""

    name = "streaming"
    default_positions = "rolling"

    def __init__(self, budget: int, sinks: int = 4):
        super().__init__(budget)
        if not 0 <= sinks < budget:
            raise ValueError(f"{self.name}: sinks ({sinks}) must be at least 0 and smaller than the budget ({budget}): "
                             "raise the budget or lower the sinks")
        self.sinks = sinks

    def priority(self, view: TokenView):
        return view.index.float().masked_fill(view.is_sink(self.sinks), math.inf)

    def query_view(self):
        return self.sinks, self.budget - self.sinks

    def describe(self):
        return {**super().describe(), "sinks": self.sinks, "recent": self.budget - self.sinks}
