"""Does a model have an attention sink? Measured two ways, inside its trained length.

1. Per layer, the mean attention mass that queries at positions >= ``min_query`` put on position 0
   (compared with the mass a uniform distribution over the causal prefix would put there).
2. Perplexity of the last half of each window under three attention patterns: full causal, a local
   window without the first tokens, and the first ``sinks`` tokens plus a local window (StreamingLLM).
   These are masks over unchanged positions: a measurement of what the first tokens are worth, not eviction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sparsegen.eval.perplexity import windows
from sparsegen.models.compat import attention_implementation


def attention_mask(length: int, window: int | None = None, sinks: int = 0) -> torch.Tensor:
    """Boolean ``[length, length]``: query i sees key j if j <= i and (j > i - window or j < sinks)."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    keep = j <= i
    if window is not None:
        keep &= (j > i - window) | (j < sinks)
    return keep


def additive_mask(keep: torch.Tensor, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``[batch, 1, q, k]`` float mask every attention backend accepts (0 = attend, min = blocked)."""
    mask = torch.zeros(keep.shape, dtype=dtype, device=device)
    mask.masked_fill_(~keep.to(device), torch.finfo(dtype).min)
    return mask[None, None].expand(batch, 1, *keep.shape)


@torch.inference_mode()
def sink_statistics(
    model: torch.nn.Module,
    token_arrays: Sequence[np.ndarray],
    bos_id: int | None,
    length: int = 256,
    min_query: int = 64,
    scored_from: int = 128,
    window: int = 64,
    sinks: int = 4,
    max_windows: int = 128,
    batch_size: int = 8,
    progress: bool = True,
) -> dict:
    """Attention mass on token 0 per layer, and PPL of tokens ``scored_from..length-1`` under three masks.

    ``model`` must run with eager attention (``attn_implementation="eager"``) so it can return weights.
    Windows are ``[BOS] + length-1`` text tokens (or ``length`` text tokens without a BOS), spread
    evenly over the text.
    """
    if attention_implementation(model) != "eager":
        raise ValueError("attention weights are needed: load the model with attn_implementation='eager'")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    body = length - 1 if bos_id is not None else length
    data = windows(token_arrays, body)
    data = data[np.linspace(0, len(data) - 1, min(max_windows, len(data))).round().astype(int)]
    patterns = {
        "full": attention_mask(length),
        f"window_{window}": attention_mask(length, window=window),
        f"sinks_{sinks}+window_{window - sinks}": attention_mask(length, window=window - sinks, sinks=sinks),
    }
    mass = None
    nll = {name: 0.0 for name in patterns}
    scored = 0
    for start in tqdm(range(0, len(data), batch_size), desc="sink stats", disable=not progress, leave=False):
        batch = data[start : start + batch_size].to(device)
        if bos_id is not None:
            batch = torch.cat([torch.full_like(batch[:, :1], bos_id), batch], dim=1)
        targets = batch[:, scored_from:]
        for name, keep in patterns.items():
            out = model(input_ids=batch, attention_mask=additive_mask(keep, len(batch), dtype, device),
                        output_attentions=name == "full")
            logits = out.logits[:, scored_from - 1 : -1].float()
            nll[name] += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            if name == "full":
                # [layers, batch] mean over heads and queries >= min_query of the weight on key 0
                per_layer = torch.stack([a[:, :, min_query:, 0].float().mean(dim=(1, 2)) for a in out.attentions])
                mass = per_layer.sum(1) if mass is None else mass + per_layer.sum(1)
        scored += targets.numel()
    uniform = float(np.mean(1.0 / (np.arange(min_query, length) + 1)))
    return {
        "windows": len(data),
        "length": length,
        "min_query": min_query,
        "mass_on_token0_per_layer": [round(m, 5) for m in (mass / len(data)).tolist()],
        "uniform_mass": round(uniform, 5),
        "scored_tokens": f"{scored_from}-{length - 1}",
        "ppl": {name: round(math.exp(total / scored), 4) for name, total in nll.items()},
    }
