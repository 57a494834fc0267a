"""Lossless self-speculative decoding: the model over a small evicted KV cache drafts, the full cache verifies.

At long contexts most of the bytes a decode step reads are the KV cache, not the weights. The same model reading a
StreamingLLM or H2O cache of a few hundred tokens drafts ``K`` tokens for a fraction of a full step's cost; one
forward of the full cache over the ``K + 1`` tokens then checks them all (TriForce, Sun et al. 2024; MagicDec, Chen
et al. 2024). Greedy output is the full cache's, token for token; sampled output follows the full cache's
distribution exactly (speculative sampling: Leviathan et al. 2023, Chen et al. 2023).

Two caches over one model (or over a smaller draft model with the same vocabulary): the target keeps everything,
the draft cache evicts under its policy and is fed every accepted token, so it never re-reads the history. Rejected
tokens are forgotten in both (``sparsegen.kv.rollback.forget_last``). The target forgets exactly; the draft cache cannot
bring back what the rejected tokens made it evict, and under H2O the attention their queries paid stays in the
scores: the drafts get slightly worse after a rejection, the output never changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparsegen.engine.prefill import prefill
from sparsegen.engine.sampling import GREEDY_BELOW, check_sampling, next_token, sampling_probs
from sparsegen.engine.session import Job
from sparsegen.engine.step import DecodeStep, forward
from sparsegen.kv import EvictionCache, Policy, make_policy
from sparsegen.kv.cache import DEFAULT_CHUNK
from sparsegen.kv.policies.full import Full
from sparsegen.kv.quantized import AS_COMPUTED
from sparsegen.kv.rollback import forget_last

MOST_DRAFT_TOKENS = 16
FIRST_AUTO_DRAFT = 4


def draft_policy(spec: str | Policy, input_length: int | None = None) -> Policy:
    """The draft cache's policy from ``POLICY[:BUDGET]`` (``streaming:512``, ``h2o:0.1`` = 10% of the input)."""
    if isinstance(spec, Policy):
        policy = spec
    else:
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError("--speculative takes POLICY[:BUDGET], e.g. streaming:512 or h2o:0.1")
        name, _, budget = spec.strip().partition(":")
        if name == "full":
            raise ValueError("a draft cache keeping everything costs what the full cache costs: give an evicting "
                             "policy, e.g. --speculative streaming:512")
        policy = make_policy(name, budget or None, input_length=input_length)
    if policy.budget is None:
        raise ValueError("the draft cache needs a budget: e.g. --speculative streaming:512")
    return policy


def draft_length(value: int | str) -> int | str:
    """``--draft-tokens``: a count in [1, 16] or ``auto``."""
    if value == "auto":
        return value
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--draft-tokens takes a count or 'auto', got {value!r}") from None
    if not 1 <= count <= MOST_DRAFT_TOKENS or isinstance(value, bool):
        raise ValueError(f"--draft-tokens must be in [1, {MOST_DRAFT_TOKENS}] or 'auto', got {value!r}")
    return count


def best_draft_length(acceptance: float, draft_seconds: float, verify_seconds: float,
                      most: int = MOST_DRAFT_TOKENS) -> int:
    """The ``K`` that maximises expected tokens per second when each draft token is accepted with probability
    ``acceptance``: a round of ``K`` draft steps and one verification yields ``(1 - a^(K+1)) / (1 - a)`` tokens
    (Leviathan et al. 2023, eq. 1)."""
    a = min(max(acceptance, 0.0), 0.999)

    def rate(k: int) -> float:
        return (1 - a ** (k + 1)) / (1 - a) / (k * draft_seconds + verify_seconds)

    return max(range(1, most + 1), key=rate)


@dataclass
class Speculation:
    """How to draft: the draft cache's policy, tokens per round (``"auto"`` adapts it to the measured acceptance
    and step costs), the draft cache's positions, and an optional separate draft model (same vocabulary)."""

    policy: Policy
    draft_tokens: int | str = 4
    positions: str | None = None
    model: torch.nn.Module | None = None


@dataclass
class _Counters:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0
    committed: int = 0  # tokens the rows kept, over the rounds (target steps)
    row_rounds: int = 0
    draft_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def add(self, accepted: torch.Tensor, k: int, active: list[bool], draft_seconds: float,
            verify_seconds: float) -> None:
        """One round: rows that were still generating count."""
        kept = [n for n, alive in zip(accepted.tolist(), active) if alive]
        self.rounds += 1
        self.proposed += k * len(kept)
        self.accepted += sum(kept)
        self.rejections += sum(n < k for n in kept)
        self.committed += sum(kept) + len(kept)
        self.row_rounds += len(kept)
        self.draft_steps += k
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds

    def acceptance(self) -> float:
        """Per-token acceptance, the maximum-likelihood estimate under the geometric model of a round (a rejection
        ends it; a round that accepts every draft is cut short, not rejected)."""
        trials = self.accepted + self.rejections
        return self.accepted / trials if trials else 0.0

    def report(self, draft_tokens) -> dict:
        return {
            "draft_tokens": draft_tokens,
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "draft_steps": self.draft_steps,
            "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else None,
            "tokens_per_step": round(self.committed / self.row_rounds, 3) if self.row_rounds else None,
            "draft_ms": round(1000 * self.draft_seconds / self.draft_steps, 3) if self.draft_steps else None,
            "verify_ms": round(1000 * self.verify_seconds / self.rounds, 3) if self.rounds else None,
            "mean_draft_length": round(self.draft_steps / self.rounds, 2) if self.rounds else None,
            # a batch runs rounds until its slowest row is done: rows done sooner wait (verified and drafted all the
            # same), so a batch's tokens per round fall below tokens_per_step
            "rows_per_round": round(self.row_rounds / self.rounds, 2) if self.rounds else None,
        }


def _synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def draft_token(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft token from the draft cache's logits ``[..., V]``, and the distribution it was sampled from (None when
    greedy): what ``accept`` weighs it by."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(-1), None
    probs = sampling_probs(logits, temperature, top_p)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1]), probs


def accept(drafts: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor, temperature: float,
           top_p: float, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [B], next token [B])`` for ``drafts [B, K]`` against the target's logits ``[B, K + 1, V]``
    (position ``i`` predicts the token after draft ``i - 1``).

    Greedy: the longest prefix equal to the target's own choices, then the target's choice after it. Sampling: draft
    ``i`` is kept with probability ``min(1, p(d)/q(d))``; at the first rejection the next token comes from
    ``max(0, p - q)`` renormalised, and after ``K`` acceptances from ``p``: so every token follows ``p``.
    """
    batch, k = drafts.shape
    rows = torch.arange(batch, device=drafts.device)
    if temperature < GREEDY_BELOW:
        choices = target_logits.argmax(-1)  # [B, K + 1]
        accepted = (drafts == choices[:, :k]).long().cumprod(-1).sum(-1)
        return accepted, choices[rows, accepted]
    p = sampling_probs(target_logits, temperature, top_p)
    p = p / p.sum(-1, keepdim=True)
    if k == 0:
        return torch.zeros_like(rows), torch.multinomial(p[:, 0], 1, generator=generator).squeeze(-1)
    q = draft_probs / draft_probs.sum(-1, keepdim=True)
    p_drafts = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_drafts = q.gather(-1, drafts[..., None]).squeeze(-1)
    uniform = torch.rand(batch, k, device=drafts.device, generator=generator)
    accepted = (uniform * q_drafts < p_drafts).long().cumprod(-1).sum(-1)
    at = accepted.clamp(max=k - 1)
    leftover = (p[rows, at] - q[rows, at]).clamp(min=0)
    # after a rejection p(d) < q(d), so p - q is positive somewhere; the guard only catches rounding
    use_leftover = (accepted < k) & (leftover.sum(-1) > 0)
    choose_from = torch.where(use_leftover[:, None], leftover, p[rows, accepted])
    return accepted, torch.multinomial(choose_from, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def speculative_tokens(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    speculation: Speculation,
    max_new_tokens: int = 100,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    chunk_size: int = DEFAULT_CHUNK,
    eos_id: int | None = None,
    pad_id: int = 0,
    on_token: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    progress: bool | None = None,
    compile: bool | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict, float, float]:
    """What ``generation.generate_tokens`` returns under the full cache, drafted as ``speculation`` says: ``(new
    [B, n], counts [B], the full cache's stats with "draft_cache" and "speculation" entries, prefill s, decode s)``.

    Rows accept different numbers of tokens: each row's caches forget what that row rejected (a row already done,
    the whole round). A row that accepted every draft has one the draft cache never saw; it is fed with the next
    round's first draft step. ``compile``: the draft's one-token steps go through ``torch.compile`` (``DecodeStep``).
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    check_sampling(temperature, top_p, seed)
    fixed = draft_length(speculation.draft_tokens)
    drafter = speculation.model if speculation.model is not None else model
    _check_vocabularies(model, drafter)
    device, batch = ids.device, ids.shape[0]
    target, draft = _caches(model, drafter, speculation, ids.shape[1] + max_new_tokens, chunk_size)
    generator = torch.Generator(device=device).manual_seed(seed) if temperature >= GREEDY_BELOW else None
    draft_step = DecodeStep(drafter, compile)
    t0 = _synchronized(device)
    logits = prefill(model, target, ids, mask, chunk_size, progress)
    prefill(drafter, draft, ids, mask, chunk_size, progress)
    # rows that accept different counts hold different numbers of draft tokens from then on: compiled, the draft's
    # steps take that shape from the first one (one graph for the run, not a second compile midway)
    draft.padded = draft.padded or (draft_step.compiled and batch > 1)
    prefill_seconds = _synchronized(device) - t0
    t0 = time.perf_counter()
    rows = torch.arange(batch, device=device)
    fed = mask.sum(-1)  # real tokens in both caches per row: the position of the pending token
    pending = next_token(logits, temperature, top_p, generator)  # the target's latest token, in neither cache yet
    # rows whose last accepted draft the draft cache has not seen (it drafted it, never fed it)
    carried, last_draft = torch.zeros(batch, dtype=torch.bool, device=device), pending
    out, counters = Output(pending.tolist(), max_new_tokens, eos_id), _Counters()
    k = fixed if fixed != "auto" else FIRST_AUTO_DRAFT
    while not out.done():
        if on_token is not None:
            on_token(*out.tensors(pad_id, device))
        k_round = min(k, out.most_needed() - 1)
        # rows already done are still fed (the batch's shapes stay), then forget the round whole: their caches stop
        # growing, where they grew by up to a round's drafts each round until the slowest row was done and outgrew
        # the full cache's room (a reallocation and a second copy of it: at 4K x 8, a 2 s verification)
        done = ~torch.tensor(out.active(), device=device)
        t1 = _synchronized(device)
        drafted, draft_probs = _draft(drafter, draft, draft_step, k_round, pending, last_draft, carried, fed,
                                      (temperature, top_p, generator))
        t2 = _synchronized(device)
        logits = forward(model, target, torch.cat([pending[:, None], drafted], 1),
                         fed[:, None] + torch.arange(k_round + 1, device=device))
        accepted, bonus = accept(drafted, draft_probs, logits, temperature, top_p, generator)
        t3 = _synchronized(device)
        # both caches keep the pending token and the accepted drafts; the draft cache was never fed the last draft
        forget_last(target, torch.where(done, k_round + 1, k_round - accepted))
        if k_round:  # (the draft was fed the pending token, k - 1 drafts and a carried one)
            forget_last(draft, torch.where(done, k_round + carried.long(), (k_round - 1 - accepted).clamp(min=0)))
            carried = (accepted == k_round) & ~done
            last_draft = drafted[rows, -1]
        counters.add(accepted, k_round, out.active(), t2 - t1, t3 - t2)
        out.extend(drafted.tolist(), accepted.tolist(), bonus.tolist())
        fed, pending = torch.where(done, fed, fed + accepted + 1), torch.where(done, pending, bonus)
        if fixed == "auto":
            k = best_draft_length(counters.acceptance(), counters.draft_seconds / max(counters.draft_steps, 1),
                                  counters.verify_seconds / counters.rounds)
    decode_seconds = time.perf_counter() - t0
    new, counts = out.tensors(pad_id, device)
    if on_token is not None:
        on_token(new, counts)
    report = {**counters.report(speculation.draft_tokens), "draft_compiled_steps": draft_step.compiled_steps}
    stats = {**target.stats(), "draft_cache": draft.stats(), "speculation": report}
    return new, counts, stats, prefill_seconds, decode_seconds


def _caches(model: torch.nn.Module, drafter: torch.nn.Module, speculation: Speculation, length: int,
            chunk_size: int) -> tuple[EvictionCache, EvictionCache]:
    """The target's full cache and the draft's, each with room for ``length`` tokens and a round of drafts."""
    room = length + MOST_DRAFT_TOKENS + 1  # (K/V as computed: the model's own full cache verifies)
    target = EvictionCache(model, Full(), chunk_size=chunk_size, expected_length=room, rollback=MOST_DRAFT_TOKENS,
                           kv_bits=AS_COMPUTED)
    draft = EvictionCache(drafter, speculation.policy, positions=speculation.positions, chunk_size=chunk_size,
                          expected_length=room, rollback=MOST_DRAFT_TOKENS, kv_bits=AS_COMPUTED)
    return target, draft


def _draft(drafter: torch.nn.Module, draft: EvictionCache, draft_step: DecodeStep, k: int, pending: torch.Tensor,
           last_draft: torch.Tensor, carried: torch.Tensor, fed: torch.Tensor,
           sampling: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One round's ``k`` drafts ``[B, k]`` from the draft cache, after the ``pending`` token, and (sampling) their
    distributions ``[B, k, vocab]``. Rows that ``carried`` their last accepted draft (drafted, never fed) feed it
    with the pending token in the round's first call."""
    batch, device = pending.shape[0], pending.device
    drafts, draft_probs = [], []
    token = pending
    for i in range(k):
        if i == 0 and bool(carried.all()):  # every row's carried draft, then the pending token: two steps
            draft_step(draft, last_draft, fed - 1)
            logits = draft_step(draft, token, fed)
        elif i == 0 and bool(carried.any()):  # some rows': with the pending token in one call, masked where not
            logits = forward(
                drafter, draft, torch.stack([last_draft, pending], 1), torch.stack([fed - 1, fed], 1),
                torch.cat([torch.ones(batch, draft.length, dtype=torch.long, device=device), carried.long()[:, None],
                           torch.ones_like(fed)[:, None]], 1), last=True)
        else:
            logits = draft_step(draft, token, fed + i)
        token, probs = draft_token(logits, *sampling)
        drafts.append(token)
        if probs is not None:
            draft_probs.append(probs)
    drafted = torch.stack(drafts, 1) if drafts else pending.new_empty(batch, 0)
    return drafted, torch.stack(draft_probs, 1) if draft_probs else None


class Output:
    """Each row's new tokens, up to ``max_new_tokens`` or an end-of-sequence token."""

    def __init__(self, first: list[int], max_new_tokens: int, eos_id: int | None):
        self.rows = [[token] for token in first]
        self.max_new_tokens, self.eos_id = max_new_tokens, eos_id
        self.finished = [self._ends(row) for row in self.rows]

    def _ends(self, row: list[int]) -> bool:
        return len(row) >= self.max_new_tokens or (self.eos_id is not None and row[-1] == self.eos_id)

    def done(self) -> bool:
        return all(self.finished)

    def active(self) -> list[bool]:
        return [not done for done in self.finished]

    def most_needed(self) -> int:
        return max(self.max_new_tokens - len(row) for row, done in zip(self.rows, self.finished) if not done)

    def extend(self, drafted: list[list[int]], accepted: list[int], bonus: list[int]) -> None:
        for i, row in enumerate(self.rows):
            for token in drafted[i][:accepted[i]] + [bonus[i]]:
                if self.finished[i]:
                    break
                row.append(token)
                self.finished[i] = self._ends(row)

    def tensors(self, pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(map(len, self.rows))
        new = torch.tensor([row + [pad_id] * (width - len(row)) for row in self.rows], device=device)
        return new, torch.tensor([len(row) for row in self.rows], device=device)


def _check_vocabularies(model: torch.nn.Module, drafter: torch.nn.Module) -> None:
    if drafter is model:
        return
    sizes = [m.get_output_embeddings().weight.shape[0] for m in (model, drafter)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"the draft model's vocabulary ({sizes[1]} tokens) is not the model's ({sizes[0]}): draft "
                         "with a compressed copy of the same model (same tokenizer)")


class ConversationDrafts:
    """Speculation for a server's conversations (``sparsegen.engine.scheduler``): each session's draft cache under
    the draft policy, and a round for a reply decoding alone. Replies decoding together step one token at a time;
    what their draft caches missed meanwhile is fed with the next round, so no draft cache re-reads the history."""

    def __init__(self, model: torch.nn.Module, speculation: Callable[[], Speculation], chunk_size: int,
                 compile: bool | str | None):
        self.speculation, self.chunk_size = speculation, chunk_size
        self.drafter = speculation().model or model
        self.tokens = draft_length(speculation().draft_tokens)
        if self.tokens == "auto":
            raise ValueError("the engine drafts a fixed number of tokens per round: give --draft-tokens K")
        self.step = DecodeStep(self.drafter, compile)
        self.device = next(model.parameters()).device

    def new_cache(self) -> EvictionCache:
        spec = self.speculation()
        return EvictionCache(self.drafter, spec.policy, positions=spec.positions, chunk_size=self.chunk_size,
                             rollback=self.tokens, kv_bits=AS_COMPUTED)

    def round(self, model: torch.nn.Module, job: Job, offset: int, take: Callable, forget: Callable,
              counters: dict) -> None:
        """One speculative round for a reply decoding alone: the draft cache catches up (the tokens it missed and the
        last sampled one), drafts ``K`` tokens, the session's full cache checks them in one forward; both caches keep
        what was accepted, and every accepted token goes through ``take`` as a decoded one would (``forget``: the
        accepted tokens past a reply's end)."""
        session, sampling = job.session, job.sampling
        target, draft, drafter = session.cache, session.draft, self.drafter
        k = min(self.tokens, sampling.max_tokens - len(job.tokens) - 1)
        catch_up, session.draft_lag = session.draft_lag + job.tokens[-1:], []
        start = draft.length - (offset if draft.length else 0)
        for i in range(0, len(catch_up), self.chunk_size):  # the missed tokens, a chunk at a time
            chunk = catch_up[i:i + self.chunk_size]
            logits = forward(drafter, draft, torch.tensor([chunk], device=self.device),
                             torch.arange(start + i, start + i + len(chunk), device=self.device)[None], last=True)[0]
        drafts, probs = [], []
        position = start + len(catch_up)
        for i in range(k):
            if i:
                logits = self.step(draft, torch.tensor([drafts[-1]], device=self.device),
                                   torch.tensor([position + i - 1], device=self.device))[0]
            token, distribution = draft_token(logits, sampling.temperature, sampling.top_p, job.generator)
            drafts.append(int(token))
            if distribution is not None:
                probs.append(distribution)
        first = target.length - offset
        verify = torch.tensor([job.tokens[-1:] + drafts], device=self.device)
        logits = forward(model, target, verify, torch.arange(first, first + k + 1, device=self.device)[None])
        accepted, bonus = accept(torch.tensor([drafts], device=self.device),
                                 torch.stack(probs)[None] if probs else None, logits, sampling.temperature,
                                 sampling.top_p, job.generator)
        n = int(accepted)
        forget_last(target, k - n)
        if n < k:
            forget_last(draft, k - 1 - n)
        else:
            session.draft_lag = drafts[-1:]
        counters["drafted_tokens"] += k
        counters["accepted_tokens"] += n
        kept = drafts[:n] + [int(bonus)]
        for taken, token in enumerate(kept, 1):
            counters["decode_tokens"] += 1
            take(job, token, logits[0, taken - 1])
            if job.done:  # the caches hold every reply token but the last: drop the accepted ones after it
                forget(session, len(kept) - taken)
                return
