"""The conversation engine behind ``sparsegen chat`` and ``sparsegen serve``.

Each conversation (a ``Session``) owns a bounded ``EvictionCache`` of one sequence that lives across turns: a new
turn feeds only the text added since the last one (the new user message and the template around it), never the
history. A ``Job`` is one reply being produced. ``Engine.begin`` feeds a job's new text and samples its first
token; ``Engine.step`` runs one decode step for any number of jobs at once — their caches are stacked into one
batched cache (rows may hold different tokens at different positions) for as long as the same jobs decode
together; a row goes back to its session when its reply finishes or leaves. One thread drives an engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparsegen.generation import _next_token
from sparsegen.kv import EvictionCache, Policy
from sparsegen.kv.cache import DEFAULT_CHUNK
from sparsegen.serve.template import ChatTemplate


@dataclass
class Sampling:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()


class Session:
    """One conversation: its cache, and the text that cache holds (plus ``pending``, the last reply token, fed with
    the next turn)."""

    def __init__(self, session_id: str | None, cache: EvictionCache):
        self.id, self.cache = session_id, cache
        self.text = ""
        self.pending: list[int] = []
        self.turns = 0
        self.busy = False


@dataclass
class Job:
    session: Session
    sampling: Sampling
    prompt_tokens: int  # tokens fed for this turn (the new text only, unless the history was re-encoded)
    reencoded: bool  # the session's history had to be encoded again (new, evicted, or the messages changed)
    strip_leading: bool  # a base model's reply starts with the space after "Assistant:": not part of the content
    generator: torch.Generator | None
    on_text: Callable[[Job, str], None] | None = None
    tokens: list[int] = field(default_factory=list)
    content: str = ""  # the reply as returned: stop strings and what follows them removed
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that may be the start of a stop string (not shown until known)."""
    return max((n for stop in stops for n in range(len(stop) - 1, 0, -1) if text.endswith(stop[:n])), default=0)


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer, make_policy: Callable[[], Policy], positions: str | None = None,
                 chunk_size: int = DEFAULT_CHUNK, max_sessions: int = 64, max_batch: int = 16,
                 template: ChatTemplate | None = None):
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.model, self.tokenizer, self.make_policy = model, tokenizer, make_policy
        self.positions, self.chunk_size, self.max_sessions = positions, chunk_size, max_sessions
        self.template = template or ChatTemplate(tokenizer)
        self.device = next(model.parameters()).device
        from sparsegen.prompt import prefix_length

        self.offset = prefix_length(model)  # a prompt prefix sits in every cache before position 0 of the text
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.counters = {"requests": 0, "prefill_tokens": 0, "decode_tokens": 0, "reencoded_sessions": 0,
                         "evicted_sessions": 0}
        self.max_batch = max_batch
        self._batch: EvictionCache | None = None  # the stacked caches of the replies decoding together
        self._rows: list[Job] = []  # whose reply each row of it is
        self._steps: list[int] = []  # decode steps each row has run in the batch (not yet in its session's cache)
        self.make_policy()  # a bad policy or budget fails here, before any request

    # --- sessions ---
    def _new_cache(self) -> EvictionCache:
        return EvictionCache(self.model, self.make_policy(), positions=self.positions, chunk_size=self.chunk_size)

    def session(self, session_id: str | None) -> Session:
        """The session with this id (created if new; the least recently used idle one is dropped beyond
        ``max_sessions``), or a throwaway one for ``None``."""
        if session_id is None:
            return Session(None, self._new_cache())
        session = self.sessions.get(session_id)
        if session is None:
            while len(self.sessions) >= self.max_sessions:
                idle = next((k for k, s in self.sessions.items() if not s.busy), None)
                if idle is None:
                    raise RuntimeError(f"all {self.max_sessions} sessions are busy")
                del self.sessions[idle]
                self.counters["evicted_sessions"] += 1
            session = self.sessions[session_id] = Session(session_id, self._new_cache())
        self.sessions.move_to_end(session_id)
        return session

    def reset(self, session: Session) -> None:
        session.cache, session.text, session.pending = self._new_cache(), "", []

    # --- running ---
    def _feed(self, session: Session, ids: list[int]) -> torch.Tensor:
        """Encode ``ids`` into the session's cache in chunks; the logits after the last one."""
        cache = session.cache
        start = cache.length - (self.offset if cache.length else 0)
        tokens = torch.tensor([ids], device=self.device)
        for offset in range(0, len(ids), self.chunk_size):
            chunk = tokens[:, offset:offset + self.chunk_size]
            positions = torch.arange(start + offset, start + offset + chunk.shape[1], device=self.device)[None]
            logits = self.model(input_ids=chunk, position_ids=positions, past_key_values=cache, logits_to_keep=1).logits
        self.counters["prefill_tokens"] += len(ids)
        return logits[0, -1]

    @torch.inference_mode()
    def begin(self, session: Session, sampling: Sampling, messages: list[dict] | None = None,
              prompt: str | None = None, on_text: Callable[[Job, str], None] | None = None) -> Job:
        """Start a reply to ``messages`` (chat) or a continuation of ``prompt`` (completion) in ``session``.

        Only the text past what the session already holds is encoded; if the conversation does not extend
        it (a new or evicted session, or edited history), the session starts over from the whole text.
        """
        if (messages is None) == (prompt is None):
            raise ValueError("give messages or a prompt")
        if sampling.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        text = self.template.render(messages) if messages is not None else prompt
        self.counters["requests"] += 1
        continues = bool(session.text) and text.startswith(session.text)
        history = False
        if not continues:
            if session.text:
                self.reset(session)
            special = self.template.adds_special_tokens if messages is not None else True
            ids = self.tokenizer(text, add_special_tokens=special)["input_ids"]
            history = session.turns > 0 or (messages is not None and len(messages) > 1)  # e.g. an evicted session
            self.counters["reencoded_sessions"] += session.id is not None and history
        else:
            ids = session.pending + self.tokenizer(text[len(session.text):], add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError("the prompt is empty")
        session.busy, session.pending, session.text = True, [], text
        logits = self._feed(session, ids)
        generator = None
        if sampling.temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        job = Job(session, sampling, len(ids), reencoded=not continues and history,
                  strip_leading=messages is not None and not self.template.native, generator=generator,
                  on_text=on_text)
        self._accept(job, logits)
        return job

    @torch.inference_mode()
    def step(self, jobs: list[Job]) -> None:
        """One decode step for every unfinished job in ``jobs``, batched."""
        jobs = [job for job in jobs if not job.done]
        if not jobs:
            return
        if len(jobs) == 1 and self._batch is None:
            cache, positions = jobs[0].session.cache, [jobs[0].session.cache.length - self.offset]
        else:
            cache = self._stack(jobs)
            jobs = list(self._rows)  # the batch's row order
            positions = [job.session.cache.length - self.offset + steps for job, steps in zip(jobs, self._steps)]
        tokens = torch.tensor([[job.tokens[-1]] for job in jobs], device=self.device)
        logits = self.model(input_ids=tokens, position_ids=torch.tensor(positions, device=self.device)[:, None],
                            past_key_values=cache).logits[:, -1]
        self._steps = [steps + 1 for steps in self._steps]
        self.counters["decode_tokens"] += len(jobs)
        for job, row in zip(jobs, logits):
            self._accept(job, row)
            if job.done:
                self._unstack(job)

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        if not job.done:
            self._finish(job, "cancelled")
            self._unstack(job)

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
            self._batch = EvictionCache.stacked(self.model, [job.session.cache for job in joining],
                                                capacity=self.max_batch)
        else:
            for job in joining:
                self._batch.add_row(job.session.cache)
        self._rows += joining
        self._steps += [0] * len(joining)
        return self._batch

    def _unstack(self, job: Job) -> None:
        if self._batch is None or not any(row is job for row in self._rows):
            return
        index = next(i for i, row in enumerate(self._rows) if row is job)
        self._batch.remove_row(index, job.session.cache, self._steps[index])
        last = len(self._rows) - 1
        for rows in (self._rows, self._steps):  # the last row moved into the gap
            rows[index] = rows[last]
            rows.pop()
        if not self._rows:
            self._batch = None

    def _accept(self, job: Job, logits: torch.Tensor) -> None:
        """Sample the job's next token, update its visible text, and finish it at EOS, a stop string or the limit."""
        sampling = job.sampling
        token = int(_next_token(logits[None], sampling.temperature, sampling.top_p, job.generator)[0])
        job.tokens.append(token)
        eos = token == self.tokenizer.eos_token_id
        text = self.tokenizer.decode(job.tokens[:-1] if eos else job.tokens, skip_special_tokens=True)
        if job.strip_leading and text.startswith(" "):  # the template's own space after "Assistant:"
            text = text[1:]
        stops = tuple(sampling.stop) + tuple(self.template.stop if job.strip_leading else ())
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            self._emit(job, text[:cut])
            self._finish(job, "stop")
        elif eos:
            self._emit(job, text)
            self._finish(job, "stop")
        else:
            self._emit(job, text[:len(text) - _held_back(text, stops)])
            if len(job.tokens) >= sampling.max_tokens:
                self._emit(job, text)
                self._finish(job, "length")

    def _emit(self, job: Job, visible: str) -> None:
        if len(visible) > len(job.content) and visible.startswith(job.content):
            new, job.content = visible[len(job.content):], visible
            if job.on_text is not None:
                job.on_text(job, new)

    def _finish(self, job: Job, reason: str) -> None:
        """The last sampled token is not in the cache yet: it is fed first with the next turn."""
        session = job.session
        job.finish_reason = reason
        session.text += self.tokenizer.decode(job.tokens, skip_special_tokens=False)
        session.pending = job.tokens[-1:]
        session.turns += 1
        session.busy = False

    # --- what it holds ---
    def kv_bytes(self) -> int:
        """K and V bytes allocated by the sessions' caches (and the stacked batch, when one runs)."""
        caches = [s.cache for s in self.sessions.values()]
        if self._batch is not None:
            caches.append(self._batch)
        return sum(cache.allocated_bytes() for cache in caches)

    def kv_tokens(self, session: Session) -> int:
        return max(session.cache.held_tokens(), default=0)
