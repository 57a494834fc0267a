"""``sparsegen.load``: a model as the commands run it, in one call. ``sparsegen.models.load`` reads the checkpoint;
this adds what the kinds of sparsity put on top of it at run time: weights re-stored for the CPU's int8/int4 kernels
(``weights``), a contextual-sparsity plan (``contextual``) and a prompt before every sequence (``soft_prompt`` /
``hard_prompt``). Every command loads through these, so whatever a command runs, ``import sparsegen`` runs the same."""

from __future__ import annotations

from pathlib import Path

import torch

from sparsegen.models import load as load_checkpoint


def restore_weights(model: torch.nn.Module, weights: str, name_or_path: str | Path) -> None:
    """``fp32`` (as loaded), ``int8`` / ``int4`` (PyTorch's CPU weight-only kernels) or ``gguf`` (each linear at the
    bit width of the model's own GGUF file), in place."""
    from sparsegen.quant.fast import gguf_plan, quantize_weights

    plan = None
    if weights == "gguf":
        from sparsegen.models.gguf import gguf_file

        plan = gguf_plan(gguf_file(str(name_or_path)))
    quantize_weights(model, weights, plan)


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
         weights: str = "fp32", contextual: str | Path | None = None, soft_prompt: str | Path | None = None,
         hard_prompt: str | None = None, **options) -> tuple[torch.nn.Module, object]:
    """``(model, tokenizer)`` for a hub id, a checkpoint folder, a ``.gguf`` file, a packaged (``smollm2``,
    ``gemma3-270m``) or bundled (``reference``) model (``options``: ``sparsegen.models.load``'s own), with its
    ``weights`` re-stored (``restore_weights``), a ``contextual`` plan (a folder from ``sparsegen contextual fit``)
    and a prompt before every sequence (``put_prompt``)."""
    model, tokenizer = load_checkpoint(name_or_path, device=device, dtype=dtype, **options)
    restore_weights(model, weights, name_or_path)
    if contextual is not None:
        from sparsegen.contextual import Contextual, attach

        attach(model, Contextual.load(contextual))
    put_prompt(model, tokenizer, soft_prompt, hard_prompt)
    return model, tokenizer
