"""What sparsegen needs to know about a model's shape, read from its config alone (no weights loaded)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from sparsegen.models.loading import DTYPES, load_config
from sparsegen.models.rebuild import rebuild


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str
    model_type: str
    params: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int | None
    positions: str  # "rope" or "learned"
    dtype: str
    kv_bytes_per_token: int

    def to_dict(self) -> dict:
        return asdict(self)


def _dtype_name(config: PretrainedConfig, dtype: str | None) -> str:
    if dtype is not None:
        return str(DTYPES[dtype]).removeprefix("torch.")
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(saved).removeprefix("torch.")


def count_params(config: PretrainedConfig) -> int:
    """Parameters of the model the config describes, built on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()  # transformers 5.0 does not tie in from_config
        rebuild(model, config, only="sparsegen_structure")  # structurally pruned: every layer at its recorded size
    return sum(p.numel() for p in model.parameters())


def kv_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a config (MHA models have as many KV heads as query heads)."""
    text = config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(config: PretrainedConfig, element_size: int, quantization=None) -> int:
    """K and V bytes one token costs over all layers, at ``element_size`` bytes per number (or as a
    ``KVQuantization`` stores them)."""
    layers, kv_heads, head_dim = kv_shape(config)
    groups = (getattr(config, "sparsegen_structure", None) or {}).get("kv_groups")  # heads pruned per layer
    heads = sum(groups) if groups else layers * kv_heads
    return heads * (quantization.token_bytes(head_dim) if quantization else 2 * head_dim * element_size)


def kv_bytes_per_sequence(config: PretrainedConfig, element_size: int, quantization=None) -> int:
    """K and V bytes one sequence costs besides its tokens: a quantized cache's channel scales and residual."""
    if quantization is None:
        return 0
    layers, kv_heads, head_dim = kv_shape(config)
    return layers * quantization.row_bytes(kv_heads, head_dim, element_size)


def spec_from_config(config: PretrainedConfig, name: str, dtype: str | None = None) -> ModelSpec:
    text = config.get_text_config()
    _, kv_heads, head_dim = kv_shape(config)
    dtype_name = _dtype_name(text, dtype)
    element = torch.tensor([], dtype=getattr(torch, dtype_name)).element_size()
    rope = (getattr(text, "rope_parameters", None) or getattr(text, "rope_theta", None)
            or getattr(text, "rotary_pct", None))
    return ModelSpec(
        name=name,
        architecture=(config.architectures or [type(config).__name__])[0],
        model_type=config.model_type,
        params=count_params(config),
        layers=text.num_hidden_layers,
        heads=text.num_attention_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        max_positions=getattr(text, "max_position_embeddings", None),
        positions="rope" if rope else "learned",
        dtype=dtype_name,
        kv_bytes_per_token=kv_bytes_per_token(config, element),
    )


def model_spec(name_or_path: str, dtype: str | None = None) -> ModelSpec:
    """The spec of a hub id, local checkpoint or bundled model; ``dtype`` overrides the saved one."""
    return spec_from_config(load_config(name_or_path), str(name_or_path), dtype)
