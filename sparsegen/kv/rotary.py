"""Rotary position embeddings applied at positions of the cache's choosing: keys turned back to their original
positions or on to their rank inside the cache (StreamingLLM's rolling positions), with each layer kind's own
RoPE (Gemma 3's local and global layers differ)."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F


class Rotary:
    """The model's own rotary embedding, used to move keys and queries between positions exactly as it would."""

    def __init__(self, module: torch.nn.Module, layer_type: str | None = None):
        self.module = module
        self.layer_type = layer_type  # models with one rotary module for several layer types (Gemma 3) take it
        scale = getattr(module, f"{layer_type}_attention_scaling", None) if layer_type else None
        self.scale = float(scale if scale is not None else getattr(module, "attention_scaling", 1.0))
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._turns: torch.Tensor | None = None

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

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor, memo: dict | None = None) -> torch.Tensor:
        """Undo the model's rotation of new tokens: ``x[B, H, q, D]`` at ``positions[B, q]`` (``memo``: a dict
        shared by the layers of one step, so the angles are computed once)."""
        if memo is None:
            return self.rotate(x, positions[:, None, :], inverse=True)
        angles = memo.get(("model positions", self.layer_type))
        if angles is None:
            angles = memo[("model positions", self.layer_type)] = self.cos_sin(x, positions[:, None, :])
        return self.rotate(x, None, inverse=True, angles=angles)
