"""Perplexity over non-overlapping windows (the pruning papers' protocol)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def windows(token_arrays: Sequence[np.ndarray], length: int, max_windows: int | None = None) -> torch.Tensor:
    """Cut each array into non-overlapping windows of ``length`` tokens (tails dropped), stacked."""
    cut = [torch.from_numpy(a[: len(a) // length * length].astype(np.int64)).view(-1, length)
           for a in token_arrays if len(a) >= length]
    if not cut:
        raise ValueError(f"no text is at least {length} tokens long")
    stacked = torch.cat(cut)
    return stacked[:max_windows] if max_windows else stacked


LOGIT_BYTES = 2**30  # float32 logits one forward may produce


@torch.inference_mode()
def window_perplexity(
    model: torch.nn.Module,
    token_arrays: Sequence[np.ndarray],
    ctx: int,
    bos_id: int | None = None,
    batch_size: int = 8,
    max_windows: int | None = None,
    progress: bool = True,
) -> dict:
    """Mean NLL over every predicted token of windows of ``ctx`` tokens.

    With ``bos_id`` each window is ``[BOS] + ctx-1`` text tokens, as the model saw in training, and
    every text token is scored; without it the first token of each window is context only.
    """
    device = next(model.parameters()).device
    body = ctx - 1 if bos_id is not None else ctx
    data = windows(token_arrays, body, max_windows)
    # fewer windows per forward where the vocabulary is large: Gemma's 262K logits are 1 GiB per 1,024-token window
    batch_size = max(1, min(batch_size, LOGIT_BYTES // (ctx * model.config.get_text_config().vocab_size * 4)))
    total, count = 0.0, 0
    for start in tqdm(range(0, len(data), batch_size), desc="ppl", disable=not progress, leave=False):
        batch = data[start : start + batch_size].to(device)
        if bos_id is not None:
            batch = torch.cat([torch.full_like(batch[:, :1], bos_id), batch], dim=1)
        logits = model(input_ids=batch).logits.float()
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += nll.item()
        count += batch[:, 1:].numel()
    return {"nll": total / count, "ppl": math.exp(total / count), "tokens": count, "windows": len(data)}


@torch.inference_mode()
def second_half_perplexity(model: torch.nn.Module, tokens: np.ndarray, ctx: int, bos_id: int | None = None,
                           batch_size: int = 8, max_windows: int | None = None, progress: bool = True) -> dict:
    """llama.cpp's ``llama-perplexity`` protocol, so that the two engines score the same tokens: ``tokens`` (a whole
    text, BOS first where the model adds one) cut into windows of ``ctx``, each window's first token replaced by
    BOS, and only the predictions from position ``ctx // 2`` on scored (each with at least half a window before it).
    """
    if len(tokens) < 2 * ctx:
        raise ValueError(f"the text is {len(tokens):,} tokens; llama.cpp's protocol needs at least 2 x ctx = "
                         f"{2 * ctx:,}")
    device = next(model.parameters()).device
    data = windows([tokens], ctx, max_windows)
    if bos_id is not None:
        data[:, 0] = bos_id
    first = ctx // 2
    batch_size = max(1, min(batch_size, LOGIT_BYTES // ((ctx - first) * model.config.get_text_config().vocab_size * 4)))
    total, count = 0.0, 0
    for start in tqdm(range(0, len(data), batch_size), desc="ppl", disable=not progress, leave=False):
        batch = data[start : start + batch_size].to(device)
        logits = model(input_ids=batch, logits_to_keep=ctx - first).logits[:, :-1].float()
        targets = batch[:, first + 1:]
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        count += targets.numel()
    return {"nll": total / count, "ppl": math.exp(total / count), "tokens": count, "windows": len(data)}
