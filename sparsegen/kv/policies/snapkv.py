import torch
import torch.nn.functional as F

from sparsegen.kv.policies.h2o import H2O
from sparsegen.kv.policy import TokenView, register_policy


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
        window = min(32, budget // 4) if window is None else window
        super().__init__(budget, recent=window, sinks=sinks)
        self.window = window

    def priority(self, view: TokenView) -> torch.Tensor:
        # pool over the held tokens in position order (empty slots last, voting 0)
        order = view.index.masked_fill(~view.valid, torch.iinfo(torch.long).max).argsort(dim=-1)
        votes = view.attention.masked_fill(~view.valid, 0).gather(-1, order)
        pooled = F.avg_pool1d(votes.flatten(0, 1)[:, None], self.kernel, 1, self.kernel // 2)[:, 0].view_as(votes)
        priority = torch.empty_like(pooled).scatter_(-1, order, pooled)
        return priority.masked_fill(view.is_recent(self.recent) | view.is_sink(self.sinks), torch.inf)

    def describe(self):
        return {**super().describe(), "window": self.window}
