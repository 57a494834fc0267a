"""Layer-by-layer pruning of a causal LM with calibration data, as the Wanda and SparseGPT papers do it.

Calibration samples go through the model one decoder layer at a time: each layer's statistics come from the
outputs of the already-pruned layers before it, and only one layer's activations are held at once. Every
``nn.Linear`` inside a decoder layer is pruned (attention projections and MLP); embeddings and the output
layer never are.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from sparsegen.pruning.masks import (check_sparsity, magnitude_scores, n_m_mask, parse_pattern, unstructured_mask,
                                     wanda_scores)
from sparsegen.pruning import structured
from sparsegen.pruning.sparsegpt import sparsegpt_prune

METHODS = ("magnitude", "wanda", "sparsegpt")


@dataclass
class PruneConfig:
    method: str
    sparsity: float | None = None  # unstructured: fraction removed
    pattern: str | None = None  # N:M: keep N of every M
    structured: str | None = None  # "neurons=0.5,heads=0.25": whole MLP neurons / KV groups removed
    per_row: bool | None = None  # compare scores per output row (default: Wanda yes, magnitude no)
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    batch_size: int = 8
    nm: tuple[int, int] | None = field(init=False, default=None)
    amounts: dict[str, float] | None = field(init=False, default=None)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown pruning method {self.method!r}; choose one of {', '.join(METHODS)}")
        if sum(x is not None for x in (self.sparsity, self.pattern, self.structured)) != 1:
            raise ValueError("give exactly one of a sparsity (e.g. 0.5), an N:M pattern (e.g. 2:4) and a structured "
                             "amount (e.g. neurons=0.5)")
        if self.pattern is not None:
            self.nm = parse_pattern(self.pattern)
        elif self.structured is not None:
            self.amounts = structured.parse_structured(self.structured)
            if self.method == "sparsegpt":
                raise ValueError("structured pruning scores whole neurons and heads with wanda or magnitude; "
                                 "sparsegpt prunes single weights")
        else:
            check_sparsity(self.sparsity)
        if self.per_row is None:
            self.per_row = self.method == "wanda"
        if self.nsamples < 1 or self.seqlen < 2:
            raise ValueError("nsamples must be >= 1 and seqlen >= 2")

    @property
    def target(self) -> float | None:
        if self.amounts is not None:
            return None
        return self.sparsity if self.nm is None else 1 - self.nm[0] / self.nm[1]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}; sparsegen prunes decoder-only "
                         f"LMs whose decoder has a .layers list (Llama, Mistral, Qwen, GPT-NeoX, Phi-3, OPT)")
    return layers


def prunable_linears(layer: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: module for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear)}


def calibration_ids(token_arrays: list[np.ndarray], nsamples: int, seqlen: int, seed: int,
                    bos_id: int | None) -> torch.Tensor:
    """``[nsamples, seqlen]`` windows at random offsets of random files (weighted by length), BOS first if given."""
    body = seqlen - 1 if bos_id is not None else seqlen
    arrays = [a for a in token_arrays if len(a) > body]
    if not arrays:
        raise ValueError(f"no calibration text is longer than {body} tokens; lower --seqlen")
    rng = np.random.default_rng(seed)
    lengths = np.array([len(a) - body for a in arrays], dtype=np.float64)
    rows = []
    for choice in rng.choice(len(arrays), size=nsamples, p=lengths / lengths.sum()):
        offset = rng.integers(0, len(arrays[choice]) - body)
        rows.append(arrays[choice][offset:offset + body].astype(np.int64))
    ids = torch.from_numpy(np.stack(rows))
    if bos_id is not None:
        ids = torch.cat([torch.full((nsamples, 1), bos_id), ids], dim=1)
    return ids


class _Stop(Exception):
    pass


def _first_layer_inputs(model, ids: torch.Tensor, batch_size: int) -> list[tuple[torch.Tensor, list[dict]]]:
    """Per mini-batch: the hidden states the first decoder layer receives and the keyword arguments (masks, RoPE)
    each layer receives. Layers of different kinds (Gemma 3's sliding-window and global layers) get different
    ones, so the forward runs until the first layer of every kind has shown its own."""
    layers = decoder_layers(model)
    types = getattr(model.config.get_text_config(), "layer_types", None)
    kinds = list(types) if types and len(types) == len(layers) else [None] * len(layers)
    first = {kind: kinds.index(kind) for kind in kinds}
    last = max(first.values())
    captured, seen = [], {}

    def grab(index, module, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs.pop("hidden_states", None)
        if index == 0:
            captured.append(hidden)
        seen[kinds[index]] = kwargs
        if index == last:
            raise _Stop

    device = next(model.parameters()).device
    handles = [layers[i].register_forward_pre_hook(partial(grab, i), with_kwargs=True) for i in first.values()]
    inputs = []
    try:
        for start in range(0, len(ids), batch_size):
            try:
                model(input_ids=ids[start:start + batch_size].to(device), use_cache=False)
            except _Stop:
                pass
            inputs.append((captured[-1], [seen[kind] for kind in kinds]))
    finally:
        for handle in handles:
            handle.remove()
    return inputs


def _run_layer(layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


STATISTIC = {"magnitude": None, "wanda": "norms", "sparsegpt": "hessian"}  # what each method needs of the inputs


class _Statistics:
    """What one linear layer's inputs say: per-column sums of squares (``norms``, Wanda) or ``X^T X``
    (``hessian``, SparseGPT and GPTQ)."""

    def __init__(self, linear: torch.nn.Linear, kind: str):
        cols = linear.in_features
        device = linear.weight.device
        self.tokens = 0
        self.sq_sum = torch.zeros(cols, dtype=torch.float64, device=device) if kind == "norms" else None
        self.xtx = torch.zeros(cols, cols, dtype=torch.float32, device=device) if kind == "hessian" else None

    def __call__(self, module, args, output) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        self.tokens += len(x)
        if self.sq_sum is not None:
            self.sq_sum += x.pow(2).sum(0).double()
        if self.xtx is not None:
            self.xtx += x.T @ x

    def hessian(self) -> torch.Tensor:
        return 2 * self.xtx / self.tokens


def calibrated_layers(model: torch.nn.Module, ids: torch.Tensor | None, statistic: str | None, batch_size: int,
                      desc: str, progress: bool = True):
    """Walk the decoder layers in order, yielding ``(index, layer, linears, stats)``.

    With a ``statistic`` ("norms" or "hessian") ``stats`` holds, per linear, what its inputs said when the
    calibration tokens ran through the layers before it *as the caller left them*: once the caller has
    compressed a layer (in place, or by swapping its linears), that layer's outputs feed the next.
    """
    layers = decoder_layers(model)
    inputs = _first_layer_inputs(model, ids, batch_size) if statistic else []
    for index, layer in enumerate(tqdm(layers, desc=desc, unit="layer", disable=not progress)):
        linears = prunable_linears(layer)
        stats = {}
        if statistic:
            stats = {name: _Statistics(linear, statistic) for name, linear in linears.items()}
            handles = [linear.register_forward_hook(stats[name]) for name, linear in linears.items()]
            for hidden, kwargs in inputs:
                _run_layer(layer, hidden, kwargs[index])
            for handle in handles:
                handle.remove()
        yield index, layer, linears, stats
        if statistic:
            inputs = [(_run_layer(layer, hidden, kwargs[index]), kwargs) for hidden, kwargs in inputs]


def _prune_linear(linear: torch.nn.Linear, config: PruneConfig, stats: _Statistics | None) -> None:
    weight = linear.weight.data
    if config.nm is not None and weight.shape[1] % config.nm[1]:
        raise ValueError(f"pattern {config.pattern} needs every input dimension to be a multiple of {config.nm[1]}; "
                         f"a layer has {weight.shape[1]}")
    if config.method == "sparsegpt":
        pruned, _ = sparsegpt_prune(weight, stats.hessian(), config.sparsity or 0.0, config.nm)
        weight.copy_(pruned)
        return
    scores = magnitude_scores(weight) if config.method == "magnitude" else wanda_scores(weight, stats.sq_sum)
    if config.nm is not None:
        mask = n_m_mask(scores, *config.nm)
    else:
        mask = unstructured_mask(scores, config.sparsity, config.per_row)
    weight.masked_fill_(mask, 0)


@torch.no_grad()
def prune_model(model: torch.nn.Module, config: PruneConfig, ids: torch.Tensor | None = None,
                progress: bool = True) -> dict:
    """Prune ``model`` in place; ``ids`` ``[nsamples, seqlen]`` are the calibration tokens (not needed for magnitude).

    Returns the report saved as ``sparsity.json``: requested and achieved sparsity per linear layer and in total.
    """
    if config.amounts is not None:
        return _prune_structured(model, config, ids, progress)
    needs_data = config.method != "magnitude"
    if needs_data and ids is None:
        raise ValueError(f"{config.method} needs calibration data")
    t0 = time.perf_counter()
    report_layers = []
    for index, _, linears, stats in calibrated_layers(model, ids, STATISTIC[config.method], config.batch_size,
                                                      f"prune ({config.method})", progress):
        for name, linear in linears.items():
            _prune_linear(linear, config, stats.get(name))
            zeros = int((linear.weight == 0).sum())
            report_layers.append({"name": f"layers.{index}.{name}", "shape": list(linear.weight.shape),
                                  "params": linear.weight.numel(), "zeros": zeros,
                                  "sparsity": zeros / linear.weight.numel()})
    params = sum(r["params"] for r in report_layers)
    zeros = sum(r["zeros"] for r in report_layers)
    return {
        "method": config.method, "sparsity": config.sparsity, "pattern": config.pattern,
        "per_row": config.per_row, "requested": config.target, "achieved": zeros / params,
        "pruned_params": params, "total_params": sum(p.numel() for p in model.parameters()),
        "nsamples": config.nsamples if needs_data else 0, "seqlen": config.seqlen if needs_data else None,
        "seed": config.seed, "seconds": round(time.perf_counter() - t0, 2), "layers": report_layers,
    }


def _prune_structured(model: torch.nn.Module, config: PruneConfig, ids: torch.Tensor | None, progress: bool) -> dict:
    """Remove the lowest-scoring MLP neurons and KV groups of every layer, shrinking the matrices in place."""
    model_type = model.config.model_type
    structured.check_supported(model_type, config.amounts)
    layers = decoder_layers(model)
    needs_data = config.method == "wanda"
    if needs_data and ids is None:
        raise ValueError("wanda needs calibration data")
    t0 = time.perf_counter()
    before = sum(p.numel() for p in model.parameters())
    inputs = _first_layer_inputs(model, ids, config.batch_size) if needs_data else []
    report_layers = []
    consumer_path = structured.mlp_layout(model_type)[1]
    for index, layer in enumerate(tqdm(layers, desc=f"prune ({config.method}, structured)", unit="layer",
                                       disable=not progress)):
        watched = {"mlp": layer.get_submodule(consumer_path)}
        if config.amounts.get("heads"):
            watched["attention"] = layer.self_attn.o_proj
        stats = {name: _Statistics(linear, "norms") for name, linear in watched.items()}
        if needs_data:
            handles = [linear.register_forward_hook(stats[name]) for name, linear in watched.items()]
            for hidden, kwargs in inputs:
                _run_layer(layer, hidden, kwargs[index])
            for handle in handles:
                handle.remove()
        else:  # magnitude: every input counts the same
            for stat in stats.values():
                stat.sq_sum.fill_(1)
        entry = {"layer": index, "neurons_before": structured.neuron_count(layer, model_type)}
        keep = structured.lowest_kept(structured.neuron_scores(layer, model_type, stats["mlp"].sq_sum),
                                      config.amounts.get("neurons", 0.0), "MLP neurons")
        structured.keep_neurons(layer, model_type, keep)
        entry["neurons"] = len(keep)
        if "attention" in stats:
            entry["kv_groups_before"] = structured.group_count(layer)
            keep = structured.lowest_kept(structured.group_scores(layer, stats["attention"].sq_sum),
                                          config.amounts["heads"], "KV groups")
            structured.keep_groups(layer, keep)
            entry["kv_groups"] = len(keep)
        report_layers.append(entry)
        if needs_data:
            inputs = [(_run_layer(layer, hidden, kwargs[index]), kwargs) for hidden, kwargs in inputs]
    structured.record(model.config, layers)
    after = sum(p.numel() for p in model.parameters())
    return {
        "method": config.method, "structured": config.amounts, "params_before": before, "params_after": after,
        "removed": 1 - after / before, "nsamples": config.nsamples if needs_data else 0,
        "seqlen": config.seqlen if needs_data else None, "seed": config.seed,
        "seconds": round(time.perf_counter() - t0, 2), "layers": report_layers,
    }


def save_pruned(model, tokenizer, out: str | Path, report: dict, report_name: str = "sparsity.json",
                dtype: torch.dtype | None = None, overwrite: bool = False, extra: dict[str, dict] | None = None) -> Path:
    """A loadable checkpoint (weights, config, tokenizer) plus the report of what was done to it (``extra``: more
    JSON reports by file name), written all at once (``sparsegen.output.new_folder``). ``dtype``: cast the float
    parameters to it first (the source checkpoint's own, so a float16 model is not saved at twice its size because
    it ran in float32); quantized codes and scales are buffers and keep theirs."""
    from sparsegen.output import new_folder

    if dtype is not None:
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    with new_folder(out, overwrite) as work:
        model.save_pretrained(work)
        if tokenizer is not None:
            tokenizer.save_pretrained(work)
        for name, content in {report_name: report, **(extra or {})}.items():
            (work / name).write_text(json.dumps(content, indent=2))
    return Path(out)
