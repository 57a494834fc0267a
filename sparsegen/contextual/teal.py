"""TEAL: training-free activation sparsity. Every linear of a decoder layer (or only the MLP's) drops the inputs
whose magnitude is below a threshold; the threshold is the calibration quantile of |input| that zeroes the
target fraction. A linear whose inputs are already more often exactly zero (after a ReLU) drops just those."""

from __future__ import annotations

import torch
from torch import nn

from sparsegen.contextual.collect import capture
from sparsegen.contextual.layers import ColumnSparseLinear
from sparsegen.contextual.runtime import (
    Contextual,
    ContextualMethod,
    Forward,
    Swap,
    model_info,
    register_contextual_method,
)
from sparsegen.models.anatomy import mlp_layout

TARGETS = ("all", "mlp")


def thresholds_for(magnitudes: dict[str, torch.Tensor], sparsity: float) -> dict[str, float]:
    """Per linear, the |x| below which a fraction ``sparsity`` of its calibration inputs falls."""
    result = {}
    for name, values in magnitudes.items():
        if sparsity == 0:
            result[name] = 0.0
            continue
        rank = max(1, min(len(values), round(sparsity * len(values))))
        below = torch.kthvalue(values, rank).values.item()  # inputs strictly below the next value are dropped
        result[name] = torch.nextafter(torch.tensor(below), torch.tensor(float("inf"))).item()
    return result


def fit_teal(model: nn.Module, ids: torch.Tensor, sparsity: float, targets: str = "all", batch_size: int = 8,
             seed: int = 0, progress: bool = True) -> Contextual:
    """Thresholds for the inputs of every decoder linear (``targets="all"``) or of the MLP's only (``"mlp"``)."""
    if not 0 <= sparsity < 1:
        raise ValueError(f"TEAL sparsity must be in [0, 1), got {sparsity}")
    if targets not in TARGETS:
        raise ValueError(f"TEAL targets must be one of {', '.join(TARGETS)}, got {targets!r}")
    magnitudes = capture(model, ids, predictors=False, magnitudes=True, batch_size=batch_size, seed=seed,
                         progress=progress).magnitudes
    if targets == "mlp":
        producers, consumer = mlp_layout(model.config.model_type)
        mlp = set(producers) | {consumer}
        magnitudes = {name: values for name, values in magnitudes.items() if name.partition(".")[2] in mlp}
    thresholds = thresholds_for(magnitudes, sparsity)
    achieved = {name: (values < thresholds[name]).float().mean().item() for name, values in magnitudes.items()}
    info = {**model_info(model), "sparsity": sparsity, "targets": targets, "calibration_tokens": ids.numel(),
            "achieved_on_calibration": achieved}
    return Contextual("teal", info, thresholds=thresholds)


class _Threshold:
    """The inputs whose magnitude reaches the threshold (a ``layers.Selection``)."""

    def __init__(self, forward: Forward, threshold: float):
        self.forward, self.threshold = forward, threshold

    def mask(self, x: torch.Tensor) -> torch.Tensor | None:
        return x.abs() >= self.threshold if self.forward.enabled else None

    def union(self) -> None:
        return None


@register_contextual_method
class Teal(ContextualMethod):
    """A magnitude threshold per linear input, no predictor."""

    name = "teal"
    options = ("sparsity", "targets")

    def fit(self, model, ids, batch_size=8, seed=0, progress=True, sparsity: float | None = None,
            targets: str = "all") -> Contextual:
        if sparsity is None:
            raise ValueError("teal needs --sparsity (the fraction of every linear's inputs dropped)")
        return fit_teal(model, ids, sparsity, targets, batch_size, seed, progress)

    def summary(self, plan: Contextual) -> list[str]:
        achieved = plan.info["achieved_on_calibration"]
        return [f"teal ({plan.info['targets']}): {len(achieved)} linear inputs, target sparsity "
                f"{plan.info['sparsity']}, achieved on calibration {min(achieved.values()):.3f}-"
                f"{max(achieved.values()):.3f}"]

    def wire(self, plan: Contextual, forward: Forward, index: int, layer: nn.Module, swap: Swap) -> None:
        for path, linear in [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear)]:
            threshold = plan.thresholds.get(f"{index}.{path}")
            if threshold is not None:  # linears without one stay dense (TEAL fit with targets="mlp")
                swap(layer, path, ColumnSparseLinear(linear, _Threshold(forward, threshold), forward.decoding))
