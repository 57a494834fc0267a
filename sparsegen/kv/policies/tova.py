import torch

from sparsegen.kv.policy import Policy, TokenView, register_policy

HEADS = ("layer", "each")


@register_policy
class TOVA(Policy):
    """Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs", 2024): keep the tokens the
    current query attends to most; nothing accumulates. As in the paper (and kvpress's ``TOVAPress``), one choice
    per layer: the attention summed over all of the layer's query heads, so every KV head keeps the same tokens and a
    number spelled over several tokens keeps all of them in every head. ``heads="each"``: each KV head by its own
    query heads' attention (sparsegen's rule before 2026-11-28; on RULER's multi-value needles it kept a number's
    first digits and lost the rest: docs/results/smollm2/ruler/README.md)."""

    name = "tova"
    needs_attention = True
    attention_statistic = "latest"

    def __init__(self, budget: int | None, heads: str = "layer"):
        super().__init__(budget)
        if heads not in HEADS:
            raise ValueError(f"tova: heads must be one of {', '.join(HEADS)}, got {heads!r}")
        self.heads = heads

    def priority(self, view: TokenView) -> torch.Tensor:
        if self.heads == "each":
            return view.attention
        # (every KV head holds the same tokens in the same slots, as each evicts what the others do)
        return view.attention.sum(1, keepdim=True).expand_as(view.attention)

    def describe(self) -> dict:
        return {**super().describe(), "heads": self.heads}
