"""SparseGPT (Frantar & Alistarh, 2023): prune a linear layer column by column and let the remaining weights of each
row absorb the error, using the inverse Hessian ``H = 2 X X^T`` of the layer's calibration inputs (one step of
Optimal Brain Surgeon per column, made cheap by the upper Cholesky factor of ``H^-1`` and lazy block updates).

The same sweep also quantizes (SparseGPT's joint mode; with no pruning it is GPTQ): each kept weight is rounded to
the quantizer's grid as its column is reached, and the rounding error is spread over the columns not yet reached."""

from __future__ import annotations

import torch

DAMPINGS = (0.01, 0.1, 1.0)  # fraction of the mean Hessian diagonal added to it; retried upward on failure


class HessianError(ValueError):
    """The Hessian stayed singular even with the largest dampening."""


def _inverse_cholesky(hessian: torch.Tensor, damping: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damping * mean(diag H) * I)^-1``."""
    damped = hessian + damping * hessian.diagonal().mean() * torch.eye(len(hessian), device=hessian.device)
    lower = torch.linalg.cholesky(damped)
    return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)


def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float = 0.0,
    pattern: tuple[int, int] | None = None,
    block_size: int = 128,
    quantizer=None,
    keep_zeros: bool = False,
) -> tuple[torch.Tensor, float]:
    """Return ``(pruned weight, dampening used)``. ``weight`` is ``[out, in]``; ``hessian`` is ``[in, in]`` (fp32).

    Unstructured: each block of ``block_size`` columns loses the ``sparsity`` fraction of its weights with the
    smallest ``w^2 / U_ii^2``. N:M: within every ``M`` columns, each row loses its ``M - N`` smallest.
    ``quantizer`` (a ``sparsegen.quant.groups.GroupQuantizer``): round every kept weight to its grid, groups fitted
    as the sweep reaches them (``block_size`` must be a multiple of its group width). ``keep_zeros``: weights
    that are zero on entry (pruned earlier) stay zero.
    """
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = h.diagonal() == 0  # inputs that were always zero: their weights never mattered
    h[dead, dead] = 1
    w[:, dead] = 0
    zero_on_entry = weight == 0 if keep_zeros else None
    if quantizer is not None and block_size % quantizer.width and quantizer.width < w.shape[1]:
        block_size = quantizer.width * max(1, block_size // quantizer.width)
    for damping in DAMPINGS:
        try:
            u = _inverse_cholesky(h, damping)
            break
        except torch.linalg.LinAlgError:
            continue
    else:
        raise HessianError(
            f"the calibration Hessian of a {tuple(weight.shape)} layer is not positive definite even with "
            f"{DAMPINGS[-1]:.0%} dampening; use more or longer calibration samples (--nsamples, --seqlen)"
        )
    rows, cols = w.shape
    n, m = pattern if pattern else (None, None)
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        block = w[:, start:end].clone()
        u_block = u[start:end, start:end]
        errors = torch.zeros_like(block)
        if pattern is None:
            if sparsity > 0:
                score = block.pow(2) / u_block.diagonal().pow(2)[None, :]
                k = int(score.numel() * sparsity)
                drop = score.flatten().topk(k, largest=False).indices
                mask = torch.zeros(score.numel(), dtype=torch.bool, device=w.device)
                mask = mask.scatter_(0, drop, True).view_as(score)
            else:
                mask = torch.zeros_like(block, dtype=torch.bool)
        else:
            mask = torch.zeros_like(block, dtype=torch.bool)
        if zero_on_entry is not None:
            mask |= zero_on_entry[:, start:end]
        for i in range(end - start):
            column = block[:, i]
            diagonal = u_block[i, i]
            if pattern is not None and i % m == 0:
                group = block[:, i:i + m].pow(2) / u_block.diagonal()[i:i + m].pow(2)[None, :]
                drop = group.topk(m - n, dim=1, largest=False).indices
                mask[:, i:i + m].scatter_(1, drop, True)
            pruned = column if quantizer is None else quantizer.column(block, start, i, mask)
            pruned = pruned.masked_fill(mask[:, i], 0)
            error = (column - pruned) / diagonal
            block[:, i:] -= error[:, None] * u_block[i, i:][None, :]
            block[:, i] = pruned
            errors[:, i] = error
        w[:, start:end] = block
        w[:, end:] -= errors @ u[start:end, end:]
    return w.to(weight.dtype), damping
