import torch
import torch.nn.functional as F

from sparsegen.kv.policies.h2o import H2O
from sparsegen.kv.policy import TokenView, register_policy


def pooled_votes(index: torch.Tensor, valid: torch.Tensor, votes: torch.Tensor, kernel: int) -> torch.Tensor:
    """``votes`` average-pooled over ``kernel`` neighbouring held tokens in position order (empty slots last, voting
    0; zeros beyond the ends), returned in slot order."""
    order = index.masked_fill(~valid, torch.iinfo(torch.long).max).argsort(dim=-1)
    ordered = votes.masked_fill(~valid, 0).gather(-1, order)
    pooled = F.avg_pool1d(ordered.flatten(0, 1)[:, None], kernel, 1, kernel // 2)[:, 0].view_as(ordered)
    return torch.empty_like(pooled).scatter_(-1, order, pooled)


@register_policy
class SnapKV(H2O):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024): the last
    ``window`` queries of each prompt chunk (the observation window) vote with their attention, the votes are
    average-pooled over neighbouring positions (kernel 5) so kept tokens come with their context, and the window's
    own tokens are always kept. During decode every query votes (H2O's running sum, pooled the same way)."""

    name = "snapkv"
    attention_statistic = "window"
    kernel = 5

    def __init__(self, budget: int, window: int | None = None, sinks: int = 0):
        window = max(1, min(32, budget // 4)) if window is None else window  # at least the last query votes
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"{self.name}: the observation window is at least 1 query, got {window!r}")
        super().__init__(budget, recent=window, sinks=sinks)
        self.window = window

    def priority(self, view: TokenView) -> torch.Tensor:
        pooled = pooled_votes(view.index, view.valid, view.attention, self.kernel)
        return pooled.masked_fill(view.is_recent(self.recent) | view.is_sink(self.sinks), torch.inf)

    def describe(self):
        return {**super().describe(), "window": self.window}
