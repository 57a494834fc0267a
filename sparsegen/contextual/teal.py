"""TEAL: training-free activation sparsity. Every linear of a decoder layer drops the inputs whose magnitude is
below a threshold; the threshold is the calibration quantile of |input| that zeroes the target fraction."""

from __future__ import annotations

import torch
from torch import nn

from sparsegen.contextual.collect import capture
from sparsegen.contextual.runtime import Contextual, model_info


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


def fit_teal(model: nn.Module, ids: torch.Tensor, sparsity: float, batch_size: int = 8, seed: int = 0,
             progress: bool = True) -> Contextual:
    if not 0 <= sparsity < 1:
        raise ValueError(f"TEAL sparsity must be in [0, 1), got {sparsity}")
    magnitudes = capture(model, ids, predictors=False, magnitudes=True, batch_size=batch_size, seed=seed,
                         progress=progress).magnitudes
    thresholds = thresholds_for(magnitudes, sparsity)
    achieved = {name: (values < thresholds[name]).float().mean().item() for name, values in magnitudes.items()}
    info = {**model_info(model), "sparsity": sparsity, "calibration_tokens": ids.numel(),
            "achieved_on_calibration": achieved}
    return Contextual("teal", info, thresholds=thresholds)
