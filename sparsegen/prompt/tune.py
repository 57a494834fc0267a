"""Soft-prompt training (Compress, Then Prompt): only k prefix embeddings learn; the compressed model stays frozen.

The loss is next-token cross-entropy on calibration text, or, with a teacher (the dense model), the KL divergence
from the teacher's next-token distributions to the student's, so the prompt learns to make the compressed model
behave like the dense one rather than to fit the calibration text.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sparsegen.prompt.prefix import PromptPrefix, attach, detach


@dataclass
class TuneConfig:
    tokens: int = 32
    steps: int = 300
    lr: float = 3e-3
    batch_size: int = 8
    seed: int = 0
    eval_windows: int = 16  # calibration windows held out to report the loss before and after
    init: str = "vocab"  # start from random vocabulary embeddings, or from a passage of the training text ("text")

    def __post_init__(self):
        if self.init not in ("vocab", "text"):
            raise ValueError(f"init must be 'vocab' or 'text', got {self.init!r}")
        if self.tokens < 1 or self.steps < 1 or self.batch_size < 1:
            raise ValueError("tokens, steps and batch size must be at least 1")
        if not self.lr > 0:
            raise ValueError(f"the learning rate must be positive, got {self.lr}")


def _loss(model, batch: torch.Tensor, teacher) -> torch.Tensor:
    logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
    if teacher is None:
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    with torch.no_grad():
        target = teacher(input_ids=batch, use_cache=False).logits[:, :-1].float().log_softmax(-1)
    return F.kl_div(logits.log_softmax(-1).flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")


@torch.no_grad()
def _mean_loss(model, ids: torch.Tensor, teacher, batch_size: int) -> float:
    losses = [_loss(model, ids[i:i + batch_size], teacher).item() for i in range(0, len(ids), batch_size)]
    return sum(losses) / len(losses)


def tune_prompt(model: torch.nn.Module, ids: torch.Tensor, config: TuneConfig, teacher: torch.nn.Module | None = None,
                progress: bool = True) -> PromptPrefix:
    """Learn a soft prompt for ``model`` on calibration windows ``ids`` ``[n, length]``; the model is left unchanged."""
    if len(ids) <= config.eval_windows:
        raise ValueError(f"{len(ids)} calibration windows leave none to train on after {config.eval_windows} held out; "
                         f"use more (--nsamples)")
    device = next(model.parameters()).device
    held_out, train = ids[: config.eval_windows].to(device), ids[config.eval_windows:].to(device)
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for param, _ in frozen:
        param.requires_grad_(False)
    if config.init == "text":  # a passage the model reads naturally: the prompt starts out nearly harmless
        passage = train[int(torch.randint(len(train), (1,), generator=torch.Generator().manual_seed(config.seed)))]
        prefix = PromptPrefix.from_ids(model, passage[-config.tokens:], {"kind": "soft"}).to(device)
    else:
        prefix = PromptPrefix.from_vocabulary(model, config.tokens, config.seed).to(device)
    t0 = time.perf_counter()
    before = _mean_loss(model, held_out, teacher, config.batch_size)  # the model without a prompt
    attach(model, prefix)
    try:
        optimizer = torch.optim.AdamW([prefix.embeddings], lr=config.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(  # cosine decay after a short warm-up
            optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / config.steps)))
        generator = torch.Generator().manual_seed(config.seed)
        losses = []
        bar = tqdm(range(config.steps), desc="prompt-tune", unit="step", disable=not progress)
        for _ in bar:
            batch = train[torch.randint(len(train), (config.batch_size,), generator=generator).to(device)]
            loss = _loss(model, batch, teacher)
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}")
        after = _mean_loss(model, held_out, teacher, config.batch_size)
    finally:
        detach(model)
        for param, requires_grad in frozen:
            param.requires_grad_(requires_grad)
    prefix.embeddings.requires_grad_(False)
    prefix.info.update(
        kind="soft", loss="kl_to_teacher" if teacher is not None else "next_token", **asdict(config),
        window=ids.shape[1], held_out_loss_without_prompt=round(before, 5), held_out_loss_with_prompt=round(after, 5),
        train_loss_first=round(losses[0], 5), train_loss_last20=round(sum(losses[-20:]) / len(losses[-20:]), 5),
        seconds=round(time.perf_counter() - t0, 1),
    )
    return prefix
