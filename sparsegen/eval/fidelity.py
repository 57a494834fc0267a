"""Fidelity of a KV policy to the full cache: do its greedy continuations and next-token distributions agree?

With a contextual-sparsity plan attached to the model, the reference is the dense model (the plan suspended),
so ``--policy full --contextual DIR`` measures what contextual sparsity alone changes.
"""

from __future__ import annotations

import numpy as np
import torch
from rouge_score import rouge_scorer
from tqdm.auto import tqdm

from sparsegen.contextual.runtime import suspended
from sparsegen.engine.generate import generate_tokens
from sparsegen.engine.prefill import prefill
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import PolicySpec
from sparsegen.kv.policies.full import Full


def cut_prompts(tokens: np.ndarray, count: int, length: int, bos_id: int | None) -> torch.Tensor:
    """``count`` prompts of ``length`` tokens, evenly spaced over ``tokens`` (BOS first if given)."""
    body = length - 1 if bos_id is not None else length
    if len(tokens) < body + 1:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one prompt of {length}")
    starts = np.linspace(0, len(tokens) - body - 1, count).round().astype(int)
    rows = torch.from_numpy(np.stack([tokens[s:s + body] for s in starts]).astype(np.int64))
    if bos_id is not None:
        rows = torch.cat([torch.full((count, 1), bos_id), rows], dim=1)
    return rows


@torch.inference_mode()
def _policy_logits(model, prompts: torch.Tensor, continuation: torch.Tensor, policy: PolicySpec,
                   chunk_size: int) -> torch.Tensor:
    """Next-token logits under ``policy`` for every continuation token, teacher-forced: [B, n, vocab]."""
    length = prompts.shape[1]
    cache = policy.cache(model, length, chunk_size=chunk_size)
    logits = [prefill(model, cache, prompts, torch.ones_like(prompts), chunk_size, progress=False)]
    step, position = DecodeStep(model, compile=False), torch.full((len(prompts),), length, device=prompts.device)
    for i in range(continuation.shape[1] - 1):
        logits.append(step(cache, continuation[:, i], position + i))
    return torch.stack(logits, dim=1).float()


@torch.inference_mode()
def fidelity(
    model: torch.nn.Module,
    tokenizer,
    prompts: torch.Tensor,
    policy: PolicySpec,
    new_tokens: int = 64,
    chunk_size: int = 512,
    batch_size: int = 8,
    progress: bool = True,
) -> dict:
    """ROUGE-L of greedy continuations, tokens until they first differ, and mean KL(full || policy) per token, the
    cache under ``policy`` (a fractional budget is of the prompt). The reference (full cache) runs dense even when a
    contextual plan is attached."""
    device = next(model.parameters()).device
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rouge, divergence, kl = [], [], []
    for start in tqdm(range(0, len(prompts), batch_size), desc="fidelity", disable=not progress, leave=False):
        ids = prompts[start:start + batch_size].to(device)
        mask = torch.ones_like(ids)
        with suspended(model):
            full, *_ = generate_tokens(model, ids, mask, Full(), max_new_tokens=new_tokens, chunk_size=chunk_size)
            # only the continuation's logits: a whole prompt's are GiBs under a large vocabulary (Gemma's 262K)
            dense = model(input_ids=torch.cat([ids, full[:, :-1]], dim=1),
                          logits_to_keep=full.shape[1]).logits.float()
        ours, *_ = generate_tokens(model, ids, mask, policy, max_new_tokens=new_tokens, chunk_size=chunk_size)
        differs = full != ours
        divergence += torch.where(differs.any(1), differs.float().argmax(1), new_tokens).tolist()
        for a, b in zip(tokenizer.batch_decode(full, skip_special_tokens=True),
                        tokenizer.batch_decode(ours, skip_special_tokens=True)):
            rouge.append(scorer.score(a, b)["rougeL"].fmeasure if a.strip() or b.strip() else 1.0)
        sparse = _policy_logits(model, ids, full, policy, chunk_size)
        log_p, log_q = dense.log_softmax(-1), sparse.log_softmax(-1)
        kl += (log_p.exp() * (log_p - log_q)).sum(-1).mean(-1).clamp(min=0).tolist()
    return {
        "prompts": len(prompts),
        "prompt_tokens": prompts.shape[1],
        "new_tokens": new_tokens,
        "rouge_l": float(np.mean(rouge)),
        "tokens_to_divergence": float(np.mean(divergence)),
        "kl": float(np.mean(kl)),
        "per_prompt": {"rouge_l": rouge, "tokens_to_divergence": divergence, "kl": kl},
    }
