import math

import torch

from sparsegen.kv.policies.h2o import H2O
from sparsegen.kv.policy import TokenView, register_policy


@register_policy
class AdaKV(H2O):
    """Ada-KV (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
    Inference", 2024) over H2O's scores: each KV head keeps its sinks and recent tokens, and the layer's heavy-hitter
    slots (``heavy`` per head on average) go to the highest-scoring tokens of whichever heads score highest, so a head
    whose attention is concentrated holds few tokens and a head whose attention is spread holds many; every head
    keeps at least ``floor`` of its share (the paper's safeguard, 0.2). The layer's heads share one pool of slots
    (``shares_slots``): storage is sized by the layer's total, not by its largest head."""

    name = "adakv"
    shares_slots = True

    def __init__(self, budget: int, recent: int | None = None, heavy: int | None = None, sinks: int = 0,
                 floor: float = 0.2):
        super().__init__(budget, recent=recent, heavy=heavy, sinks=sinks)
        if not 0 <= floor <= 1:
            raise ValueError(f"floor (the share of its heavy budget a head always keeps) must be in [0, 1], got "
                             f"{floor}")
        self.floor = floor

    def priority(self, view: TokenView) -> torch.Tensor:
        return self.share_heavy(view, view.attention)

    def share_heavy(self, view: TokenView, scores: torch.Tensor) -> torch.Tensor:
        """Ada-KV's allocation over per-slot ``scores`` ``[batch, 1, slots]``: sinks, recent tokens and each head's
        best ``floor`` share of its heavy hitters are kept (inf); the rest compete across the layer's heads."""
        protected = view.is_recent(self.recent) | view.is_sink(self.sinks)
        candidates = scores.masked_fill(protected | ~view.valid, -math.inf)
        guaranteed = min(math.floor(self.floor * self.heavy), candidates.shape[-1])
        if guaranteed:  # each head's best `guaranteed` heavy hitters (ties at the cut included)
            heads = torch.arange(view.heads, device=scores.device)[None, :, None]
            head = 0 if view.head is None else view.head  # (one KV head: a row of its own)
            per_head = candidates.masked_fill(head != heads, -math.inf)  # [batch, heads, slots]
            cut = per_head.topk(guaranteed, dim=-1).values[..., -1:]
            protected = protected | ((per_head >= cut) & (per_head > -math.inf)).any(1, keepdim=True)
        return scores.masked_fill(protected, math.inf)

    def describe(self):
        return {**super().describe(), "per_head": "adaptive", "floor": self.floor}
