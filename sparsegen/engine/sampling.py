"""How a token is chosen from logits: greedy below a tiny temperature, else softmax at the temperature, cut to the
nucleus (``top_p``), sampled from a seeded generator."""

from __future__ import annotations

import math

import torch

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM does): logits / T overflow long before T = 0


def check_sampling(temperature: float, top_p: float, seed: int = 0) -> None:
    """Refuse sampling settings that cannot be honoured, before any work (NaN compares false with every bound)."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution a token is sampled from (fp32, over the last dimension): softmax at ``temperature``, cut
    to the smallest set of tokens whose mass reaches ``top_p``. Unnormalised after the cut (multinomial does not
    care; speculative sampling compares ratios, so normalise before comparing distributions of two caches)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
    return probs


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None):
    if temperature < GREEDY_BELOW:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=generator).squeeze(-1)
