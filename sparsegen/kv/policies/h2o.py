import math

from sparsegen.kv.policy import Policy, TokenView, register_policy


@register_policy
class H2O(Policy):
    """Heavy hitters: the ``recent`` last tokens plus those with the largest accumulated attention, per KV head."""

    name = "h2o"
    needs_attention = True

    def __init__(self, budget: int, recent: int | None = None, heavy: int | None = None, sinks: int = 0):
        super().__init__(budget)
        if recent is None and heavy is None:
            heavy = (budget - sinks) // 2
        if recent is None:
            recent = budget - sinks - heavy
        if heavy is None:
            heavy = budget - sinks - recent
        if not 0 <= sinks < budget:
            raise ValueError(f"{self.name}: sinks ({sinks}) must be at least 0 and smaller than the budget ({budget}): "
                             "raise the budget or lower the sinks")
        if not 0 <= recent <= budget:
            raise ValueError(f"recent ({recent}) must be between 0 and the budget ({budget})")
        if heavy < 0 or sinks + recent + heavy != budget:
            raise ValueError(f"sinks + recent + heavy ({sinks} + {recent} + {heavy}) must equal the budget ({budget})")
        self.recent, self.heavy, self.sinks = recent, heavy, sinks

    def priority(self, view: TokenView):
        protected = view.is_recent(self.recent) | view.is_sink(self.sinks)
        return view.attention.masked_fill(protected, math.inf)

    def describe(self):
        return {**super().describe(), "sinks": self.sinks, "recent": self.recent, "heavy": self.heavy}
