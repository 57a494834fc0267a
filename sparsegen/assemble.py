"""``sparsegen.load``: a model as the commands run it, in one call. ``sparsegen.models.load`` reads the checkpoint;
this adds what the kinds of sparsity put on top of it at run time: weights re-stored for the CPU's int8/int4 kernels
(``weights``), a contextual-sparsity plan (``contextual``) and a prompt before every sequence (``soft_prompt`` /
``hard_prompt``). Every command loads through these, so whatever a command runs, ``import sparsegen`` runs the same."""

from __future__ import annotations

from pathlib import Path

import torch

from sparsegen.models import load as load_checkpoint


def default_weights(name_or_path: str | Path, device: str | torch.device) -> str:
    """What ``weights="auto"`` stores: a GGUF model (a packaged one or a ``.gguf`` file) on a CPU at its own file's
    bit widths (``gguf``: Q4_1 as ``w4a8``, Q5_0 as ``w5a8``...), in sparsegen's integer kernels, which are CPU
    kernels; anything else as loaded (``fp32``), so a checkpoint folder runs as it always has."""
    from sparsegen.models.gguf import is_gguf_model

    return "gguf" if is_gguf_model(name_or_path) and torch.device(device).type == "cpu" else "fp32"


def restore_weights(model: torch.nn.Module, weights: str, name_or_path: str | Path) -> str:
    """``fp32`` (as loaded), ``int8`` / ``int4`` (PyTorch's CPU weight-only kernels), ``w8a8`` / ``w4a8`` /
    ``w5a8`` (sparsegen's integer kernels), ``gguf`` (each linear at the bit width of the model's own GGUF file) or
    ``auto`` (``default_weights``), in place; the kind it stored (also ``model.config.sparsegen_weights``, so that
    every number a command prints can say which weights made it)."""
    from sparsegen.models.anatomy import weights_of
    from sparsegen.quant.restore import WEIGHTS, gguf_plan, quantize_weights

    if weights not in ("auto", *WEIGHTS):
        raise ValueError(f"--weights must be one of auto, {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "auto":
        weights = default_weights(name_or_path, next(model.parameters()).device)
    plan = None
    if weights == "gguf":
        from sparsegen.models.gguf import gguf_file

        plan = gguf_plan(gguf_file(str(name_or_path)))
    quantize_weights(model, weights, plan)
    return weights_of(model)


def put_prompt(model: torch.nn.Module, tokenizer, soft_prompt: str | Path | None = None,
               hard_prompt: str | None = None) -> None:
    """A soft prompt (a file from ``sparsegen prompt-tune``) or a hard one (a text) before every sequence, never
    evicted; neither: nothing."""
    if soft_prompt is None and hard_prompt is None:
        return
    if soft_prompt is not None and hard_prompt is not None:
        raise ValueError("give a soft prompt or a hard prompt, not both")
    from sparsegen.prompt import PromptPrefix, attach

    if hard_prompt is not None and tokenizer is None:
        raise ValueError("a hard prompt needs a model with a tokenizer (random: models have none)")
    attach(model, PromptPrefix.load(soft_prompt) if soft_prompt is not None else
           PromptPrefix.from_text(model, tokenizer, hard_prompt))


def load(name_or_path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
         weights: str = "auto", contextual: str | Path | None = None, soft_prompt: str | Path | None = None,
         hard_prompt: str | None = None, **options) -> tuple[torch.nn.Module, object]:
    """``(model, tokenizer)`` for a hub id, a checkpoint folder, a ``.gguf`` file, a packaged (``smollm2``,
    ``gemma3-270m``) or bundled (``reference``) model (``options``: ``sparsegen.models.load``'s own), with its
    ``weights`` re-stored (``restore_weights``; by default a GGUF model at its own bit widths, in integer kernels),
    a ``contextual`` plan (a folder from ``sparsegen contextual fit``)
    and a prompt before every sequence (``put_prompt``)."""
    model, tokenizer = load_checkpoint(name_or_path, device=device, dtype=dtype, **options)
    restore_weights(model, weights, name_or_path)
    if contextual is not None:
        from sparsegen.contextual import Contextual, attach

        attach(model, Contextual.load(contextual))
    put_prompt(model, tokenizer, soft_prompt, hard_prompt)
    return model, tokenizer
