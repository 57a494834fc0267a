"""Several caches' tokens in one forward: a server's decoding rows and a prompt's next chunk, packed along the
sequence of a one-row call (Sarathi-Serve's stall-free batching).

Everything in a decoder layer but attention works token by token, so the model runs once over all the tokens —
one read of the weights and one pass of per-op overhead where two forwards paid both — and only attention is split:
each part's queries attend over its own cache, which stores its own keys and values and evicts as in its own
forward. A decode step with a prompt chunk packed in then costs the step plus the chunk's marginal work, not a
whole second forward, so a long prompt arriving delays the others' next tokens by far less.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from sparsegen.kv.cache import EvictionCache


def split(tokens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed call's ``[1, heads, rows + chunk, D]`` -> the decoding rows' ``[rows, heads, 1, D]`` and the chunk's
    ``[1, heads, chunk, D]``."""
    return tokens[:, :, :rows].transpose(0, 2), tokens[:, :, rows:]


class PackedLayer(CacheLayerMixin):
    """One layer of a ``PackedStep``: splits the call's keys and values between the parts' layers."""

    is_compileable = False

    def __init__(self, parts: tuple[EvictionCache, EvictionCache], rows: int, layer_idx: int):
        super().__init__()
        # (the parts, not the ``PackedStep``: no reference cycle keeps the caches alive after the step)
        self.parts, self.rows, self.layer_idx = parts, rows, layer_idx
        self.is_sliding = parts[0].layers[layer_idx].is_sliding
        self.updated: list[tuple[torch.Tensor, torch.Tensor]] = []  # each part's (keys, values) to attend over

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.updated = [part.layers[self.layer_idx].update(keys, values) for part, keys, values
                        in zip(self.parts, split(key_states, self.rows), split(value_states, self.rows))]
        return key_states, value_states  # (unused: attention reads ``updated``)

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return query_length, 0  # (sparsegen's attention builds each part's mask itself)

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length


class PackedStep(Cache):
    """Pass as the cache of one forward whose ``[1, rows + chunk]`` tokens are ``decoding``'s next token of each of
    its ``rows`` rows, then ``chunk`` tokens of ``prefilling``'s one sequence; positions ``[1, rows + chunk]``
    likewise. Neither cache may be padded in this call (no attention mask)."""

    evicting = packed = True  # (how the prepared model's attention tells it from one cache)

    def __init__(self, decoding: EvictionCache, prefilling: EvictionCache):
        if decoding.pinned:
            raise ValueError("a packed step cannot feed a model with a prompt prefix (it is put before each call's "
                             "first sequence): run the decode step and the chunk as two forwards")
        if prefilling.seen is not None and prefilling.seen.shape[0] != 1:
            raise ValueError("a packed step prefills one sequence")
        self.parts = (decoding, prefilling)
        self.rows = decoding.seen.shape[0] if decoding.seen is not None else 0
        if not self.rows:
            raise ValueError("a packed step needs decoding rows that have seen their prompts")
        super().__init__(layers=[PackedLayer(self.parts, self.rows, i) for i in range(len(decoding.layers))])

    def join(self, decoded: torch.Tensor, prefilled: torch.Tensor) -> torch.Tensor:
        """The parts' attention outputs (``[batch, q, heads, D]``) back in the call's token order."""
        return torch.cat((decoded.transpose(0, 1), prefilled), dim=1)

    def attend(self, layer_idx: int, query: torch.Tensor, attention) -> torch.Tensor:
        """``attention(cache, layer, query, keys, values)`` of each part over its own cache, joined."""
        updated = self.layers[layer_idx].updated
        outs = [attention(part, part.layers[layer_idx], part_query, *kv)
                for part, part_query, kv in zip(self.parts, split(query, self.rows), updated)]
        self.layers[layer_idx].updated = []
        return self.join(*outs)

    # --- driven by the hook around the decoder's forward ---
    def begin_step(self, batch: int, q: int, attention_mask: torch.Tensor | None,
                   position_ids: torch.Tensor | None, device: torch.device) -> None:
        if batch != 1 or attention_mask is not None or position_ids is None or q <= self.rows:
            raise ValueError(f"a packed step is one unpadded row of the {self.rows} decoding tokens then the chunk's, "
                             "with their positions")
        decoding, prefilling = self.parts
        positions = position_ids.expand(1, q)
        decoding.begin_step(self.rows, 1, None, positions[:, :self.rows].T, device)
        prefilling.begin_step(1, q - self.rows, None, positions[:, self.rows:], device)

    def end_step(self) -> None:
        for part in self.parts:
            part.end_step()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        if not isinstance(query_length, int):
            query_length = query_length.shape[-1]
        return query_length, 0
