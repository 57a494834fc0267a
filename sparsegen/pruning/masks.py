"""Which weights to remove: scores (magnitude, Wanda) and the masks they give, unstructured or N:M.

A mask is a bool tensor shaped like the weight ``[out, in]``; True marks a weight to prune.
"""

from __future__ import annotations

import torch


def parse_pattern(pattern: str) -> tuple[int, int]:
    """``"2:4"`` -> ``(2, 4)``: keep N of every M consecutive inputs of a row."""
    try:
        n, m = (int(x) for x in pattern.split(":"))
    except ValueError:
        raise ValueError(f"a sparsity pattern is N:M with whole numbers, e.g. 2:4; got {pattern!r}") from None
    if not 0 < n < m:
        raise ValueError(f"pattern {pattern}: N must be at least 1 and smaller than M (keep N of every M weights)")
    return n, m


def check_sparsity(sparsity: float) -> float:
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity is the fraction of weights removed, in [0, 1); got {sparsity}")
    return sparsity


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    return weight.abs().float()


def wanda_scores(weight: torch.Tensor, input_sq_sum: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j||_2, with ``input_sq_sum[j]`` the sum over calibration tokens of ``x_j**2``."""
    return weight.abs().float() * input_sq_sum.float().sqrt()[None, :]


def unstructured_mask(scores: torch.Tensor, sparsity: float, per_row: bool) -> torch.Tensor:
    """The lowest-scoring ``sparsity`` fraction of weights, compared per output row or over the whole layer."""
    if sparsity == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    if per_row:
        k = int(scores.shape[1] * sparsity)
        drop = scores.topk(k, dim=1, largest=False).indices
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, drop, True)
    k = int(scores.numel() * sparsity)
    drop = scores.flatten().topk(k, largest=False).indices
    return torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device).scatter_(0, drop, True).view_as(scores)


def n_m_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """In every group of ``m`` consecutive inputs of each row, the ``m - n`` lowest scores."""
    rows, cols = scores.shape
    if cols % m:
        raise ValueError(f"pattern {n}:{m} needs the input dimension to be a multiple of {m}; a layer has {cols}")
    groups = scores.reshape(rows, cols // m, m)
    drop = groups.topk(m - n, dim=-1, largest=False).indices
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, drop, True).view(rows, cols)
