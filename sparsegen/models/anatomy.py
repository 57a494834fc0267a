"""Where things are inside a decoder-only model, per family: its decoder layers, their linears, the MLP's neuron
layout and the attention's head layout. Every kind of sparsity finds the parts it changes here."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

from sparsegen.models.families import FAMILIES, family


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}; sparsegen supports decoder-only "
                         f"LMs whose decoder has a .layers list (Llama, Mistral, Qwen, Gemma 3, GPT-NeoX, Phi-3, OPT)")
    return layers


def linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """Every linear of a decoder layer, by its path inside the layer."""
    return {name: module for name, module in layer.named_modules() if isinstance(module, nn.Linear)}


def weights_of(model: nn.Module) -> str:
    """The kind of weights ``model`` runs (``sparsegen.quant.restore.quantize_weights`` records it): fp32 (as loaded)
    unless re-stored."""
    return getattr(model.config, "sparsegen_weights", "fp32")


def mlp_layout(model_type: str) -> tuple[tuple[str, ...], str]:
    """(names of the layers whose output rows are the MLP's neurons, the layer whose input columns are)."""
    return family(model_type).mlp


def head_families() -> list[str]:
    """Families whose q/k/v/o projections are sized by head counts (KV groups can be removed or skipped)."""
    return [name for name, f in FAMILIES.items() if f.separate_heads]


def neuron_count(layer: nn.Module, model_type: str) -> int:
    """MLP neurons of a decoder layer (the input width of its output projection)."""
    return layer.get_submodule(mlp_layout(model_type)[1]).in_features


def attention_heads(attention: nn.Module) -> tuple[int, int, int]:
    """``(query heads, KV heads, head_dim)`` of an attention module, from its projections."""
    head_dim = attention.head_dim
    return attention.q_proj.out_features // head_dim, attention.k_proj.out_features // head_dim, head_dim


def group_count(layer: nn.Module) -> int:
    """KV head groups of a decoder layer."""
    return attention_heads(layer.self_attn)[1]


PINNED = "sparsegen_pinned_tokens"  # set on the decoder by whatever puts a prefix before every sequence


def pinned_tokens(model: nn.Module) -> int:
    """Positions a prompt prefix takes before every sequence (0 without one): caches never evict them, and the
    text's positions start after them."""
    return getattr(model.get_decoder(), PINNED, 0)


def context_length(model: nn.Module) -> int | None:
    """The most positions the model was trained for (its config's ``max_position_embeddings``; None if it has none)."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


SAMPLE = 4096  # elements of each weight read into the fingerprint (evenly spaced): enough to tell pruned or
# quantized weights, or another checkpoint of the same architecture, apart without hashing every byte


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hash of the model's config and a sample of every weight and buffer: equal for the same checkpoint loaded
    the same way, different for another architecture, checkpoint, pruning or quantization."""
    digest = hashlib.sha256()
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config.pop(volatile, None)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted([*model.named_parameters(), *model.named_buffers()], key=lambda item: item[0]):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].contiguous().cpu()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]
