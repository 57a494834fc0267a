import torch

from sparsegen.kv.policy import Policy, TokenView, register_policy

FLOOR = 1e-6  # a reference channel with no range (one token) divides by this instead of zero


@register_policy
class LagKV(Policy):
    """Score tokens against the partition after them (Liang et al., "LagKV: Lag-Relative Information of the KV Cache
    Tells Which Tokens Are Important", 2025). After the ``sinks``, tokens fall in partitions of ``lag`` positions.
    When a partition's next one has been seen whole, each of its tokens gets the spread (standard deviation over
    channels) of its key, and of its value, min-max normalised by that next partition's per-channel range; computed
    once per token (the memo), as the paper compresses a partition once. A token's priority is its key and its value
    spread, each softmaxed over its partition's tokens still held, added: a partition that has lost tokens protects
    the rest. Until the next partition is whole a partition is kept (the recent window), as are the sinks. No
    attention needed: it runs under any attention backend. Keys as stored: rotated at their positions, or not rotated
    under rolling positions."""

    name = "lagkv"
    memo_width = 2  # exp(spread - the partition's largest) of the key and of the value
    reads_host = True  # whether a partition is due, and how many are

    def __init__(self, budget: int, sinks: int = 4, lag: int | None = None):
        super().__init__(budget)
        if not 0 <= sinks < budget:
            raise ValueError(f"lagkv: sinks ({sinks}) must be in [0, budget={budget}): raise the budget or lower the "
                             "sinks")
        self.sinks = sinks
        self.lag = lag or max(2, (budget - sinks) // 8)
        if 2 * self.lag + sinks >= budget:
            raise ValueError(f"lagkv: a budget of {budget} cannot hold {sinks} sinks and two partitions of "
                             f"{self.lag} (the recent ones it keeps); raise the budget")

    def _partitions(self, view: TokenView) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's partition, and whether the partition after it has been seen whole."""
        member = view.valid & (view.index >= self.sinks)
        part = torch.div(view.index - self.sinks, self.lag, rounding_mode="floor").masked_fill(~member, -1)
        return part, member & ((part + 2) * self.lag + self.sinks <= view.seen[:, None, None])

    def memorize(self, view: TokenView) -> None:
        part, complete = self._partitions(view)
        memo = view.memo
        memo.masked_fill_(~complete[..., None], torch.nan)  # not due yet, or due no more (its next one forgotten)
        due = complete & memo[..., 0].isnan()
        if not bool(due.any()):
            return
        # partitions from each row's first due one on, numbered from 1 (0: the rest, never read)
        first = part.masked_fill(~due, torch.iinfo(torch.long).max).amin(-1, keepdim=True)
        local = (part - first + 1).clamp(min=0).masked_fill(part < 0, 0)
        buckets = int(local.max()) + 2
        for column, x in enumerate((view.keys.double(), view.values.double())):
            low, high, held = _ranges(x, local, buckets)
            reference = (local + 1)[..., None].expand_as(x)
            low, high = low.gather(2, reference), high.gather(2, reference)
            spread = ((x - low) / (high - low).clamp(min=FLOOR)).std(-1)
            # a reference with no token left (evicted, then the tokens after it forgotten): all its tokens alike
            spread = torch.where(held.gather(2, local + 1), spread, 0.0).masked_fill(~due, -torch.inf)
            peak = spread.new_full(spread.shape[:2] + (buckets,), -torch.inf).scatter_reduce(2, local, spread, "amax")
            memo[..., column] = torch.where(due, (spread - peak.gather(2, local)).exp(), memo[..., column])

    def priority(self, view: TokenView) -> torch.Tensor:
        part, complete = self._partitions(view)
        scored = complete & ~view.memo[..., 0].isnan()
        weight = view.memo.nan_to_num(0.0) * scored[..., None]
        ids, slot_id = torch.unique(part.masked_fill(~scored, -1), return_inverse=True)  # compact partition ids
        total = weight.new_zeros(*part.shape[:2], ids.numel(), 2).scatter_add_(
            2, slot_id[..., None].expand_as(weight), weight)
        total = total.gather(2, slot_id[..., None].expand_as(weight)).clamp(min=torch.finfo(torch.float64).tiny)
        return torch.where(scored, (weight / total).sum(-1), torch.inf)

    def describe(self) -> dict:
        return {**super().describe(), "sinks": self.sinks, "lag": self.lag}


def _ranges(x: torch.Tensor, local: torch.Tensor, buckets: int) -> tuple[torch.Tensor, ...]:
    """Per row and partition bucket: each channel's smallest and largest held value, and whether it holds a token."""
    held = torch.zeros(*local.shape[:2], buckets, dtype=torch.bool, device=x.device).scatter_(2, local, True)
    index = local[..., None].expand_as(x)
    shape = (*x.shape[:2], buckets, x.shape[-1])
    low = x.new_full(shape, torch.inf).scatter_reduce(2, index, x, "amin")
    high = x.new_full(shape, -torch.inf).scatter_reduce(2, index, x, "amax")
    return low, high, held
