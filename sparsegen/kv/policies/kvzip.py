import math

import torch

from sparsegen.kv.policy import Policy, TokenView, register_policy


@register_policy
class KVzip(Policy):
    """KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", 2025): a context's
    K/V are kept by the most attention any query head pays them while the model reads the context again, teacher-
    forced, right after it (``Policy.reconstructs``: the prefill runs that pass, a chunk at a time, before it
    compresses). A pair the model needs to restore its context is one a later question can need, whatever it asks.
    After the compression, decode queries keep raising the same maxima; the ``recent`` newest tokens are kept."""

    name = "kvzip"
    needs_attention = True
    attention_statistic = "max"
    compresses_whole = reconstructs = True

    def __init__(self, budget: int | None, recent: int | None = None, sinks: int = 0):
        super().__init__(budget)
        recent = min(64, budget // 8) if recent is None and budget is not None else recent or 0
        if budget is not None and not 0 <= sinks + recent < budget:
            raise ValueError(f"{self.name}: sinks + recent ({sinks} + {recent}) must be at least 0 and under the "
                             f"budget ({budget})")
        self.recent, self.sinks = recent, sinks

    def priority(self, view: TokenView) -> torch.Tensor:
        return self.protected(view, view.attention)

    def protected(self, view: TokenView, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` with the ``recent`` newest tokens and the ``sinks`` kept whatever they score."""
        return scores.masked_fill(view.is_recent(self.recent) | view.is_sink(self.sinks), math.inf)

    def describe(self):
        return {**super().describe(), "recent": self.recent, "sinks": self.sinks}
