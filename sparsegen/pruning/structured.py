"""Structured pruning: remove whole MLP neurons and whole attention heads (KV groups), physically shrinking the
matrices, which is what makes a model faster on a CPU.

Importance is Wanda's, aggregated: a neuron (a column of the down projection) scores ``||X_j|| * sum_i |W_ij|``
over its column; a KV group scores the same summed over the output-projection columns of all its query heads.
The shrunk sizes of every layer are written to ``config.sparsegen_structure`` so ``sparsegen.load`` rebuilds them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from sparsegen.models.anatomy import (
    attention_heads,
    decoder_layers,
    group_count,
    head_families,
    mlp_layout,
    neuron_count,
)
from sparsegen.models.calibration import calibrated_layers
from sparsegen.models.families import family
from sparsegen.pruning.methods import pruning_method

if TYPE_CHECKING:
    from sparsegen.pruning.prune import PruneConfig


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


def keep_neurons(layer: nn.Module, model_type: str, keep: torch.Tensor) -> None:
    """Keep the MLP neurons ``keep`` (sorted indices) of a decoder layer."""
    producers, consumer = mlp_layout(model_type)
    size = neuron_count(layer, model_type)
    for path in producers:
        linear = _module(layer, path)
        rows = torch.cat([keep, keep + size]) if linear.out_features == 2 * size else keep  # phi3: [gate; up]
        _keep_rows(linear, rows.to(linear.weight.device))
    _keep_columns(_module(layer, consumer), keep.to(_module(layer, consumer).weight.device))


def keep_groups(layer: nn.Module, keep: torch.Tensor) -> None:
    """Keep the KV groups ``keep`` (sorted) of a decoder layer: their K/V heads and all their query heads."""
    attention = layer.self_attn
    q_heads, kv_heads, head_dim = attention_heads(attention)
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
    q_heads, kv_heads, head_dim = attention_heads(layer.self_attn)
    column = layer.self_attn.o_proj.weight.detach().abs().float().sum(0) * input_sq_sum.float().sqrt()
    return column.view(kv_heads, -1).sum(-1)


def lowest_kept(scores: torch.Tensor, fraction: float, what: str) -> torch.Tensor:
    """Sorted indices of the units kept when the ``fraction`` with the lowest scores go."""
    remove = int(len(scores) * fraction)
    if remove >= len(scores):
        raise ValueError(f"removing {fraction:.0%} of {len(scores)} {what} leaves none; use a smaller fraction")
    return scores.topk(len(scores) - remove).indices.sort().values.cpu()


def check_supported(model_type: str, amounts: dict[str, float]) -> None:
    if amounts.get("heads") and not family(model_type).separate_heads:
        raise ValueError(f"removing heads supports {', '.join(head_families())}; {model_type} fuses or sizes its "
                         f"attention from the config. Use --structured neurons=F for it")


def record(config, layers: nn.ModuleList) -> None:
    """Write the kept sizes into the config. Every layer the same size (what pruning a fraction of each gives) is a
    plain config: any tool builds the shrunk model from it. Otherwise the per-layer sizes go to
    ``config.sparsegen_structure``, where ``rebuild`` finds them (plain transformers then refuses the weights'
    shapes rather than loading random ones)."""
    model_type = config.model_type
    neurons = [neuron_count(layer, model_type) for layer in layers]
    groups = [group_count(layer) for layer in layers] if family(model_type).separate_heads else None
    text = config.get_text_config()
    if len(set(neurons)) > 1 or (groups and len(set(groups)) > 1):
        config.sparsegen_structure = {"neurons": neurons, "kv_groups": groups}
        return
    setattr(text, family(model_type).mlp_size, neurons[0])
    if groups and groups[0] != text.num_key_value_heads:
        queries_per_group = text.num_attention_heads // text.num_key_value_heads
        text.head_dim = attention_heads(layers[0].self_attn)[2]  # explicit: it no longer follows from the width
        text.num_key_value_heads, text.num_attention_heads = groups[0], groups[0] * queries_per_group


def rebuild(model: nn.Module, structure: dict) -> None:
    """Shrink a freshly built model to the recorded sizes (the weights are loaded afterwards)."""
    model_type = model.config.model_type
    for index, layer in enumerate(decoder_layers(model)):
        keep_neurons(layer, model_type, torch.arange(structure["neurons"][index]))
        if structure.get("kv_groups"):
            keep_groups(layer, torch.arange(structure["kv_groups"][index]))



def prune_structured(model: nn.Module, config: PruneConfig, ids: torch.Tensor | None, progress: bool) -> dict:
    """Remove the lowest-scoring MLP neurons and KV groups of every layer, shrinking the matrices in place."""
    model_type = model.config.model_type
    check_supported(model_type, config.amounts)
    needs_data = pruning_method(config.method).statistic is not None  # input norms weigh the scores; else all alike
    if needs_data and ids is None:
        raise ValueError(f"{config.method} needs calibration data")
    t0 = time.perf_counter()
    before = sum(p.numel() for p in model.parameters())
    report_layers = []
    consumer = mlp_layout(model_type)[1]
    walk = calibrated_layers(model, ids, "norms" if needs_data else None, config.batch_size,
                             f"prune ({config.method}, structured)", progress)
    for index, layer, _, stats in walk:
        def input_norms(path: str) -> torch.Tensor:  # magnitude: every input counts the same
            if stats:
                return stats[path].sq_sum
            linear = layer.get_submodule(path)
            return torch.ones(linear.in_features, dtype=torch.float64, device=linear.weight.device)

        entry = {"layer": index, "neurons_before": neuron_count(layer, model_type)}
        keep = lowest_kept(neuron_scores(layer, model_type, input_norms(consumer)), config.amounts.get("neurons", 0.0),
                           "MLP neurons")
        keep_neurons(layer, model_type, keep)
        entry["neurons"] = len(keep)
        if config.amounts.get("heads"):
            entry["kv_groups_before"] = group_count(layer)
            keep = lowest_kept(group_scores(layer, input_norms("self_attn.o_proj")), config.amounts["heads"],
                               "KV groups")
            keep_groups(layer, keep)
            entry["kv_groups"] = len(keep)
        report_layers.append(entry)
    record(model.config, decoder_layers(model))
    after = sum(p.numel() for p in model.parameters())
    return {
        "method": config.method, "structured": config.amounts, "params_before": before, "params_after": after,
        "removed": 1 - after / before, "nsamples": config.nsamples if needs_data else 0,
        "seqlen": config.seqlen if needs_data else None, "seed": config.seed,
        "seconds": round(time.perf_counter() - t0, 2), "layers": report_layers,
    }
