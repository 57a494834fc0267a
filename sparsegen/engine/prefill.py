"""A prompt into a cache, a chunk at a time: eviction runs between chunks, so a long prompt never holds more than the
budget plus one chunk."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from sparsegen.engine.reconstruct import compress_whole, reads_whole
from sparsegen.engine.step import forward


def prefill(model: torch.nn.Module, cache, ids: torch.Tensor, mask: torch.Tensor, chunk_size: int,
            progress: bool | None = None, first_chunk: int | None = None, start: int = 0,
            after_chunk: Callable[[], None] | None = None) -> torch.Tensor:
    """Feed left-padded ``ids`` into ``cache`` a chunk at a time (evicting between chunks); the last position's
    logits ``[B, vocab]``. ``first_chunk``: the first chunk's length instead (kvpress's protocol: a whole context in
    one pass, compressed once, then the question in chunks). ``start``: the first token's position (a cache that
    already holds a context). ``after_chunk``: called after each chunk (it may raise to stop a long prefill). Under a
    policy that ``compresses_whole`` (KVzip, Expected Attention), a fresh cache's first chunk (the whole prompt
    without ``first_chunk``) is held whole and compressed at its end (``sparsegen.engine.reconstruct``)."""
    length = ids.shape[1]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0) + start
    padded = not bool(mask.all())
    show = progress if progress is not None else length > 8 * chunk_size
    whole = reads_whole(cache)  # (a fresh cache's first pass, compressed as a whole)
    if whole:
        first_chunk = first_chunk or length
    starts = [0] + list(range(first_chunk, length, chunk_size)) if first_chunk else range(0, length, chunk_size)
    ends = list(starts[1:]) + [length]
    for start, end in tqdm(list(zip(starts, ends)), desc="prefill", unit="chunk", disable=not show, leave=False):
        if whole and start == 0:
            logits = compress_whole(model, cache, ids[:, :end], position_ids[:, :end],
                                    mask[:, :end] if padded else None, chunk_size)
        else:
            logits = forward(model, cache, ids[:, start:end], position_ids[:, start:end],
                             mask[:, :end] if padded else None, last=True)
        if after_chunk is not None:
            after_chunk()
    return logits


class PrefillBudget:
    """``prefill_budget="auto"``: the prompt tokens a step may encode while others decode, kept at what costs about one
    decode step (Sarathi-Serve's rule: a step with a chunk then takes at most about twice one without, so a long
    prompt arriving at most doubles the others' inter-token latency). Measured, not modelled: a chunk's cost (its
    own forward's time, or what it adds to the step it rides in) is ``fixed + per_token × n`` with both unknown and
    changing with the batch, so after each chunk the size is scaled by (decode step time / chunk cost), at most
    halved or doubled at once; it settles where a chunk costs a step. When chunks ride in the decode steps, every
    ``REFRESH``-th step decodes alone, so that the step time aimed at is the present batch's (a long run of prompts
    would otherwise leave it at a batch long gone)."""

    START = 16
    REFRESH = 8

    def __init__(self, chunk_size: int):
        self.chunk_size, self.tokens = chunk_size, min(self.START, chunk_size)
        self.step_seconds: float | None = None  # a moving average of the decode step's time
        self.packed = 0  # steps that carried a chunk since the last that decoded alone

    def may_pack(self) -> bool:
        return self.packed < self.REFRESH

    def decoded(self, seconds: float) -> None:
        self.step_seconds = seconds if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * seconds
        self.packed = 0

    def encoded(self, tokens: int, seconds: float) -> None:
        if self.step_seconds is None or seconds <= 0:
            return
        scale = min(2.0, max(0.5, self.step_seconds / seconds))
        self.tokens = max(1, min(self.chunk_size, round(tokens * scale)))
