"""A KV policy of your own, in one file: it only scores the tokens a layer holds; the cache keeps the highest scores
within the budget and frees the rest. Registering it makes it a policy like the built-in ones, by name, everywhere:

    python examples/custom_policy.py
    sparsegen --plugin examples/custom_policy.py generate --model smollm2 --policy strided --budget 256 --prompt ...
"""

import math

import torch

from sparsegen.kv import Policy, TokenView, register_policy


@register_policy
class Strided(Policy):
    """4 sinks, the recent half of the budget, and of the older tokens every ``stride``-th."""

    name = "strided"

    def __init__(self, budget: int, stride: int = 8):  # its options are its constructor's arguments
        super().__init__(budget)
        if stride < 1:
            raise ValueError(f"stride must be at least 1, got {stride}")
        self.stride = stride

    def priority(self, view: TokenView) -> torch.Tensor:
        keep = view.is_sink(4) | view.is_recent(self.budget // 2)
        return torch.where(keep, math.inf, -(view.index % self.stride).float())

    def describe(self) -> dict:
        return {**super().describe(), "stride": self.stride}


if __name__ == "__main__":
    import sparsegen

    model, tokenizer = sparsegen.load("reference")
    prompt = ("It was a dark and stormy night; the rain fell in torrents, except at occasional intervals, when it was "
              "checked by a violent gust of wind which swept up the streets.")
    result = sparsegen.generate(model, tokenizer, prompt, policy="strided", budget=16, max_new_tokens=48)
    print(result.text)
    print("held per layer:", result.cache["kv_tokens"], "of a budget of 16")
