"""The one thread that owns the model: requests wait in a bounded line, are admitted between engine steps, and get
their text pushed back to the handlers waiting on them."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sparsegen.engine.memory import kv_costs
from sparsegen.engine.scheduler import Engine
from sparsegen.engine.session import Job, Prepared, Sampling, SessionsBusy, TokenLogprob
from sparsegen.serve.schemas import ApiError, ChatRequest, GenerationRequest, Limits, shutting_down

log = logging.getLogger("sparsegen.serve")


@dataclass
class Pending:
    """A request (one choice of it) on its way through the worker: what it asks, and the channel its text comes back
    on, shared by the request's choices: events are ``(index, kind, payload)``."""

    kind: str  # "chat" or "completion"
    request: GenerationRequest
    text: dict  # ``messages=`` or ``prompt=``, as the engine takes them
    session_id: str | None  # namespaced by API key
    sampling: Sampling
    prepared: Prepared
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    index: int = 0
    job: Job | None = None
    cancelled: bool = False
    sent_logprobs: int = 0  # the reply's token log-probabilities already sent with its text
    request_id: str = ""  # what the server's log lines and the X-Request-Id header call the request
    waits_for: str | None = None  # held in the line for "memory" or a "session"

    def send(self, kind: str, payload=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, payload))
        except RuntimeError:  # the handler's event loop is closed (shutdown): nobody is waiting
            pass

    def new_logprobs(self) -> list[TokenLogprob]:
        """The reply's token log-probabilities not sent yet (marked sent)."""
        job = self.job
        new, self.sent_logprobs = job.logprobs[self.sent_logprobs:], len(job.logprobs)
        return new


class WaitingLine:
    """Requests not started yet, oldest first: ``new`` ones, and ``held`` ones that wait for a place (K/V memory
    under ``--kv-memory``, or a session when every one is busy). Bounded by ``limit`` together (a full line answers
    429); a request whose client left is withdrawn at once, so it holds no place while it waits."""

    def __init__(self, limit: int):
        self.limit = limit
        self.new: collections.deque[Pending] = collections.deque()
        self.held: collections.deque[Pending] = collections.deque()
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        self.left = 0  # requests withdrawn because their clients left

    def put(self, pending: Pending) -> None:
        with self.lock:
            if len(self.new) + len(self.held) >= self.limit:
                raise ApiError(429, f"{self.limit} requests are already waiting; retry later", "rate_limit_error",
                               "overloaded")
            self.new.append(pending)
            self.arrived.notify()

    def take(self, timeout: float) -> Pending | None:
        """The oldest new request, waiting up to ``timeout`` seconds for one; None if none came."""
        with self.lock:
            if not self.new and timeout > 0:
                self.arrived.wait(timeout)
            return self.new.popleft() if self.new else None

    def hold(self, pending: Pending, reason: str) -> None:
        """``pending`` (taken, or held already) waits for a place: kept in order, behind those held before it."""
        with self.lock:
            pending.waits_for = reason
            if not any(p is pending for p in self.held):
                self.held.append(pending)

    def holding(self) -> list[Pending]:
        with self.lock:
            return list(self.held)

    def withdraw(self, pending: Pending, client_left: bool = False) -> None:
        """``pending`` leaves the line, wherever it is in it (nowhere: nothing to do)."""
        with self.lock:
            for line in (self.new, self.held):
                for i, queued in enumerate(line):
                    if queued is pending:
                        del line[i]
                        self.left += client_left
                        return

    def drain(self) -> list[Pending]:
        """Every request still waiting, taken out."""
        with self.lock:
            waiting = list(self.held) + list(self.new)
            self.held.clear()
            self.new.clear()
            return waiting

    def counts(self) -> dict:
        with self.lock:
            held = [p.waits_for for p in self.held]
        return {"queued_requests": len(self.new) + len(held), "waiting_for_memory": held.count("memory"),
                "waiting_for_session": held.count("session")}


class Worker(threading.Thread):
    """Owns the engine: admits queued requests between steps, cancels those whose clients left, steps. It never dies
    of an error: one in a reply fails that reply (the engine's own guard), one anywhere else fails the replies in
    flight, whose sessions start over (``rebuilds``, logged once each). If it dies anyway (a ``BaseException``), it
    fails everything waiting and calls ``on_death``: the server then reports it and exits. ``drain``: a graceful
    stop (SIGTERM) — nothing new starts, the replies in flight finish within a grace, then fail with a 503; once none
    is left it calls ``on_drained`` (the server then stops listening)."""

    def __init__(self, engine: Engine, limits: Limits):
        super().__init__(name="sparsegen-engine", daemon=True)
        self.engine, self.limits = engine, limits
        self.line = WaitingLine(limits.max_queue)
        self.active: list[Pending] = []
        self.stopping = threading.Event()
        self.deadline: float | None = None  # draining: when the replies still in flight are ended (monotonic)
        self.lock = threading.Lock()
        self.errors = 0
        self.cancelled = 0
        self.rebuilds = 0
        self.last_rebuild: str | None = None
        self.died: str | None = None
        self.on_death: Callable[[], None] | None = None
        self.on_drained: Callable[[], None] | None = None
        self.snapshot: dict = {}
        self._publish()

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def submit(self, pending: Pending) -> None:
        if self.stopping.is_set() or self.draining or self.died is not None:
            raise shutting_down()
        self.line.put(pending)

    def withdraw(self, pending: Pending) -> None:
        """The client of a request left: it stops holding a place in the line (if it is still in it)."""
        pending.cancelled = True
        self.line.withdraw(pending, client_left=True)

    def drain(self, grace: float) -> None:
        """Stop starting requests (those waiting get a 503 now) and end the replies in flight that have not finished
        ``grace`` seconds from now. Safe from any thread (a signal handler's)."""
        if self.deadline is None:
            self.deadline = time.monotonic() + grace

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                try:
                    self._tick()
                except Exception as err:  # noqa: BLE001  outside any one reply: the state is in doubt
                    self._rebuild(err)
                self._publish()
        except BaseException as err:
            self.died = f"{type(err).__name__}: {err}"
            log.critical("the engine thread died (%s); the server stops", self.died, exc_info=True)
            raise
        finally:
            self._fail_all()
            if self.died is not None and self.on_death is not None:
                self.on_death()

    def _tick(self) -> None:
        if self.draining:
            self._refuse_waiting()
            if time.monotonic() >= self.deadline:
                self._end_in_flight()
        else:
            self._admit()
        for pending in self.active:
            if pending.cancelled and not pending.job.done:
                self.engine.cancel(pending.job)
                self.cancelled += 1
        self._retire()
        if self.active:
            self.engine.step([p.job for p in self.active])
            self._retire()
        elif self.draining:
            if self.on_drained is not None:  # every reply is answered: the server may stop listening
                self.on_drained()
                self.on_drained = None
            time.sleep(0.02)  # nothing left to do but answer what arrives until the server stops

    def _refuse_waiting(self) -> None:
        for pending in self.line.drain():
            pending.send("error", shutting_down())

    def _end_in_flight(self) -> None:
        """The grace is over: every reply still in flight ends now with a 503 (a stream: an error event)."""
        for pending in self.active:
            if not pending.job.done:
                pending.cancelled = True  # (answered here: ``_retire`` sends nothing more)
                self.engine.cancel(pending.job)
                pending.send("error", shutting_down("the server shut down before the reply finished"))

    def _rebuild(self, err: Exception) -> None:
        """Fail the replies in flight, start their sessions over and forget the stacked batch: the engine is as if
        they had never come."""
        self.rebuilds += 1
        self.last_rebuild = f"{type(err).__name__}: {err}"
        log.error("engine error outside any one reply; %d replies in flight fail and the engine's batch is rebuilt",
                  len(self.active), exc_info=True)
        self.engine.recover([p.job for p in self.active if p.job is not None], err)
        self._retire()

    def _fail_all(self) -> None:
        """The worker stops: every reply in flight or queued gets a 503."""
        gone = shutting_down("the server shut down before the reply finished")
        for pending in list(self.active) + self.line.drain():
            pending.send("error", gone)
        self.active = []

    def _retire(self) -> None:
        for pending in self.active:
            job = pending.job
            if job.done:
                self.engine.settle(job)
            if job.done and not pending.cancelled:
                if job.finish_reason == "error":
                    self.errors += 1
                    pending.send("error", ApiError(500, f"the reply failed: {job.error}", "server_error"))
                else:
                    pending.send("done", job)
        self.active = [p for p in self.active if not p.job.done]

    def _admit(self) -> None:
        """Start waiting requests while the batch has room: first those held for a place (oldest first), then new
        ones; a request that cannot start yet (no K/V memory, or every session busy) is held, in order."""
        held = self.line.holding()
        while len(self.active) < self.limits.max_batch:
            if held:
                pending = held.pop(0)
                if pending.cancelled:  # (its handler withdrew it, and counted it)
                    continue
            else:
                # nothing decoding: wait a little for a request (those held wait meanwhile too)
                pending = self.line.take(timeout=0.05 if not self.active else 0)
                if pending is None:
                    break
                if pending.cancelled:  # its client left as it was taken from the line
                    self.cancelled += 1
                    continue
            try:
                reason = self._begin(pending)
            except ApiError as err:
                self.line.withdraw(pending)
                pending.send("error", err)
                continue
            except Exception as err:  # noqa: BLE001
                self.line.withdraw(pending)
                self.errors += 1
                pending.send("error", ApiError(500, f"the request failed: {type(err).__name__}: {err}",
                                               "server_error"))
                continue
            if reason is not None:
                self.line.hold(pending, reason)
            else:
                self.line.withdraw(pending)
                self.active.append(pending)

    def _begin(self, pending: Pending) -> str | None:
        """Start the request (``pending.job``); or what it waits for ("memory" or "session") if it cannot start yet.
        A request that fails to start gives back any K/V memory it reserved."""
        engine, request = self.engine, pending.request
        session = engine.sessions.get(pending.session_id) if pending.session_id else None
        if session is not None and session.busy:
            raise ApiError(409, "this session is already answering another request", code="busy")
        try:
            session = engine.session(pending.session_id)
        except SessionsBusy:
            return "session"
        if not engine.admit(session):
            return "memory"
        # a streamed reply's text goes out as it comes (with its tokens' log-probabilities, when asked); an
        # unstreamed one's handler waits quietly for the end (and notices a disconnected client meanwhile)
        on_text = (lambda job, text: pending.send("text", (text, pending.new_logprobs()))) \
            if request.stream else None  # noqa: E731
        try:
            pending.job = engine.begin(session, pending.sampling, on_text=on_text, prepared=pending.prepared,
                                       **pending.text)
        except ValueError as err:
            engine.unbegun(session, in_doubt=False)
            raise ApiError(400, str(err)) from None
        except BaseException:
            engine.unbegun(session, in_doubt=True)
            raise
        return None

    def _publish(self) -> None:
        engine = self.engine
        snapshot = {**{f"{k}_total": v for k, v in engine.counters.items()}, "errors_total": self.errors,
                    "cancelled_total": self.cancelled + self.line.left,
                    "engine_rebuilds_total": self.rebuilds,
                    "sessions": len(engine.sessions), "active_replies": len(self.active),
                    **self.line.counts(), "kv_bytes": engine.kv_bytes(),
                    **(engine.memory.metrics() if engine.memory is not None else {})}
        with self.lock:
            self.snapshot = snapshot


def texts_of(request: GenerationRequest) -> list[dict]:
    """``messages=`` or ``prompt=`` for each choice the request asks, as the engine takes them."""
    context = {"context": request.context} if request.context is not None else {}
    if isinstance(request, ChatRequest):
        return [{"messages": [m.as_engine() for m in request.messages], **context}]
    return [{"prompt": prompt, **context}
            for prompt in ([request.prompt] if isinstance(request.prompt, str) else request.prompt)]


def kv_bound(engine: Engine, limits: Limits) -> int:
    """Worst-case K/V bytes: every stored session and every in-flight reply at its full allocation, plus the
    stacked copy of a full decode batch; under ``--kv-memory``, its cap."""
    if engine.memory is not None:
        return engine.memory.cap
    per_token, per_row = kv_costs(engine.model, engine.quantization)
    budget = engine.policy.build().budget
    per_session = (budget + engine.chunk_size) * per_token + per_row
    return (limits.max_sessions + limits.max_batch) * per_session + limits.max_batch * ((budget + 1) * per_token
                                                                                         + per_row)
