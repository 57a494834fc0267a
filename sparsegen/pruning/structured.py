"""Structured pruning: remove whole MLP neurons and whole attention heads (KV groups), physically shrinking the
matrices, which is what makes a model faster on a CPU.

Importance is Wanda's, aggregated: a neuron (a column of the down projection) scores ``||X_j|| * sum_i |W_ij|``
over its column; a KV group scores the same summed over the output-projection columns of all its query heads.
The shrunk sizes of every layer are written to ``config.sparsegen_structure`` so ``sparsegen.load`` rebuilds them.
"""

from __future__ import annotations

import torch
from torch import nn

HEAD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# (names of the layers whose output rows are neurons, the layer whose input columns are neurons)
MLP_LAYOUTS = {
    "gpt_neox": (("mlp.dense_h_to_4h",), "mlp.dense_4h_to_h"),
    "opt": (("fc1",), "fc2"),
    "phi3": (("mlp.gate_up_proj",), "mlp.down_proj"),
}
LLAMA_MLP = (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj")


def parse_structured(text: str) -> dict[str, float]:
    """``"neurons=0.5,heads=0.25"`` -> ``{"neurons": 0.5, "heads": 0.25}``."""
    amounts = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("neurons", "heads") or not value:
            raise ValueError(f"--structured takes neurons=F and/or heads=F, e.g. neurons=0.5,heads=0.25; got {text!r}")
        fraction = float(value)
        if not 0 <= fraction < 1:
            raise ValueError(f"{key}={fraction}: the fraction removed must be in [0, 1); removing every {key[:-1]} "
                             f"of a layer would cut the layer out")
        amounts[key] = fraction
    return amounts


def mlp_layout(model_type: str):
    return MLP_LAYOUTS.get(model_type, LLAMA_MLP)


def _module(layer: nn.Module, path: str) -> nn.Linear:
    return layer.get_submodule(path)


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.data[rows].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[rows].clone())
    linear.out_features = len(rows)


def _keep_columns(linear: nn.Linear, columns: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.data[:, columns].clone())
    linear.in_features = len(columns)


def neuron_count(layer: nn.Module, model_type: str) -> int:
    return _module(layer, mlp_layout(model_type)[1]).in_features


def keep_neurons(layer: nn.Module, model_type: str, keep: torch.Tensor) -> None:
    """Keep the MLP neurons ``keep`` (sorted indices) of a decoder layer."""
    producers, consumer = mlp_layout(model_type)
    size = neuron_count(layer, model_type)
    for path in producers:
        linear = _module(layer, path)
        rows = torch.cat([keep, keep + size]) if linear.out_features == 2 * size else keep  # phi3: [gate; up]
        _keep_rows(linear, rows.to(linear.weight.device))
    _keep_columns(_module(layer, consumer), keep.to(_module(layer, consumer).weight.device))


def _heads(attention: nn.Module) -> tuple[int, int, int]:
    """``(query heads, KV heads, head_dim)`` of an attention module, from its projections."""
    head_dim = attention.head_dim
    return attention.q_proj.out_features // head_dim, attention.k_proj.out_features // head_dim, head_dim


def group_count(layer: nn.Module) -> int:
    return _heads(layer.self_attn)[1]


def keep_groups(layer: nn.Module, keep: torch.Tensor) -> None:
    """Keep the KV groups ``keep`` (sorted) of a decoder layer: their K/V heads and all their query heads."""
    attention = layer.self_attn
    q_heads, kv_heads, head_dim = _heads(attention)
    group = q_heads // kv_heads
    device = attention.q_proj.weight.device
    kv_rows = (keep[:, None] * head_dim + torch.arange(head_dim)).flatten().to(device)
    q_heads_kept = (keep[:, None] * group + torch.arange(group)).flatten()
    q_rows = (q_heads_kept[:, None] * head_dim + torch.arange(head_dim)).flatten().to(device)
    _keep_rows(attention.q_proj, q_rows)
    _keep_rows(attention.k_proj, kv_rows)
    _keep_rows(attention.v_proj, kv_rows)
    _keep_columns(attention.o_proj, q_rows)


def neuron_scores(layer: nn.Module, model_type: str, input_sq_sum: torch.Tensor) -> torch.Tensor:
    consumer = _module(layer, mlp_layout(model_type)[1])
    return consumer.weight.detach().abs().float().sum(0) * input_sq_sum.float().sqrt()


def group_scores(layer: nn.Module, input_sq_sum: torch.Tensor) -> torch.Tensor:
    q_heads, kv_heads, head_dim = _heads(layer.self_attn)
    column = layer.self_attn.o_proj.weight.detach().abs().float().sum(0) * input_sq_sum.float().sqrt()
    return column.view(kv_heads, -1).sum(-1)


def lowest_kept(scores: torch.Tensor, fraction: float, what: str) -> torch.Tensor:
    """Sorted indices of the units kept when the ``fraction`` with the lowest scores go."""
    remove = int(len(scores) * fraction)
    if remove >= len(scores):
        raise ValueError(f"removing {fraction:.0%} of {len(scores)} {what} leaves none; use a smaller fraction")
    return scores.topk(len(scores) - remove).indices.sort().values.cpu()


def check_supported(model_type: str, amounts: dict[str, float]) -> None:
    if amounts.get("heads") and model_type not in HEAD_FAMILIES:
        raise ValueError(f"removing heads supports {', '.join(HEAD_FAMILIES)}; {model_type} fuses or sizes its "
                         f"attention from the config. Use --structured neurons=F for it")


def record(config, layers: nn.ModuleList) -> None:
    """Write every layer's kept sizes into the config, where ``rebuild`` finds them."""
    model_type = config.model_type
    config.sparsegen_structure = {
        "neurons": [neuron_count(layer, model_type) for layer in layers],
        "kv_groups": [group_count(layer) for layer in layers] if model_type in HEAD_FAMILIES else None,
    }


def rebuild(model: nn.Module, structure: dict) -> None:
    """Shrink a freshly built model to the recorded sizes (the weights are loaded afterwards)."""
    from sparsegen.pruning.prune import decoder_layers

    model_type = model.config.model_type
    for index, layer in enumerate(decoder_layers(model)):
        keep_neurons(layer, model_type, torch.arange(structure["neurons"][index]))
        if structure.get("kv_groups"):
            keep_groups(layer, torch.arange(structure["kv_groups"][index]))
