"""Rotary position embeddings applied at positions of the cache's choosing: keys turned back to their original
positions or on to their rank inside the cache (StreamingLLM's rolling positions), with each layer kind's own
RoPE (Gemma 3's local and global layers differ)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
import torch.nn.functional as F

T = TypeVar("T")


def memoized(memo: dict | None, key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()`` kept in ``memo`` (``Step.memo``: a dict the layers of one step share) under ``key``, so that
    the step's other layers reuse it instead of computing it again; computed afresh where there is no memo."""
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


class Rotary:
    """The model's own rotary embedding, used to move keys and queries between positions exactly as it would."""

    def __init__(self, module: torch.nn.Module, layer_type: str | None = None):
        self.module = module
        self.layer_type = layer_type  # models with one rotary module for several layer types (Gemma 3) take it
        scale = getattr(module, f"{layer_type}_attention_scaling", None) if layer_type else None
        self.scale = float(scale if scale is not None else getattr(module, "attention_scaling", 1.0))
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._turns: torch.Tensor | None = None
        self._frequencies: torch.Tensor | None = None
        self._exact: bool | None = None

    @classmethod
    def of(cls, model: torch.nn.Module, layer_idx: int = 0) -> Rotary:
        """The rotary embedding layer ``layer_idx`` uses (sliding and global layers may rotate differently)."""
        module = getattr(model.get_decoder(), "rotary_emb", None)
        if module is None:
            raise ValueError(
                f"rolling positions need rotary position embeddings (RoPE), but {model.config.model_type} uses learned "
                f"absolute positions; use positions='original' (--positions original)"
            )
        layer_types = getattr(model.config.get_text_config(), "layer_types", None)
        layer_type = layer_types[layer_idx] if layer_types else None
        local = getattr(model.get_decoder(), "rotary_emb_local", None)  # older Gemma 3 code: a module for local layers
        if local is not None and layer_type == "sliding_attention":
            module = local
        if "layer_type" not in inspect.signature(module.forward).parameters:
            layer_type = None
        rope_type = getattr(module, "rope_type", "default")
        rope_type = str(rope_type.get(layer_type, "default") if isinstance(rope_type, dict) else rope_type)
        if "dynamic" in rope_type or "longrope" in rope_type:
            raise ValueError(f"rolling positions do not support the length-dependent RoPE type {rope_type!r}; "
                             f"use positions='original'")
        return cls(module, layer_type)

    def _angles(self, x: torch.Tensor, positions: torch.Tensor):
        if self.layer_type is None:
            return self.module(x, positions)
        return self.module(x, positions, self.layer_type)

    def cos_sin(self, x: torch.Tensor, positions: torch.Tensor, bound: int | None = None):
        """``cos, sin`` of shape ``positions.shape + (dim,)``. With ``bound`` (all positions are below it) they come
        from a table computed once, the same numbers the module gives position by position."""
        if bound is None:
            cos, sin = self._angles(x, positions.reshape(-1, positions.shape[-1]))
            return cos.reshape(*positions.shape, -1), sin.reshape(*positions.shape, -1)
        table = self._table
        if table is None or table[0].shape[0] < bound or table[0].device != x.device or table[0].dtype != x.dtype:
            cos, sin = self._angles(x, torch.arange(bound, device=x.device)[None])
            table = self._table = (cos[0], sin[0])
        return F.embedding(positions, table[0]), F.embedding(positions, table[1])

    def turns(self, x: torch.Tensor, bound: int) -> torch.Tensor:
        """The rotation to each position below ``bound`` as complex numbers ``[bound, dim/2]``, one per pair of
        rotated dimensions (HF's halves layout): rotating a vector made ``complex_pairs`` is then one product."""
        table = self._turns
        if table is None or table.shape[0] < bound or table.device != x.device:
            cos, sin = self.cos_sin(x.float(), torch.arange(bound, device=x.device), bound)
            half = cos.shape[-1] // 2
            if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
                raise ValueError("this model's rotary embedding does not rotate dimension i with i + dim/2; "
                                 "use positions='original'")
            table = self._turns = torch.complex(cos[:, :half], sin[:, :half])
        return table

    @staticmethod
    def complex_pairs(x: torch.Tensor, dim: int) -> torch.Tensor:
        """The first ``dim`` dimensions of ``x`` as ``dim/2`` complex numbers (i with i + dim/2), in fp32."""
        x = x.float()
        return torch.complex(x[..., : dim // 2], x[..., dim // 2 : dim])

    def rotate(self, x: torch.Tensor, positions: torch.Tensor | None, inverse: bool = False,
               bound: int | None = None, angles: tuple[torch.Tensor, torch.Tensor] | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x[..., L, D]`` to ``positions[..., L]`` (broadcast over x's leading dims), or undo that.
        ``angles``: the ``cos_sin`` of those positions, when already computed; ``out``: where to write."""
        cos, sin = angles if angles is not None else self.cos_sin(x, positions, bound)
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(-4), sin.unsqueeze(-4)
        dim = cos.shape[-1]
        rot, rest = x[..., :dim], x[..., dim:]
        # out= into a view has no graph (compile) and no gradient (a forward under autograd): assign instead
        if out is not None and not inverse and (torch.compiler.is_compiling() or torch.is_grad_enabled()):
            half = dim // 2
            x1, x2 = rot[..., :half], rot[..., half:]
            out[..., :half] = x1 * cos[..., :half] - x2 * sin[..., :half]
            out[..., half:dim] = x2 * cos[..., half:] + x1 * sin[..., half:]
            out[..., dim:] = rest
            return out
        if out is not None and not inverse:  # the same sums, written in place (no temporaries the size of x)
            half = dim // 2
            x1, x2 = rot[..., :half], rot[..., half:]
            torch.mul(x1, cos[..., :half], out=out[..., :half]).addcmul_(x2, sin[..., :half], value=-1)
            torch.mul(x2, cos[..., half:], out=out[..., half:dim]).addcmul_(x1, sin[..., half:])
            out[..., dim:] = rest
            return out
        half = torch.cat((-rot[..., dim // 2 :], rot[..., : dim // 2]), dim=-1)
        if inverse:
            out = (rot * cos - half * sin) / (self.scale * self.scale)
        else:
            out = rot * cos + half * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out

    @property
    def exact(self) -> bool:
        """Whether ``turn`` can turn vectors exactly as the module does (its frequencies are a buffer we can read
        and they give the module's own angles): checked once, on the first 256 positions."""
        if self._exact is None:
            own = getattr(self.module, f"{self.layer_type}_inv_freq", None) if self.layer_type else None
            own = own if own is not None else getattr(self.module, "inv_freq", None)
            self._exact = isinstance(own, torch.Tensor)
            if self._exact:
                self._frequencies = own.detach().double()
                probe = torch.zeros(1, dtype=torch.float32, device=own.device)
                positions = torch.arange(256, device=own.device)
                theirs = self.cos_sin(probe, positions[None])
                ours = self._exact_angles(probe, positions[None])
                self._exact = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(theirs, ours))
        return self._exact

    def _exact_angles(self, x: torch.Tensor, positions: torch.Tensor):
        """``cos, sin`` at ``positions`` computed in float64: exact at any position (fp32 angles at position 10^6 are
        off by up to 0.06 rad in the fastest-turning pair, so keys and queries turned to their token index in fp32
        would drift apart over an endless stream)."""
        angle = positions[..., None].double() * self._frequencies.to(positions.device)
        angle = torch.cat((angle, angle), dim=-1)
        return (angle.cos() * self.scale).to(x.dtype), (angle.sin() * self.scale).to(x.dtype)

    def turn(self, x: torch.Tensor, positions: torch.Tensor, index: torch.Tensor, memo: dict | None = None,
             memo_key: tuple = ()) -> torch.Tensor:
        """``x[B, H, q, D]`` as the model rotated it (to ``positions[B, q]``) turned to ``index[B, 1, q]`` instead, in
        one rotation: by the exact angle at ``index`` less the model's own at ``positions`` (from the cos/sin the
        model used, so its rotation is undone exactly). ``memo``: a dict shared by the layers of one step, where the
        angles are kept under ``memo_key`` (``index`` must be the same for every layer that passes it)."""
        def angles() -> tuple[torch.Tensor, torch.Tensor]:
            model_cos, model_sin = self.cos_sin(x, positions[:, None, :])
            cos, sin = self._exact_angles(x, index)
            square = self.scale * self.scale
            return (cos * model_cos + sin * model_sin) / square, (sin * model_cos - cos * model_sin) / square

        return self.rotate(x, None, angles=memoized(memo, ("turn", self.layer_type, *memo_key), angles))

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor, memo: dict | None = None) -> torch.Tensor:
        """Undo the model's rotation of new tokens: ``x[B, H, q, D]`` at ``positions[B, q]`` (``memo``: a dict
        shared by the layers of one step, so the angles are computed once)."""
        angles = memoized(memo, ("model positions", self.layer_type), lambda: self.cos_sin(x, positions[:, None, :]))
        return self.rotate(x, None, inverse=True, angles=angles)
