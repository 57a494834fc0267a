from sparsegen.kv.policies.h2o import H2O
from sparsegen.kv.policy import register_policy


@register_policy
class Scissorhands(H2O):
    """Persistence of importance (Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for
    LLM KV Cache Compression at Test Time", 2023): a token that drew more than the average attention (1/n over the n
    it competed with) from a query head is pivotal, and stays pivotal; keep the recent tokens and those pivotal most
    often within the paper's history window: the latest ``history`` queries (None: every query so far)."""

    name = "scissorhands"
    attention_statistic = "pivotal"

    def __init__(self, budget: int, recent: int | None = None, heavy: int | None = None, sinks: int = 0,
                 history: int | None = None):
        super().__init__(budget, recent=recent, heavy=heavy, sinks=sinks)
        if history is not None and history < 1:
            raise ValueError(f"history (the latest queries whose votes count) must be at least 1, got {history}")
        self.history = history

    def describe(self):
        return {**super().describe(), "history": self.history}
