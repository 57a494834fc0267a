import torch

from sparsegen.kv.policies.snapkv import SnapKV, pooled_votes
from sparsegen.kv.policy import TokenView, register_policy


def vote_shares(view: TokenView, kernel: int) -> torch.Tensor:
    """Each held token's share of its head's pooled observation-window votes (a head's shares sum to 1; empty slots
    0), ``[batch, kv_head, slot]``."""
    pooled = pooled_votes(view.index, view.valid, view.attention, kernel).masked_fill(~view.valid, 0)
    return pooled / pooled.sum(-1, keepdim=True).clamp(min=torch.finfo(pooled.dtype).tiny)


@register_policy
class SnapKVLayers(SnapKV):
    """SnapKV with the layers voting together. SnapKV lets each layer keep what its own observation window attends
    to, but the layers that retrieve are not always those whose window finds the answer: in SmolLM2-135M the needle
    of RULER's ``niah_single_2`` must be held in layers 14-19 to be recalled, and only the windows of layers 20-23
    point at it (docs/results/smollm2/ruler/README.md). So a prompt chunk's evictions wait until every layer has
    attended; then each token gets, in every layer, its own head's share of SnapKV's pooled votes plus the largest
    share any ``voters`` layer gave it (averaged over that layer's heads). The votes of the voting layers are
    remembered with the tokens (the memo), so decode-time evictions keep honouring them. ``voters``: the voting
    layers as a span of the depth, first and last fraction (default the 2/3-4/5 of the depth)."""

    name = "snapkv-layers"
    across_layers = True
    memo_width = 1  # the largest share a voting layer gave the token

    def __init__(self, budget: int, window: int | None = None, sinks: int = 0,
                 voters: tuple[float, float] = (2 / 3, 4 / 5)):
        super().__init__(budget, window=window, sinks=sinks)
        low, high = voters
        if not 0 <= low <= high <= 1:
            raise ValueError(f"snapkv-layers: voters must be a span (first, last) of the depth within [0, 1], got "
                             f"{voters}")
        self.voters = (low, high)

    def voting(self, layers: int) -> range:
        """The indices of the voting layers among ``layers``: at least one."""
        first = min(round(self.voters[0] * (layers - 1)), layers - 1)
        return range(first, max(first, round(self.voters[1] * (layers - 1))) + 1)

    def share(self, views: list[TokenView]) -> None:
        batch, width = views[0].index.shape[0], int(views[0].seen.max())  # (a prompt chunk's: host reads allowed)
        best = torch.zeros(batch, width, device=views[0].index.device)
        for i in self.voting(len(views)):
            view = views[i]
            index = view.index.clamp(0, width - 1).flatten(1)
            shares = vote_shares(view, self.kernel).flatten(1) / view.index.shape[1]  # the mean over its KV heads
            best = torch.maximum(best, torch.zeros_like(best).scatter_add_(1, index, shares))
        for view in views:
            held = best.gather(1, view.index.clamp(0, width - 1).flatten(1)).view_as(view.index)
            view.memo[..., 0] = held.masked_fill(~view.valid, 0).double()

    def priority(self, view: TokenView) -> torch.Tensor:
        voted = view.memo[..., 0].nan_to_num(0.0).to(view.attention.dtype)  # tokens come with NaN: no vote yet
        score = vote_shares(view, self.kernel) + voted
        return score.masked_fill(view.is_recent(self.recent) | view.is_sink(self.sinks), torch.inf)

    def describe(self):
        return {**super().describe(), "voters": list(self.voters)}
