"""The conversation engine behind ``sparsegen chat`` and ``sparsegen serve``.

Each conversation (a ``Session``) owns a bounded ``EvictionCache`` of one sequence that lives across turns: a new turn
feeds only the text added since the last one (the new user message and the template around it), never the history. A
``Job`` is one reply being produced. ``Engine.begin`` starts it from the new text (tokenized by ``Engine.prepare``,
which a server calls in the request's own thread); ``Engine.step`` then advances any number of jobs at once: one
prefill chunk of one job still encoding its prompt (at most ``prefill_budget`` tokens while others decode, or
``"auto"``: as many as add one decode step's time; a KVzip session's first prompt whole; cancellable between chunks),
and one decode step for every job past its prompt — their caches are stacked into one batched cache (rows may hold
different tokens at different positions) for as long as the same jobs decode together; a row goes back to its session
when its reply finishes or leaves. While others decode, the chunk goes into their step's forward
(``sparsegen.kv.packed``): one pass over the weights for both. A failure in a job (its prompt, its sampling) fails it
alone; a forward that fails, the replies in it. One thread drives an engine.
With a ``Speculation`` (``--speculative``), each session also keeps a draft cache under the draft policy, and a reply
decoding alone advances by speculative rounds (drafted by that cache, verified by the session's full cache: the same
tokens as without). Replies decoding together step one token at a time, batched, as without it; the tokens their
draft caches missed meanwhile are fed to them with the next round, so no draft cache ever re-reads the history.
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

import torch

from sparsegen.detokenize import Detokenizer
from sparsegen.engine.context import CompressedContext
from sparsegen.engine.memory import KVMemory, kv_costs
from sparsegen.engine.prefill import PrefillBudget
from sparsegen.engine.reconstruct import compress_whole, reads_whole
from sparsegen.engine.sampling import next_token
from sparsegen.engine.session import (
    Job,
    Prepared,
    Sampling,
    Session,
    SessionsBusy,
    held_back,
    template_space,
    token_logprob,
)
from sparsegen.engine.speculative import ConversationDrafts, Speculation
from sparsegen.engine.step import DecodeStep, forward
from sparsegen.engine.store import SessionStore
from sparsegen.engine.template import ChatTemplate
from sparsegen.kv import EvictionCache, PolicySpec
from sparsegen.kv.cache import DEFAULT_CHUNK
from sparsegen.kv.quantized import AS_COMPUTED, held_kv
from sparsegen.kv.rollback import forget_last
from sparsegen.kv.rows import add_row, park, remove_row, stack
from sparsegen.models.anatomy import context_length, pinned_tokens

AUTO = "auto"


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer, policy: PolicySpec, chunk_size: int = DEFAULT_CHUNK,
                 max_sessions: int = 64, max_batch: int = 16, template: ChatTemplate | None = None,
                 max_prompt_tokens: int | None = None, speculation: Callable[[], Speculation] | None = None,
                 compile: bool | str | None = None, kv_memory: int | None = None, max_context: int | None = None,
                 idle_grace: float = 2.0, prefill_budget: int | str | None = None,
                 contexts: dict[str, CompressedContext] | None = None, packed_prefill: bool = True,
                 store: SessionStore | None = None):
        if max_sessions < 1 or max_batch < 1:
            raise ValueError("max_sessions and max_batch must be at least 1")
        if max_context is not None and max_context < 1:
            raise ValueError("max_context must be at least 1")
        if prefill_budget not in (None, AUTO) and not (isinstance(prefill_budget, int)
                                                       and 1 <= prefill_budget <= chunk_size):
            raise ValueError(f"prefill_budget must be between 1 and the chunk size ({chunk_size}), or {AUTO!r}, got "
                             f"{prefill_budget!r}")
        # prompt tokens one step encodes while other replies decode: what a long prompt adds to their token latency
        self.prefill_budget = prefill_budget or chunk_size
        self._budget = PrefillBudget(chunk_size) if prefill_budget == AUTO else None
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be at least 1")
        self.max_prompt_tokens = max_prompt_tokens
        self._spare_tokenizer, self._spare_lock = copy.deepcopy(tokenizer), threading.Lock()
        # no token is longer than this many characters, so a text of more than limit x this has too many tokens
        vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self._longest_token = max(map(len, vocabulary), default=0)
        if not isinstance(policy, PolicySpec):
            raise ValueError(f"Engine takes every session's cache settings as a PolicySpec, got {policy!r}")
        self.model, self.tokenizer, self.policy, self.chunk_size = model, tokenizer, policy, chunk_size
        self.template, self.device = template or ChatTemplate(tokenizer), next(model.parameters()).device
        self.offset = pinned_tokens(model)  # a prompt prefix sits in every cache before position 0 of the text
        # a prompt's chunk rides in the others' decode step (one forward) unless a prompt prefix is prepended to
        # every new sequence (it would be to the packed call); ``packed_prefill=False``: two forwards, for comparison
        self.packs = packed_prefill and not self.offset
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.counters = {"requests": 0, "prefill_tokens": 0, "decode_tokens": 0, "reencoded_sessions": 0,
                         "evicted_sessions": 0, "restored_sessions": 0, "drafted_tokens": 0, "accepted_tokens": 0}
        self.store = store  # sessions' caches snapshotted after each turn, for another process to continue
        self.max_batch = max_batch
        self._ticks = 0  # steps run
        self._batch: EvictionCache | None = None  # the stacked caches of the replies decoding together
        self._rows: list[Job] = []  # whose reply each row of it is
        self._steps: list[int] = []  # decode steps each row has run in the batch (not yet in its session's cache)
        policy = policy.fixed(max_context or context_length(model))  # (a fractional budget: of the longest one)
        if speculation is not None and policy.kv_bits is not None:
            raise ValueError("speculative decoding verifies with the model's own full cache: drop --kv-bits")
        self.policy = policy = policy if speculation is None else replace(policy, kv_bits=AS_COMPUTED)
        self.speculation, self.max_sessions = speculation, max_sessions
        if policy.build().budget_across_layers:
            raise ValueError(f"{policy.name} sizes each layer by the scores of the context it compressed, so two "
                             "conversations' caches differ layer by layer and cannot decode in one batch: serve "
                             "kvzip-heads (each layer's heads share its budget) or kvzip")
        self.quantization = held_kv(model, policy.kv_bits)  # (None: as the model computes them)
        if speculation is not None and policy.bounded:
            raise ValueError("speculative decoding verifies with the full cache: use --policy full (the draft "
                             "cache takes --speculative's policy)")
        self.drafts = None if speculation is None else ConversationDrafts(model, speculation, chunk_size, compile)
        self.decode = DecodeStep(model, compile)
        self.counters.update({"decode_seconds": 0.0, "decode_steps": 0, "dropped_sessions": 0, "packed_steps": 0,
                              "packed_decode_tokens": 0, "packed_seconds": 0.0})  # (packed: steps with a prompt chunk)
        self.max_context, self.memory = max_context, None
        if kv_memory is not None:
            self._plan_memory(kv_memory, idle_grace)
        self.contexts = dict(contexts or {})
        for name, context in self.contexts.items():
            if self.speculation is not None:
                raise ValueError("--context starts sessions from a compressed cache; speculative decoding would "
                                 "need its draft cache too: drop --speculative")
            context.check_served(name, model, self.new_cache())

    def _plan_memory(self, cap: int, idle_grace: float) -> None:
        """``--kv-memory``: every live session reserves its cache's whole allocation (``sparsegen.engine.memory``)."""
        if self.speculation is not None:
            raise ValueError("--kv-memory sizes one cache per session: drop --speculative (it adds a draft cache)")
        if not self.policy.bounded and self.max_context is None:
            self.max_context = context_length(self.model)
            if self.max_context is None:
                raise ValueError("a full cache under --kv-memory needs --max-context (the most tokens a session holds)")
        self.memory = KVMemory.plan(self.new_cache(), *kv_costs(self.model, self.quantization), cap, idle_grace)

    def _drop(self, session: Session) -> None:
        """A live session dropped for memory: its cache freed; its next request re-encodes its history."""
        self.reset(session)
        self.counters["dropped_sessions"] += 1

    # --- sessions ---
    def new_cache(self) -> EvictionCache:
        """An empty cache for one session under this engine's policy (it allocates when first fed). Under a compiled
        step it is marked from the start as one that will outgrow its budget (``mark_evicting``: the rolling sinks'
        frame is computed before eviction needs it, to the same result), so a conversation passing its budget
        meets no new graph mid-traffic, and an unbounded one allocates ``max_context`` at once (one shape of
        slots)."""
        one_shape = self.decode.compiled and not self.policy.bounded  # (a bounded policy's slots are its budget)
        cache = self.policy.cache(self.model, chunk_size=self.chunk_size,
                                  rollback=self.drafts.tokens if self.drafts is not None else 0,
                                  max_length=self.max_context,
                                  expected_length=self.max_context if self.memory is not None or one_shape else None)
        if self.decode.compiled:
            cache.mark_evicting(sys.maxsize)
        return cache

    def _new_draft(self) -> EvictionCache | None:
        return None if self.drafts is None else self.drafts.new_cache()

    def session(self, session_id: str | None) -> Session:
        """The session with this id (created if new; the least recently used idle one is dropped beyond
        ``max_sessions``), or a throwaway one for ``None``."""
        if session_id is None:
            return Session(None, self.new_cache(), self._new_draft())
        session = self.sessions.get(session_id)
        if session is None:
            while len(self.sessions) >= self.max_sessions:
                idle = next((k for k, s in self.sessions.items() if not s.busy), None)
                if idle is None:
                    raise SessionsBusy(f"all {self.max_sessions} sessions are busy")
                dropped = self.sessions.pop(idle)
                dropped.release()
                if self.memory is not None:
                    self.memory.leave(dropped)
                self.counters["evicted_sessions"] += 1
            session = self.sessions[session_id] = Session(session_id, self.new_cache(), self._new_draft())
        self.sessions.move_to_end(session_id)
        return session

    def _context_name(self, context: str | None) -> str | None:
        if context is not None and context not in self.contexts:
            known = ", ".join(self.contexts) or "none (start the server with --context NAME=FILE)"
            raise ValueError(f"unknown context {context!r}; this server has {known}")
        return context

    def reset(self, session: Session) -> None:
        """Empty the session's caches (what it holds is freed; a compressed context is restored when it next
        begins)."""
        session.release()
        session.cache, session.text, session.pending = self.new_cache(), "", []
        session.draft, session.draft_lag = self._new_draft(), []

    def _start_from_context(self, session: Session, context: str | None) -> None:
        """Point ``session`` at ``context`` (starting over if it held another), and restore the context's cache if
        it holds nothing yet."""
        if session.context != context:
            if session.text:
                self.reset(session)
            session.context = self._context_name(context)
        if session.context is not None and not session.text:
            compressed = self.contexts[session.context]
            session.release()
            # (checked against this model at start-up: not again on the engine thread for every session)
            session.cache = compressed.cache(self.model, self.policy.build(), check=False, max_length=self.max_context)
            session.text = compressed.text

    # --- running ---
    def prepare(self, session: Session | None, messages: list[dict] | None = None, prompt: str | None = None,
                elsewhere: bool = False, context: str | None = None) -> Prepared:
        """Render and tokenize a request's text against what ``session`` holds: the new text only if the
        conversation extends it, else all of it. ``elsewhere``: called from another thread than the one driving
        the engine (a server's request handler), with a copy of the tokenizer, so that reading a long text costs
        the request that sent it and not the replies decoding meanwhile. ``context``: the text follows that
        compressed context's. Bad input (an empty or over-long prompt, text the tokenizer refuses, an unknown
        context) raises ``ValueError``."""
        if (messages is None) == (prompt is None):
            raise ValueError("give messages or a prompt")
        text = self.template.render(messages) if messages is not None else prompt
        if not isinstance(text, str) or not text:
            raise ValueError("the prompt must be a non-empty string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"the text is not valid Unicode (a lone surrogate at character {err.start})") from None
        prefix = self.contexts[self._context_name(context)].text if context is not None else ""
        text = prefix + text
        held = session.text if session is not None and session.context == context and session.text else prefix
        base = held if held and text.startswith(held) else ""
        special = not base and (self.template.adds_special_tokens if messages is not None else True)
        ids = self.tokenize(text[len(base):], special, elsewhere)
        return Prepared(text, base, ids, messages is not None and len(messages) > 1)

    def tokenize(self, text: str, special: bool = True, elsewhere: bool = False) -> list[int]:
        """``text``'s tokens, refused (``ValueError``) past ``max_prompt_tokens``: by its length alone where that
        settles it (no token is longer than the vocabulary's longest), so a huge text costs no tokenizing.
        ``elsewhere``: see ``prepare``."""
        limit, longest = self.max_prompt_tokens, self._longest_token
        if limit is not None and longest and len(text) > limit * longest:
            raise ValueError(f"the prompt has at least {len(text) // longest:,} new tokens, over this server's limit "
                             f"of {limit}")
        if elsewhere:
            with self._spare_lock:  # a fast tokenizer refuses concurrent calls ("Already borrowed")
                ids = self._spare_tokenizer(text, add_special_tokens=special)["input_ids"]
        else:
            ids = self.tokenizer(text, add_special_tokens=special)["input_ids"]
        if limit is not None and len(ids) > limit:
            raise ValueError(f"the prompt has {len(ids)} new tokens, over this server's limit of {limit}")
        return ids

    def begin(self, session: Session, sampling: Sampling, messages: list[dict] | None = None,
              prompt: str | None = None, on_text: Callable[[Job, str], None] | None = None,
              prepared: Prepared | None = None, context: str | None = None) -> Job:
        """A reply to ``messages`` (chat) or a continuation of ``prompt`` (completion) in ``session``, to be
        advanced by ``step``. Only the text past what the session already holds is encoded; if the conversation
        does not extend it (a new or evicted session, or edited history), the session starts over from the whole
        text. ``prepared``: the text already tokenized by ``prepare`` (used if the session has not moved since).
        ``context``: the text follows that compressed context (``--context``), restored into the session's cache
        instead of encoded."""
        if not isinstance(sampling, Sampling):
            raise ValueError("sampling must be a Sampling")
        self._start_from_context(session, context)
        if self.store is not None and session.id is not None and not session.text and context is None \
                and self.store.restore(session, self.model, self.policy.build(), self.max_context):
            self.counters["restored_sessions"] += 1  # (``begin`` starts it over if the request does not extend it)
        current = session.text if prepared is not None and prepared.text.startswith(session.text) else ""
        if prepared is None or prepared.base != current:
            prepared = self.prepare(session, messages, prompt, context=context)
        continues = bool(prepared.base)
        ids = (session.pending if continues else []) + prepared.ids
        if not ids:
            raise ValueError("the prompt is empty")
        history = not continues and (session.turns > 0 or prepared.several_messages)  # e.g. an evicted session
        held = session.cache.length if continues else 0
        if self.max_context is not None and held + len(ids) + sampling.max_tokens > self.max_context:
            raise ValueError(f"this conversation would reach {held + len(ids) + sampling.max_tokens:,} tokens (held "
                             f"{held:,} + new {len(ids):,} + max_tokens {sampling.max_tokens:,}), over this server's "
                             f"--max-context {self.max_context:,}: start a new session or ask for fewer tokens")
        self.counters["requests"] += 1
        if not continues:
            if session.text:
                self.reset(session)
            self.counters["reencoded_sessions"] += session.id is not None and history
        session.busy, session.pending, session.text = True, [], prepared.text
        generator = None
        if sampling.temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        strip = messages is not None and not self.template.native
        return Job(session, sampling, len(ids), reencoded=history, strip_leading=strip, generator=generator,
                   cached_tokens=held - self.offset if continues else 0, on_text=on_text,
                   text=Detokenizer(self.tokenizer), feed=ids, served=self._ticks,
                   stops=tuple(sampling.stop) + tuple(self.template.stop if strip else ()))

    def unbegun(self, session: Session, in_doubt: bool) -> None:
        """After ``begin`` failed in ``session``: a session-less request gives back the K/V memory it reserved; a
        failure other than bad input (``in_doubt``: the session may be half set up) starts the session over, its
        memory given back too."""
        if in_doubt:
            self.reset(session)
            session.busy = False
        if self.memory is not None and (session.id is None or in_doubt):
            self.memory.leave(session)

    @torch.inference_mode()
    def step(self, jobs: list[Job]) -> None:
        """Advance every unfinished job in ``jobs``: one prompt chunk of the job still encoding its prompt that has
        waited longest for one (round robin: a short prompt waits at most a chunk per other prompt, and a long one
        is never starved by a stream of new ones), and one decode step for all past their prompts, batched. While
        others decode, the chunk (at most the prefill budget) rides in their step's forward (``PackedStep``)."""
        self._ticks += 1
        jobs = [job for job in jobs if not job.done]
        prefilling = min((job for job in jobs if job.feed), key=lambda job: job.served, default=None)
        decoding = [job for job in jobs if not job.feed]
        if len(decoding) == 1:
            # the others have finished: it decodes alone from here, in its own cache (speculating, if on), so a
            # compiled step never runs a stacked batch of one row (a graph of its own, beside the lone cache's)
            for job in list(self._rows):
                self._unstack(job)
        if prefilling is not None:
            prefilling.served = self._ticks
            if decoding and self.packs and not reads_whole(prefilling.session.cache):
                self._decode(decoding, prefilling if self._budget is None or self._budget.may_pack() else None)
                return
            tokens = self._prefill_tokens() if decoding else self.chunk_size
            self._guarded(prefilling, self._prefill, prefilling, tokens, self._budget if decoding else None)
            decoding = [job for job in jobs if not job.done and not job.feed]
        if not decoding:
            return
        if len(decoding) == 1 and self.speculation is not None:
            job = decoding[0]
            if job.sampling.max_tokens - len(job.tokens) > 1:
                self._guarded(job, self._speculate, job)
                if job.done:
                    self._close(job)
                return
        self._decode(decoding)

    def _decode(self, jobs: list[Job], prefilling: Job | None = None) -> None:
        """One decode step of ``jobs`` (batched unless one decodes alone) and, with ``prefilling``, the next chunk of
        its prompt in the same forward."""
        if len(jobs) == 1 and self._batch is None:
            cache, positions = jobs[0].session.cache, [jobs[0].session.cache.length - self.offset]
        else:
            cache = self._stack(jobs)
            jobs = list(self._rows)  # the batch's row order
            positions = [job.session.cache.length - self.offset + steps for job, steps in zip(jobs, self._steps)]
        started = time.perf_counter()
        tokens = torch.tensor([job.tokens[-1] for job in jobs], device=self.device)
        positions = torch.tensor(positions, device=self.device)
        chunk: list[int] = []
        try:
            if prefilling is None:
                logits = self.decode(cache, tokens, positions)
            else:
                budget, target = self._prefill_tokens(), prefilling.session.cache
                chunk, prefilling.feed = prefilling.feed[:budget], prefilling.feed[budget:]
                logits, last = self.decode.with_chunk(cache, tokens, positions, target,
                                                      torch.tensor(chunk, device=self.device), target.length)
        except Exception as err:  # noqa: BLE001  the rows may be half-updated: every reply in the step fails
            self.discard_batch()
            for job in jobs + ([prefilling] if prefilling is not None else []):
                self.fail(job, err)
            return
        self._steps = [steps + 1 for steps in self._steps]
        self.counters["decode_tokens"] += len(jobs)
        self.counters["decode_steps"] += 1
        for job, row in zip(jobs, logits):
            if job.session.draft is not None:
                job.session.draft_lag.append(job.tokens[-1])
            self._guarded(job, self._accept, job, row)
            if job.done:
                self._close(job)
        if chunk:
            self._guarded(prefilling, self._encoded, prefilling, chunk, last)
        seconds = time.perf_counter() - started  # the step and its sampling
        self.counters["decode_seconds"] += seconds
        if chunk:
            self.counters["packed_steps"] += 1
            self.counters["packed_decode_tokens"] += len(jobs)
            self.counters["packed_seconds"] += seconds
        if self._budget is not None:
            self._budget.packed += bool(chunk)
            if not chunk:
                self._budget.decoded(seconds)
            elif len(chunk) == self._budget.tokens and self._budget.step_seconds is not None:
                # what the chunk added to the step (as little as nothing: then it may grow)
                self._budget.encoded(len(chunk), max(seconds - self._budget.step_seconds, 1e-6))

    def _prefill_tokens(self) -> int:
        """Prompt tokens this step may encode while other replies decode."""
        return self._budget.tokens if self._budget is not None else self.prefill_budget

    def _prefill(self, job: Job, tokens: int, budget: PrefillBudget | None = None) -> None:
        """Encode the next ``tokens`` of the job's prompt; after the last one, sample its first token. A ``budget``
        learns what a whole chunk of ``tokens`` cost."""
        cache = job.session.cache
        whole = reads_whole(cache)
        chunk, job.feed = (job.feed, []) if whole else (job.feed[:tokens], job.feed[tokens:])
        start = cache.length - (self.offset if cache.length else 0)
        positions, ids = torch.arange(start, start + len(chunk), device=self.device)[None], torch.tensor([chunk])
        started = time.perf_counter()
        logits = compress_whole(self.model, cache, ids.to(self.device), positions, None, self.chunk_size) if whole \
            else forward(self.model, cache, ids.to(self.device), positions, last=True)
        if budget is not None and len(chunk) == tokens:
            budget.encoded(tokens, time.perf_counter() - started)
        self._encoded(job, chunk, logits[0])

    def _encoded(self, job: Job, chunk: list[int], logits: torch.Tensor) -> None:
        """After ``chunk`` of the job's prompt went into its cache (``logits``: its last position's): count it, owe it
        to the draft cache, and after the prompt's last chunk sample the reply's first token."""
        self.counters["prefill_tokens"] += len(chunk)
        if job.session.draft is not None:
            job.session.draft_lag += chunk
        if not job.feed:
            self._accept(job, logits)
            if job.done:
                self._close(job)

    def _speculate(self, job: Job) -> None:
        self.drafts.round(self.model, job, self.offset, self._take, self._forget, self.counters)

    def _forget(self, session: Session, tokens: int) -> None:
        """Drop the newest ``tokens`` from the session's cache and, where it has them, its draft cache."""
        if not tokens:
            return
        forget_last(session.cache, tokens)
        if session.draft is not None:
            lagging = min(tokens, len(session.draft_lag))
            session.draft_lag = session.draft_lag[:len(session.draft_lag) - lagging]
            forget_last(session.draft, tokens - lagging)

    def _guarded(self, job: Job, action: Callable, *args) -> None:
        try:
            action(*args)
        except Exception as err:  # noqa: BLE001  one reply's failure is that reply's only
            self.fail(job, err)

    @torch.inference_mode()
    def fail(self, job: Job, err: Exception) -> None:
        """End ``job`` with an error."""
        job.error = f"{type(err).__name__}: {err}"
        self._abandon(job, "error")

    def recover(self, jobs: list[Job], err: BaseException, reason: str = "error") -> None:
        """After an error outside any one reply or an interrupt mid-step, when the engine's state is in doubt: forget
        the stacked batch without reading it, end every unfinished job in ``jobs`` (``reason``) and start their
        sessions over. Touches no tensor in place, so it cannot fail the way the step did."""
        self.discard_batch()
        for job in jobs:
            if not job.done:
                job.error, job.finish_reason, job.forget = f"{type(err).__name__}: {err}", reason, 0
            self.reset(job.session)
            job.session.busy = False

    def _abandon(self, job: Job, reason: str) -> None:
        """End ``job`` without keeping its turn: its session starts over (its cache may hold part of a prompt or
        of a step)."""
        self._unstack(job)
        job.finish_reason, job.forget = reason, 0
        self.reset(job.session)
        job.session.busy = False

    @torch.inference_mode()
    def cancel(self, job: Job) -> None:
        """Stop ``job`` at any point (queued work, prompt, decoding alone or in the batch): its row leaves the
        batch, which goes on for the others; a reply cut mid-way stays in its session as far as it went."""
        job.cancelled = True
        if job.done:
            return
        if job.feed:  # the cache holds part of the prompt
            self._abandon(job, "cancelled")
            return
        self._finish(job, "cancelled")
        self._close(job)

    def discard_batch(self) -> None:
        """Forget the stacked rows without writing them back (after a failed step; reset their sessions)."""
        self._batch, self._rows, self._steps = None, [], []

    def _stack(self, jobs: list[Job]) -> EvictionCache:
        """The batched cache with exactly ``jobs`` as rows: rows of jobs no longer here leave, new ones join."""
        wanted = set(map(id, jobs))
        for job in [job for job in self._rows if id(job) not in wanted]:
            self._unstack(job)
        present = set(map(id, self._rows))
        joining = [job for job in jobs if id(job) not in present]
        if self._batch is None:
            self._batch = stack(self.model, [job.session.cache for job in joining],
                                                capacity=self.max_batch, exact=self.memory is not None)
        else:
            for job in joining:
                add_row(self._batch, job.session.cache)
        for job in joining:
            park(job.session.cache)  # the batch holds its row now: one copy of each conversation
        self._rows += joining
        self._steps += [0] * len(joining)
        return self._batch

    def _close(self, job: Job) -> None:
        """A finished job's row goes back to its session, less the tokens past a stop string."""
        self._unstack(job)
        self._forget(job.session, job.forget)

    def _unstack(self, job: Job) -> None:
        if self._batch is None or not any(row is job for row in self._rows):
            return
        index = next(i for i, row in enumerate(self._rows) if row is job)
        remove_row(self._batch, index, job.session.cache, self._steps[index])
        last = len(self._rows) - 1
        for rows in (self._rows, self._steps):  # the last row moved into the gap
            rows[index] = rows[last]
            rows.pop()
        if not self._rows:
            self._batch = None

    def _accept(self, job: Job, logits: torch.Tensor) -> None:
        """Sample the job's next token and take it."""
        sampling = job.sampling
        self._take(job, int(next_token(logits[None], sampling.temperature, sampling.top_p, job.generator)[0]), logits)

    def _take(self, job: Job, token: int, scores: torch.Tensor | None = None) -> None:
        """Add ``token`` (sampled from the logits ``scores``) to the reply, show the text it completes, and finish
        the reply at EOS, a stop string or the limit. Costs O(1) amortized in the reply's length: only the new text,
        and a stop string's length before it, are searched."""
        sampling, raw = job.sampling, job.text
        job.tokens.append(token)
        if sampling.logprobs is not None and scores is not None:
            job.logprobs.append(token_logprob(scores, token, sampling.logprobs))
        eos = token == self.tokenizer.eos_token_id and not sampling.ignore_eos
        last = eos or len(job.tokens) >= sampling.max_tokens
        if not eos:
            raw.add(token)
        if last:
            raw.flush()
        if job.lead is None:  # a base model's reply starts after the template's space: known from two characters
            if raw.length < 2 and not last:
                return
            job.lead = template_space(raw.text[:2]) if job.strip_leading else 0
            job.searched = job.emitted = job.lead
        longest = max(map(len, job.stops), default=0)
        start = max(job.lead, job.searched - longest + 1)  # a match may begin in text searched before
        window = raw.tail(raw.length - start)
        cut = min((start + found for s in job.stops if (found := window.find(s)) >= 0), default=-1)
        job.searched = raw.length
        if cut >= 0:
            self._emit(job, cut)
            self._finish(job, "stop", shown=raw.text[:cut])
            return
        self._emit(job, raw.length if last else raw.length - held_back(window, job.stops))
        if last:
            self._finish(job, "stop" if eos else "length")

    def _emit(self, job: Job, end: int) -> None:
        """Show the raw text up to character ``end``."""
        if end > job.emitted:
            new = job.text.tail(job.text.length - job.emitted)[:end - job.emitted]
            job.emitted = end
            job.shown.append(new)
            if job.on_text is not None:
                job.on_text(job, new)

    def _finish(self, job: Job, reason: str, shown: str | None = None) -> None:
        """The last sampled token is not in the cache yet: it is fed first with the next turn. A reply cut at a stop
        string (``shown``: its text up to the cut) keeps only its tokens that fall before the cut, so the session's
        text is what the client's history will hold and the next turn extends it."""
        session = job.session
        job.finish_reason = reason
        if shown is None:
            session.text += self.tokenizer.decode(job.tokens, skip_special_tokens=False)
            session.pending = job.tokens[-1:]
        else:
            kept = len(job.tokens) - 1  # the cache holds every reply token but the last
            while kept and not shown.startswith(self.tokenizer.decode(job.tokens[:kept], skip_special_tokens=True)):
                kept -= 1
            session.text += self.tokenizer.decode(job.tokens[:kept], skip_special_tokens=False)
            session.pending, job.forget = [], len(job.tokens) - 1 - kept
        session.turns += 1
        session.busy = False
        session.idle_since = time.monotonic()

    def settle(self, job: Job) -> None:
        """After a finished reply (however it ended): its session is idle from now, and a session-less request's
        cache gives back its memory."""
        job.session.idle_since = time.monotonic()
        if self.store is not None and job.finish_reason in ("stop", "length"):
            self.store.keep(job.session, self.model)
        if job.session.id is None:
            job.session.release()
            if self.memory is not None:
                self.memory.leave(job.session)

    def admit(self, session: Session) -> bool:
        """Whether a request of ``session`` may start now under ``--kv-memory`` (always without it)."""
        return self.memory is None or self.memory.admit(session, self._drop)

    # --- what it holds ---
    def kv_bytes(self) -> int:
        """K and V bytes allocated by the sessions' caches (and the stacked batch, when one runs)."""
        caches = [s.cache for s in self.sessions.values()]
        if self._batch is not None:
            caches.append(self._batch)
        return sum(cache.allocated_bytes() for cache in caches)
