import torch

from sparsegen.kv.policies.adakv import AdaKV
from sparsegen.kv.policies.snapkv import SnapKV, pooled_votes
from sparsegen.kv.policy import TokenView, register_policy


@register_policy
class AdaSnapKV(AdaKV):
    """Ada-KV's allocation over SnapKV's scores (kvpress's ``AdaKVPress(SnapKVPress())``): each head's tokens are
    scored by the last ``window`` queries of each prompt chunk, pooled over the head's own neighbouring held tokens,
    and the window itself is kept; the layer's heavy-hitter slots then go to the highest-scoring tokens of whichever
    heads score highest, each head keeping at least ``floor`` of its share. A question's few queries decide what
    the whole context keeps, where ``adakv``'s H2O sums hear every query of the prompt."""

    name = "ada-snapkv"
    attention_statistic = "window"

    def __init__(self, budget: int, window: int | None = None, sinks: int = 0, floor: float = 0.2):
        window = min(32, budget // 4) if window is None else window
        super().__init__(budget, recent=window, sinks=sinks, floor=floor)
        self.window = window

    def priority(self, view: TokenView) -> torch.Tensor:
        head = torch.zeros_like(view.index) if view.head is None else view.head
        pooled = sum(torch.where(head == h, pooled_votes(view.index, view.valid & (head == h), view.attention,
                                                          SnapKV.kernel), 0) for h in range(view.heads))
        return self.share_heavy(view, pooled)

    def describe(self):
        return {**super().describe(), "window": self.window}
