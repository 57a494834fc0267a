import torch

from sparsegen.kv.policy import Policy, TokenView

FLOOR = 1e-6  # a reference channel with no range (one token) divides by this instead of zero


class LagKV(Policy):
    """Score tokens against the partition after them (Liang et al., "LagKV: Lag-Relative Information of the KV Cache
    Tells Which Tokens Are Important", 2025). After the ``sinks``, tokens fall in partitions of ``lag`` positions;
    a partition's keys and values are min-max normalised by the per-channel range of the next partition that still
    holds tokens, and each token scores the spread (standard deviation over channels) of its normalised key and value,
    softmaxed within its partition, key and value added. A partition whose next one has not been seen whole is kept
    (the recent window), as are the sinks. No attention needed: it runs under any attention backend. Keys as stored:
    rotated at their positions, or not rotated under rolling positions."""

    name = "lagkv"
    needs_keys = True
    needs_values = True

    def __init__(self, budget: int, sinks: int = 4, lag: int | None = None):
        super().__init__(budget)
        if not 0 <= sinks < budget:
            raise ValueError(f"lagkv: sinks ({sinks}) must be in [0, budget={budget})")
        self.sinks = sinks
        self.lag = lag or max(2, (budget - sinks) // 8)
        if 2 * self.lag + sinks >= budget:
            raise ValueError(f"lagkv: a budget of {budget} cannot hold {sinks} sinks and two partitions of "
                             f"{self.lag} (the recent ones it keeps); raise the budget")

    def priority(self, view: TokenView) -> torch.Tensor:
        member = view.valid & (view.index >= self.sinks)
        part = torch.div(view.index - self.sinks, self.lag, rounding_mode="floor").clamp(min=-1) + 1  # 0: not in one
        part = torch.where(member, part, 0)
        complete = (part + 1) * self.lag + self.sinks <= view.seen[:, None, None]  # the next partition seen whole
        buckets = int(part.max()) + 2  # partitions 1.., bucket 0 for the rest, and one past the last
        reference = _next_held(part, member, buckets)
        scored = member & complete & (reference > 0)
        score = sum(_spread_softmax(x, part, reference, scored, buckets) for x in (view.keys, view.values))
        return torch.where(scored, score, torch.inf)

    def describe(self) -> dict:
        return {**super().describe(), "sinks": self.sinks, "lag": self.lag}


def _next_held(part: torch.Tensor, member: torch.Tensor, buckets: int) -> torch.Tensor:
    """For each slot, the nearest later partition that holds a token (0 if none)."""
    held = torch.zeros(*part.shape[:2], buckets, dtype=torch.bool, device=part.device).scatter_(2, part, member)
    ids = torch.arange(buckets, device=part.device).expand_as(held)
    later = torch.where(held, ids, buckets)[..., 1:]  # bucket p looks at p + 1 onwards
    suffix = later.flip(-1).cummin(-1).values.flip(-1)
    nearest = torch.cat([suffix, suffix.new_full((*suffix.shape[:2], 1), buckets)], -1)
    found = nearest.gather(2, part)
    return torch.where(found < buckets, found, 0)


def _spread_softmax(x: torch.Tensor, part: torch.Tensor, reference: torch.Tensor, scored: torch.Tensor,
                    buckets: int) -> torch.Tensor:
    """Per slot: the std over channels of ``x`` min-max normalised by its reference partition's held range, softmaxed
    over the scored slots of its own partition (float64, so rounding never orders two tokens)."""
    x = x.double()
    batch, heads, _, dim = x.shape
    member = (part > 0)[..., None].expand_as(x)
    index = part[..., None].expand_as(x)
    low = x.new_full((batch, heads, buckets, dim), torch.inf).scatter_reduce(
        2, index, x.masked_fill(~member, torch.inf), "amin")
    high = x.new_full((batch, heads, buckets, dim), -torch.inf).scatter_reduce(
        2, index, x.masked_fill(~member, -torch.inf), "amax")
    ref = reference[..., None].expand_as(x)
    low, high = low.gather(2, ref), high.gather(2, ref)
    spread = ((x - low) / (high - low).clamp(min=FLOOR)).std(-1).masked_fill(~scored, -torch.inf)
    peak = spread.new_full((batch, heads, buckets), -torch.inf).scatter_reduce(2, part, spread, "amax")
    weight = (spread - peak.gather(2, part)).exp().masked_fill(~scored, 0)
    total = weight.new_zeros(batch, heads, buckets).scatter_add(2, part, weight)
    return weight / total.gather(2, part).clamp(min=torch.finfo(torch.float64).tiny)
