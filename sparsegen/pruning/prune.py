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
from pathlib import Path

import torch

from sparsegen.models.calibration import Statistics, calibrated_layers
from sparsegen.pruning import structured
from sparsegen.pruning.masks import check_sparsity, parse_pattern
from sparsegen.pruning.methods import PRUNING_METHODS, PruningMethod, pruning_method

METHODS = PRUNING_METHODS  # name -> class, every registered method


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
        rule = pruning_method(self.method)
        if sum(x is not None for x in (self.sparsity, self.pattern, self.structured)) != 1:
            raise ValueError("give exactly one of a sparsity (e.g. 0.5), an N:M pattern (e.g. 2:4) and a structured "
                             "amount (e.g. neurons=0.5)")
        if self.pattern is not None:
            self.nm = parse_pattern(self.pattern)
        elif self.structured is not None:
            self.amounts = structured.parse_structured(self.structured)
            if not rule.structured:
                able = ", ".join(name for name, cls in METHODS.items() if cls.structured)
                raise ValueError(f"structured pruning scores whole neurons and heads ({able}); {self.method} prunes "
                                 "single weights")
        else:
            check_sparsity(self.sparsity)
        if self.per_row is None:
            self.per_row = rule.per_row
        if self.nsamples < 1 or self.seqlen < 2:
            raise ValueError("nsamples must be >= 1 and seqlen >= 2")

    @property
    def target(self) -> float | None:
        if self.amounts is not None:
            return None
        return self.sparsity if self.nm is None else 1 - self.nm[0] / self.nm[1]


def _prune_linear(linear: torch.nn.Linear, config: PruneConfig, rule: PruningMethod, stats: Statistics | None) -> None:
    weight = linear.weight.data
    if config.nm is not None and weight.shape[1] % config.nm[1]:
        raise ValueError(f"pattern {config.pattern} needs every input dimension to be a multiple of {config.nm[1]}; "
                         f"a layer has {weight.shape[1]}")
    weight.copy_(rule.prune(weight, stats, config.sparsity or 0.0, config.nm, config.per_row))


@torch.no_grad()
def prune_model(model: torch.nn.Module, config: PruneConfig, ids: torch.Tensor | None = None,
                progress: bool = True) -> dict:
    """Prune ``model`` in place; ``ids`` ``[nsamples, seqlen]`` are the calibration tokens (not needed for magnitude).

    Returns the report saved as ``sparsity.json``: requested and achieved sparsity per linear layer and in total.
    """
    if config.amounts is not None:
        return structured.prune_structured(model, config, ids, progress)
    rule = pruning_method(config.method)
    needs_data = rule.statistic is not None
    if needs_data and ids is None:
        raise ValueError(f"{config.method} needs calibration data")
    t0 = time.perf_counter()
    report_layers = []
    for index, _, linears, stats in calibrated_layers(model, ids, rule.statistic, config.batch_size,
                                                      f"prune ({config.method})", progress):
        for name, linear in linears.items():
            _prune_linear(linear, config, rule, stats.get(name))
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


def save_pruned(model, tokenizer, out: str | Path, report: dict, report_name: str = "sparsity.json",
                dtype: torch.dtype | None = None, overwrite: bool = False,
                extra: dict[str, dict] | None = None) -> Path:
    """A loadable checkpoint (weights, config, tokenizer) plus the report of what was done to it (``extra``: more
    JSON reports by file name; the reports of the checkpoint the model was loaded from, e.g. a pruned model's
    ``sparsity.json`` under quantization, travel with it unless replaced), written all at once
    (``sparsegen.output.new_folder``). ``dtype``: cast the float
    parameters to it first; by default the dtype of the checkpoint ``sparsegen.load`` read (so a float16 model is
    not saved at twice its size because it ran in float32); quantized codes and scales are buffers and keep
    theirs."""
    from sparsegen.output import new_folder

    dtype = dtype or getattr(model, "source_dtype", None)
    if dtype is not None:
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    with new_folder(out, overwrite) as work:
        model.save_pretrained(work)
        if tokenizer is not None:
            tokenizer.save_pretrained(work)
        carried = getattr(model, "source_reports", None) or {}
        for name, content in {**carried, report_name: report, **(extra or {})}.items():
            (work / name).write_text(json.dumps(content, indent=2))
    return Path(out)
