import torch

from sparsegen.kv.policy import Policy, TokenView, register_policy


@register_policy
class ExpectedAttention(Policy):
    """Expected Attention (Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future
    Queries Distribution", 2025), as kvpress's press computes it: each query head's queries still to come are taken as
    Gaussian, with the mean and covariance of those it has seen (un-rotated, past the ``sinks``), turned by RoPE's
    rotation averaged over the next ``future`` positions. A key's expected logit under them is ``mu . k + k^T S k / 2``
    (the log of ``E[exp(q . k)]``); its softmax over the held tokens but the sinks, averaged over the KV head's query
    heads and times the value's norm (what the token would move the output by), is the token's score. The sinks are
    kept.

    A fresh cache's first pass (a context) is scored whole, once all its queries are seen (``compresses_whole``); so is
    every token a row holds when a later multi-token call takes it over its budget. A decode step's eviction ranks by
    the logits the held tokens last got (kept in ``memo``), its own token's by the queries before it: a pass over the
    held keys per step would cost several times the step's weights (a ``D x D`` form per key and query head)."""

    name = "expected-attention"
    needs_keys = needs_values = needs_queries = True
    compresses_whole = True
    memo_width, memo_per_query_head = 1, True  # each query head's logit of the token

    def __init__(self, budget: int | None, future: int = 512, sinks: int | None = None, covariance: bool = True):
        super().__init__(budget)
        if isinstance(future, bool) or not isinstance(future, int) or future < 1:
            raise ValueError(f"{self.name}: future is a number of positions, at least 1, got {future!r}")
        if sinks is None:  # kvpress's 4, fewer where the budget is smaller
            sinks = 4 if budget is None else min(4, budget - 1)
        if budget is not None and not 0 <= sinks < budget:
            raise ValueError(f"{self.name}: sinks ({sinks}) must be at least 0 and under the budget ({budget}): raise "
                             "the budget or lower --sinks")
        self.future, self.sinks, self.covariance = future, sinks, covariance

    def logits(self, view: TokenView, keys: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, T, group]``: each of ``keys``' (``[B, Hkv, T, D]``) expected logit under each of its KV head's
        query heads' future queries."""
        moments = view.queries  # [B, Hq, D + 1, D + 1]
        count = moments[..., -1:, -1:].clamp(min=1)
        mean = moments[..., :-1, -1:] / count  # [B, Hq, D, 1]
        spread = moments[..., :-1, :-1] / count - mean @ mean.transpose(-1, -2)  # [B, Hq, D, D]
        if view.rotary is not None:  # the mean rotation R over the next positions: R mu, and R S R^T
            ahead = view.seen[:, None] + torch.arange(self.future, device=view.seen.device)  # [B, future]
            angles = tuple(angle.mean(1)[:, None, None] for angle in view.rotary.cos_sin(moments, ahead))
            mean = view.rotary.rotate(mean.transpose(-1, -2), None, angles=angles).transpose(-1, -2)
            spread = view.rotary.rotate(view.rotary.rotate(spread, None, angles=angles).transpose(-1, -2), None,
                                        angles=angles)
        batch, kv_heads, _, dim = keys.shape
        keys = keys.float()[:, :, None]  # [B, Hkv, 1, T, D] against each of the KV head's query heads
        logit = (keys @ mean.view(batch, kv_heads, -1, dim, 1))[..., 0]  # [B, Hkv, group, T]
        if self.covariance:
            logit = logit + ((keys @ spread.view(batch, kv_heads, -1, dim, dim)) * keys).sum(-1) / 2
        return logit.transpose(-1, -2)

    def memorize(self, view: TokenView) -> None:
        if view.new:  # the call's own tokens, by the queries before them
            view.memo[:, :, -view.new:] = self.logits(view, view.keys[:, :, -view.new:]).double()

    def priority(self, view: TokenView) -> torch.Tensor:
        if view.new != 1:  # a prompt chunk's eviction, or a context's compression: the rows over budget anew
            over = (view.valid.sum(-1) > self.budget)[..., None, None]
            view.memo.copy_(torch.where(over, self.logits(view, view.keys).double(), view.memo))
        sink = view.is_sink(self.sinks)  # (kept, and left out of the softmax, as kvpress scores only the others)
        expected = view.memo.float().masked_fill(~view.valid[..., None] | sink[..., None], -torch.inf)
        return (expected.softmax(-2).mean(-1) * view.values.float().norm(dim=-1)).masked_fill(sink, torch.inf)

    def describe(self):
        return {**super().describe(), "future": self.future, "sinks": self.sinks, "covariance": self.covariance}
