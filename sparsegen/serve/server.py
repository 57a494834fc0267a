"""``sparsegen serve``: an OpenAI-compatible HTTP server whose conversations live in bounded, compressed KV caches.

One worker thread owns the model and an ``Engine``. Requests queue to it (bounded: a full queue answers 429); it
admits them between steps, and each step encodes one chunk of one new prompt and runs one batched decode step for
every reply in progress, pushing text to the waiting handlers — so a long prompt delays the others by at most a
chunk per token. A request with a session id (``session_id`` in the body or an ``X-Session-Id`` header) keeps its
cache for the next turn, which then encodes only the new message; without one a request is stateless. Sessions
belong to the API key that made them. A client that disconnects cancels its reply at the next step (a queued one
leaves the queue at once). SIGTERM drains: queued requests get 503, replies in flight get a grace (``make_server``).

Every request is checked before it costs anything: API key, JSON content type, body size and time (counted as the body
arrives, chunked uploads included), then the strict typed schema (nesting bounded), the server's limits, and text the
tokenizer could not take. Every 5xx logs one line naming the request's id (``X-Request-Id``).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import hashlib
import hmac
import itertools
import json
import logging
import re
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from functools import partial
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException

from sparsegen.bench.memory import current_rss
from sparsegen.decoding import COMPILES
from sparsegen.serve.engine import MOST_LOGPROBS, Engine, Job, Prepared, Sampling, SessionsBusy, TokenLogprob

log = logging.getLogger("sparsegen.serve")
SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
SESSION_ID_RULE = "1-128 characters from A-Z a-z 0-9 . _ : @ -"


@dataclass(frozen=True)
class Limits:
    """What one server accepts. Every count must be at least 1, every timeout above 0."""

    max_sessions: int = 64
    max_batch: int = 16  # replies decoded together
    max_queue: int = 64  # requests waiting beyond that: 429
    max_tokens: int = 1024  # per reply
    max_prompt_tokens: int = 8192  # new tokens one request may ask the server to encode
    max_messages: int = 256
    max_stops: int = 4
    max_stop_chars: int = 256
    max_request_bytes: int = 1 << 20
    max_inspections: int = 2  # /v1/inspect calls running or waiting beyond which: 429
    header_timeout: float = 10.0  # seconds a client has to send a request's headers, once it starts them
    body_timeout: float = 30.0  # seconds a client has to send a request's whole body, once its headers are in
    api_keys: tuple[str, ...] = ()  # none: no authentication

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_timeout"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                    raise ValueError(f"{f.name} must be a positive number of seconds, got {value!r}")
            elif f.name != "api_keys" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
        if any(not isinstance(key, str) or not key.strip() or not key.isprintable() for key in self.api_keys):
            raise ValueError("API keys must be non-empty printable strings")


MOST_NESTING = 32  # levels of JSON arrays and objects a request body may nest (a real request nests five at most)


def _readable_json(value):
    """A body the server can read, checked without recursion (a body nested 960 deep would otherwise raise a
    ``RecursionError`` here): at most ``MOST_NESTING`` levels, and text the tokenizer can take (JSON may carry lone
    UTF-16 surrogates, "\\ud800", that no UTF-8 text has)."""
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(f"a string holds a lone surrogate at character {err.start}; send valid "
                                 "Unicode") from None
        elif isinstance(item, (dict, list)):
            if depth >= MOST_NESTING:
                raise ValueError(f"the body nests arrays and objects more than {MOST_NESTING} levels deep; send "
                                 "the request's fields as the API documents them")
            pending += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return value


def _content_text(content) -> str | None:
    """A message's content as one string: a string, a list of text parts (joined), or None. Parts of any other
    type (images, audio, files) are refused by name: this server serves text models."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content must be a string, a list of content parts, or null")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"content part {i} has type {kind!r}: this server serves a text-only model and reads "
                             f'only {{"type": "text", "text": ...}} parts')
        if not isinstance(part.get("text"), str):
            raise ValueError(f'content part {i} needs a string "text"')
        texts.append(part["text"])
    return "".join(texts)


class TextPart(BaseModel):
    """A part of a message's content (what the schema documents; ``_content_text`` reads them)."""

    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A chat message as OpenAI clients send it: ``content`` a string, a list of text parts (joined), or null on an
    assistant turn; the ``developer`` role is the system role of newer models."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # read as one string (``_content_text``)
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value):
        return _content_text(value)

    @model_validator(mode="after")
    def _readable(self):
        if self.role == "tool" or self.tool_calls or self.tool_call_id is not None:
            raise ValueError("tool messages and tool calls are not supported: this server calls no tools")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (only an assistant turn may have null content)")
        return self

    def as_engine(self) -> dict:
        """``{"role", "content"}`` as the chat template takes them."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints take; unset sampling fields take the server's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    seed: int | None = Field(default=None, ge=-2**63, lt=2**64)  # any 64-bit seed, as OpenAI takes
    n: int = Field(default=1, ge=1)
    user: str | None = None
    session_id: str | None = Field(default=None, pattern=f"^{SESSION_ID.pattern}$")
    ignore_eos: bool = False  # vLLM's extension: decode max_tokens whatever the model says (fixed-length benchmarks)
    context: str | None = Field(default=None, max_length=128)  # sparsegen's: continue a compressed context (--context)
    # sent by OpenAI clients; neutral values are accepted, others are refused (REFUSED says why)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        return _readable_json(data)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MOST_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class InspectRequest(BaseModel):
    """``POST /v1/inspect``: what each policy keeps of a text (``sparsegen.inspect``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    text: str = Field(min_length=1)
    policies: str | list[str] = "window,streaming,h2o,snapkv"
    budget: int | float | str = 256
    question: str | None = None
    answer: str | None = None
    protocol: Literal["stream", "context"] = "stream"
    kv_bits: Literal[16, 8, 4, 2] | None = None
    max_new_tokens: int = Field(default=16, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        return _readable_json(data)


class CompletionRequest(_Request):
    prompt: str | list[str] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        if any(not prompt for prompt in ([value] if isinstance(value, str) else value)):
            raise ValueError("a prompt must be a non-empty string")
        return value


# What this server refuses of OpenAI's request fields, and why (docs/serving.md lists the same): field -> (the values
# accepted, the reason any other is refused).
REFUSED = {
    "n": ("1", "one reply per request: send several requests (each with its own seed) for several samples"),
    "best_of": ("1", "one reply per request"),
    "echo": ("false", "the prompt is not returned with the reply"),
    "suffix": ("null", "no fill-in-the-middle"),
    "frequency_penalty": ("0", "no repetition penalties: sampling is temperature and top_p"),
    "presence_penalty": ("0", "no repetition penalties: sampling is temperature and top_p"),
    "logit_bias": ("{}", "no logit biases"),
    "tools": ("[]", "this server calls no tools"),
    "tool_choice": ('"none"', "this server calls no tools"),
    "response_format": ('{"type": "text"}', "no constrained decoding (JSON modes and schemas)"),
}


def refused_field(parsed: _Request) -> str | None:
    """The first field of ``parsed`` set to a value this server does not honour (see ``REFUSED``), if any."""
    checks = {
        "n": parsed.n != 1,
        "best_of": getattr(parsed, "best_of", None) not in (None, 1),
        "echo": getattr(parsed, "echo", False),
        "suffix": getattr(parsed, "suffix", None) is not None,
        "frequency_penalty": bool(parsed.frequency_penalty),
        "presence_penalty": bool(parsed.presence_penalty),
        "logit_bias": bool(parsed.logit_bias),
        "tools": bool(getattr(parsed, "tools", None)),
        "tool_choice": getattr(parsed, "tool_choice", None) not in (None, "none"),
        "response_format": getattr(parsed, "response_format", None) is not None
        and parsed.response_format.type != "text",
    }
    return next((name for name, refused in checks.items() if refused), None)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ReplyMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ReplyMessage
    logprobs: dict | None = None
    finish_reason: Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict | None = None
    finish_reason: Literal["stop", "length"]


class _Reply(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage
    session_id: str | None = Field(description="the conversation this reply extends, if any (no key's prefix)")


class ChatCompletion(_Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class Completion(_Reply):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorReply(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sparsegen"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _documented(reply: type[BaseModel]) -> dict:
    """The OpenAPI responses of a generation endpoint: the reply, its event stream, and the error shape."""
    errors = {status: {"model": ErrorReply, "description": about} for status, about in [
        (400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
        (413, "body too large"), (415, "not JSON"), (429, "queue full"), (500, "the reply failed"),
        (503, "shutting down")]}
    stream = {"schema": {"type": "string", "description": "with `stream`: `data: {chunk}` events, then "
                                                          "`data: [DONE]`"}}
    return {200: {"model": reply, "content": {"text/event-stream": stream}}, **errors}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def shutting_down(what: str = "the server is shutting down") -> ApiError:
    """The 503 every request gets that a stopping server will not answer."""
    return ApiError(503, f"{what}; retry on another server or later", "server_error", "shutting_down")


def log_5xx(request_id: str, err: ApiError) -> None:
    """The one log line a 5xx answer gets, wherever it was raised (``X-Request-Id`` names the same request)."""
    if err.status >= 500:
        log.log(logging.ERROR if err.status == 500 else logging.WARNING, "request %s: %d %s", request_id,
                err.status, err.message)


class ClientGone(Exception):
    """The client closed its connection: its reply was cancelled, and nobody is left to answer."""


@dataclass
class Pending:
    """A request (one choice of it) on its way through the worker: what it asks, and the channel its text comes back
    on, shared by the request's choices: events are ``(index, kind, payload)``."""

    kind: str  # "chat" or "completion"
    request: _Request
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
    stop (SIGTERM) — nothing new starts, the replies in flight finish within a grace, then fail with a 503."""

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


def _texts_of(request: _Request) -> list[dict]:
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
    per_token, per_row = engine.kv_costs()
    budget = engine.make_policy().budget
    per_session = (budget + engine.chunk_size) * per_token + per_row
    return (limits.max_sessions + limits.max_batch) * per_session + limits.max_batch * ((budget + 1) * per_token
                                                                                         + per_row)


OPEN_PATHS = ("/health", "/inspect")  # answered without an API key: a health check, and a page with no data (the
# data it asks for, /v1/inspect, takes the key, which the page's form sends)


class Guard:
    """ASGI middleware that checks a request before the app reads it: the API key (which also names the request's
    session namespace, in ``scope["state"]``), a JSON content type on POST, and the body size — counted as the body
    arrives, so a chunked upload is cut off at the limit instead of being read whole first — and its time: the
    whole body within ``body_timeout`` seconds (408 past it). Every request gets an id (``X-Request-Id``, and in
    the server's log lines); an exception that escapes the app answers 500 in OpenAI's shape, logged in one line."""

    def __init__(self, app, limits: Limits, worker: Worker):
        self.app, self.worker = app, worker
        self.limit, self.body_timeout = limits.max_request_bytes, limits.body_timeout
        # a session belongs to the key that made it: its namespace is a digest of the key, never the key itself
        self.keys = {key: hashlib.sha256(key.encode()).hexdigest()[:16] for key in limits.api_keys}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = f"req-{uuid.uuid4().hex[:16]}"
        started = False

        async def tagged(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        namespace = ""
        if self.keys and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            match = [ns for key, ns in self.keys.items() if hmac.compare_digest(given.encode(), f"Bearer {key}".encode())]
            if not match:
                return await _reply(tagged, ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                                     "authentication_error", "invalid_api_key"))
            namespace = match[0]
        scope.setdefault("state", {}).update(namespace=namespace, request_id=request_id)
        if scope["method"] == "POST":
            content_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if content_type != "application/json":
                return await _reply(tagged, ApiError(415, f"the body must be JSON sent as Content-Type: "
                                                          f"application/json, not {content_type or 'none'!r}",
                                                     code="unsupported_media_type"))
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _reply(tagged, self._too_large())
        received, whole = 0, False
        deadline = time.monotonic() + self.body_timeout

        async def counted():
            nonlocal received, whole
            if whole:  # the body is in: what comes now (a disconnect) may take any time
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request's body did not arrive within {self.body_timeout:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if received > self.limit:
                    raise HTTPException(413, self._too_large().message)
            return message

        try:
            await self.app(scope, counted, tagged)
        except Exception as err:  # noqa: BLE001  a bug: this request fails, in one log line; the server goes on
            self.worker.errors += 1
            log.error("request %s: 500 internal error (%s: %s)", request_id, type(err).__name__, err)
            log.debug("request %s failed", request_id, exc_info=True)
            if not started:
                await _reply(tagged, ApiError(500, f"internal error: {type(err).__name__}", "server_error"))

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request is larger than {self.limit} bytes", code="too_large")


async def _reply(send, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "too_large"}


def build_app(engine: Engine, limits: Limits, model_name: str, defaults: Sampling | None = None) -> FastAPI:
    """The app serving ``engine`` as ``model_name``; ``defaults``: sampling for fields a request leaves out."""
    if engine.make_policy().budget is None and engine.memory is None:
        raise ValueError("serve keeps every conversation's cache, and policy 'full' grows without bound; use window, "
                         "streaming, h2o or streaming-h2o with a --budget, or cap it with --kv-memory")
    defaults = defaults or Sampling(max_tokens=min(Sampling.max_tokens, limits.max_tokens))
    if defaults.max_tokens > limits.max_tokens:
        raise ValueError(f"the default max_tokens ({defaults.max_tokens}) is over the limit ({limits.max_tokens})")
    engine.max_prompt_tokens = limits.max_prompt_tokens
    worker = Worker(engine, limits)
    api = Api(engine, worker, limits, model_name, defaults)
    inspector = Inspector(engine, limits, model_name)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stopping.set()
        api.preparer.shutdown(cancel_futures=True)
        inspector.close()
        await asyncio.to_thread(worker.join, 30)

    def drain(grace: float) -> None:
        """A graceful stop (``run_server`` on SIGTERM): nothing new starts, replies in flight get ``grace`` s."""
        worker.drain(grace)
        inspector.stop_all()

    app = FastAPI(title="sparsegen", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(Guard, limits=limits, worker=worker)
    app.state.worker, app.state.kv_bound, app.state.drain = worker, kv_bound(engine, limits), drain
    app.state.limits = limits
    _answer_errors(app)
    _route_generation(app, api)
    _route_inspection(app, inspector)
    _route_operations(app, worker, app.state.kv_bound)
    return app


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _answer_errors(app: FastAPI) -> None:
    """Every failure answers OpenAI's error shape (never a bare 500 page); a client that left, one log line."""

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        log_5xx(request.scope.get("state", {}).get("request_id", ""), err)
        return _error(err)

    @app.exception_handler(HTTPException)
    async def _http_error(request, err: HTTPException):
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        reply = _error(ApiError(err.status_code, str(err.detail), kind, HTTP_CODES.get(err.status_code)))
        if err.status_code == 408:  # the body stopped halfway: the connection cannot carry another request
            reply.headers["connection"] = "close"
        return reply

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err: RequestValidationError):
        errors = err.errors()  # our own checks' messages name the fix: shown first
        first = next((e for e in errors if e["type"] == "value_error"), errors[0])
        where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
        if first["type"] == "json_invalid":  # its location is a character offset, not a field
            where, message = "body", f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'malformed')})"
        elif where == "body":
            message = f"the body must be a JSON object with the request's fields ({first['msg']})"
        else:
            message = f"{where}: {first['msg']}"
        return _error(ApiError(400, message, param=None if where == "body" else where))

    @app.exception_handler(ClientGone)
    async def _gone(request, err: ClientGone):  # a normal event: one info line, no traceback
        log.info("client disconnected from %s; its reply was cancelled", request.url.path)
        return PlainTextResponse("", status_code=499)


class Api:
    """The generation endpoints' work: check a request against the server's limits, hand its choices to the worker,
    and gather or stream what comes back."""

    def __init__(self, engine: Engine, worker: Worker, limits: Limits, model_name: str, defaults: Sampling):
        self.engine, self.worker, self.limits, self.model_name, self.defaults = \
            engine, worker, limits, model_name, defaults
        self.started = int(time.time())
        # requests are rendered and tokenized here, one at a time, beside the worker: in one thread, so the memory a
        # long text briefly takes is reused rather than kept by one allocator arena per thread
        self.preparer = ThreadPoolExecutor(1, thread_name_prefix="sparsegen-prepare")

    def served(self, name: str) -> None:
        """A 404 for a model this server does not serve."""
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check(self, parsed: _Request, request: Request) -> tuple[str | None, Sampling]:
        """The server's own limits on a well-formed request; its session id (namespaced) and sampling."""
        limits, defaults = self.limits, self.defaults
        if parsed.model is not None:
            self.served(parsed.model)
        refused = refused_field(parsed)
        if refused is not None:
            accepted, why = REFUSED[refused]
            raise ApiError(400, f"{refused} is not supported beyond {accepted}: {why}", param=refused,
                           code="unsupported_value")
        wanted = parsed.max_completion_tokens or parsed.max_tokens or defaults.max_tokens
        if wanted > limits.max_tokens:
            raise ApiError(400, f"max_tokens {wanted} is over this server's limit of {limits.max_tokens}",
                           param="max_tokens")
        messages = getattr(parsed, "messages", None)
        if messages is not None and len(messages) > limits.max_messages:
            raise ApiError(400, f"{len(messages)} messages is over this server's limit of {limits.max_messages}",
                           param="messages")
        if len(parsed.stop) > limits.max_stops or any(len(s) > limits.max_stop_chars for s in parsed.stop):
            raise ApiError(400, f"stop takes up to {limits.max_stops} strings of up to {limits.max_stop_chars} "
                                f"characters", param="stop")
        session_id = parsed.session_id or request.headers.get("x-session-id")
        if session_id is not None and not SESSION_ID.fullmatch(session_id):
            raise ApiError(400, f"a session id has {SESSION_ID_RULE}", param="session_id")
        prompts = getattr(parsed, "prompt", "")
        if not isinstance(prompts, str):
            if session_id is not None and len(prompts) > 1:
                raise ApiError(400, "a session holds one conversation: send one prompt with a session id",
                               param="prompt")
            if len(prompts) > limits.max_batch:
                raise ApiError(400, f"{len(prompts)} prompts is over this server's limit of {limits.max_batch} per "
                                    f"request", param="prompt")
        namespace = request.scope.get("state", {}).get("namespace", "")
        return (None if session_id is None else f"{namespace}/{session_id}"), self.sampling(parsed, wanted)

    def sampling(self, parsed: _Request, max_tokens: int) -> Sampling:
        """The request's sampling, with the server's defaults for what it leaves out."""
        defaults = self.defaults
        if isinstance(parsed, ChatRequest):
            if parsed.top_logprobs is not None and not parsed.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            logprobs = (parsed.top_logprobs or 0) if parsed.logprobs else None
        else:
            logprobs = parsed.logprobs
        return Sampling(
            max_tokens=max_tokens,
            temperature=defaults.temperature if parsed.temperature is None else parsed.temperature,
            top_p=defaults.top_p if parsed.top_p is None else parsed.top_p,
            seed=defaults.seed if parsed.seed is None else parsed.seed % 2**63,  # a negative seed is a seed too
            stop=tuple(parsed.stop), logprobs=logprobs, ignore_eos=parsed.ignore_eos)

    async def serve(self, request: Request, kind: str, parsed: _Request):
        session_id, sampling = self.check(parsed, request)
        session = self.engine.sessions.get(session_id) if session_id else None
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        pendings: list[Pending] = []
        try:
            for index, text in enumerate(_texts_of(parsed)):
                try:  # tokenized beside the worker: a long text costs its sender, not the replies decoding
                    prepared = await loop.run_in_executor(
                        self.preparer, partial(self.engine.prepare, session, elsewhere=True, **text))
                except ValueError as err:
                    raise ApiError(400, str(err)) from None
                pending = Pending(kind, parsed, text, session_id, sampling, prepared, loop, events, index,
                                  request_id=request.scope.get("state", {}).get("request_id", ""))
                self.worker.submit(pending)
                pendings.append(pending)
            ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            shown_id = session_id.split("/", 1)[1] if session_id else None
            reply = Reply(ident, int(time.time()), shown_id, kind, pendings, self.model_name, self.engine.tokenizer)
            if parsed.stream:
                first = await _next_event(request, events)  # errors found on admission keep their HTTP status
                if first[1] == "error":
                    raise first[2]
                usage = parsed.stream_options is not None and parsed.stream_options.include_usage
                return StreamingResponse(_stream(request, reply, first, usage), media_type="text/event-stream",
                                         headers={"X-Session-Id": shown_id or "", **_history(pendings)})
            jobs = await _wait(request, events, len(pendings))
        except BaseException:
            for pending in pendings:
                self.worker.withdraw(pending)  # stop decoding what nobody will read, and free its place in line
            raise
        return JSONResponse(reply.whole(jobs), headers=_history(pendings))


def _history(pendings: list[Pending]) -> dict:
    """``X-Session-History: reencoded`` when a session's history was encoded again (dropped for memory, evicted, or
    edited by the client), ``kept`` when only the new text was; nothing for a request without a session."""
    jobs = [p.job for p in pendings if p.job is not None]
    if not jobs or jobs[0].session.id is None:
        return {}
    return {"X-Session-History": "reencoded" if any(job.reencoded for job in jobs) else "kept"}


async def _next_event(request: Request, events: asyncio.Queue) -> tuple:
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise ClientGone from None


async def _wait(request: Request, events: asyncio.Queue, choices: int) -> list[Job]:
    jobs: dict[int, Job] = {}
    while len(jobs) < choices:
        index, what, payload = await _next_event(request, events)
        if what == "error":
            raise payload
        if what == "done":
            jobs[index] = payload
    return [jobs[i] for i in range(choices)]


def _usage_of(jobs: list[Job]) -> Usage:
    prompt, completion = sum(job.prompt_tokens for job in jobs), sum(len(job.tokens) for job in jobs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


@dataclass
class Reply:
    """What every response of one request shares, and its shapes."""

    ident: str
    created: int
    session_id: str | None
    kind: str
    pendings: list[Pending]
    model_name: str
    tokenizer: object

    def chunk(self, index: int, text: str | None, finish: str | None, role: bool = False,
              logprobs: list[TokenLogprob] | None = None, usage: Usage | None = None) -> str:
        if usage is not None:
            choices = []
        elif self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choices = [{"index": index, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish}]
        else:
            choices = [{"index": index, "text": text or "", "logprobs": self.logprobs(logprobs),
                        "finish_reason": finish}]
        body = {"id": self.ident, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage.model_dump()
        return f"data: {json.dumps(body)}\n\n"

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's ``logprobs`` object of a choice (of a chunk) for ``entries``; None when not asked."""
        if self.pendings[0].sampling.logprobs is None or entries is None:
            return None
        if self.kind == "chat":
            def item(token: int, logprob: float) -> dict:
                text = self.token_text(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(*t) for t in e.top]}
                                for e in entries], "refusal": None}
        tokens = [self.token_text(e.token) for e in entries]
        offsets = list(itertools.accumulate(map(len, tokens[:-1]), initial=0)) if tokens else []
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}

    def whole(self, jobs: list[Job]) -> dict:
        common = dict(id=self.ident, created=self.created, model=self.model_name, usage=_usage_of(jobs),
                      session_id=self.session_id)
        if self.kind == "chat":
            return ChatCompletion(choices=[
                ChatChoice(index=i, message=ReplyMessage(content=job.content), logprobs=self.logprobs(job.logprobs),
                           finish_reason=job.finish_reason) for i, job in enumerate(jobs)], **common).model_dump()
        return Completion(choices=[
            CompletionChoice(index=i, text=job.content, logprobs=self.logprobs(job.logprobs),
                             finish_reason=job.finish_reason) for i, job in enumerate(jobs)], **common).model_dump()


async def _stream(request: Request, reply: Reply, event: tuple, usage: bool):
    finished: dict[int, Job] = {}
    try:
        if reply.kind == "chat":
            for index in range(len(reply.pendings)):
                yield reply.chunk(index, None, None, role=True)
        while True:
            index, what, payload = event
            if what == "text":
                yield reply.chunk(index, payload[0], None, logprobs=payload[1])
            elif what == "done":
                finished[index] = payload
                yield reply.chunk(index, None, payload.finish_reason, logprobs=reply.pendings[index].new_logprobs())
                if len(finished) == len(reply.pendings):
                    if usage:
                        yield reply.chunk(0, None, None, usage=_usage_of(list(finished.values())))
                    yield "data: [DONE]\n\n"
                    return
            else:  # an error: its event, then the end of the stream, as for any other
                log_5xx(reply.pendings[0].request_id, payload)
                yield f"data: {json.dumps(payload.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            event = await _next_event(request, reply.pendings[0].events)
    except ClientGone:
        pass  # (or the server cancelled this generator when the client left): either way, one line below
    finally:
        unfinished = [p for p in reply.pendings if p.job is None or not p.job.done]
        for pending in unfinished:
            pending.cancelled = True  # the client went away (or the stream was closed): stop decoding
        if unfinished:
            log.info("client disconnected mid-stream from %s; its reply was cancelled", reply.ident)


def _route_generation(app: FastAPI, api: Api) -> None:
    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=_documented(ChatCompletion))
    async def chat_completions(body: ChatRequest, request: Request):
        return await api.serve(request, "chat", body)

    @app.post("/v1/completions", response_model=Completion, responses=_documented(Completion))
    async def completions(body: CompletionRequest, request: Request):
        return await api.serve(request, "completion", body)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=api.model_name, created=api.started)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorReply}})
    async def model(model_id: str) -> ModelCard:
        api.served(model_id)
        return ModelCard(id=api.model_name, created=api.started)


class InspectionCancelled(Exception):
    """Raised inside an inspection between two chunks: its client left, or the server is stopping."""


class Inspector:
    """The cache inspector's work: one inspection at a time, beside the engine (it runs the model over a whole text
    once per policy), with its own tokenizer (a fast tokenizer refuses concurrent calls). At most
    ``max_inspections`` are running or waiting (429 beyond); each is sized before it waits (by its text's length,
    then its tokens, counted off the event loop), and stops at its next chunk when its client leaves or the server
    stops."""

    def __init__(self, engine: Engine, limits: Limits, model_name: str):
        self.engine, self.limits, self.model_name = engine, limits, model_name
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="sparsegen-inspect")
        self.tokenizer = None  # copied at the first inspection
        self.taken = 0  # inspections running or waiting (changed on the event loop only)
        self.stops: set[threading.Event] = set()  # one per inspection taken
        self.closed = False

    async def inspect(self, body: InspectRequest, request: Request) -> JSONResponse:
        from sparsegen.eval.inspect import inspect

        limits = self.limits
        if self.closed:
            raise shutting_down()
        if body.max_new_tokens > limits.max_tokens:
            raise ApiError(400, f"max_new_tokens is over this server's limit of {limits.max_tokens}",
                           param="max_new_tokens")
        if self.taken >= limits.max_inspections:
            raise ApiError(429, f"{limits.max_inspections} inspections are already running or waiting "
                                "(--max-inspections); retry later", "rate_limit_error", "overloaded")
        stop = threading.Event()
        self.taken += 1
        self.stops.add(stop)
        try:
            try:
                await asyncio.to_thread(self.engine.tokenize, body.text + (body.question or ""), True, True)
            except ValueError as err:
                raise ApiError(400, f"{err} (--max-prompt-tokens)", param="text") from None

            if self.tokenizer is None:
                self.tokenizer = copy.deepcopy(self.engine.tokenizer)

            def interrupt() -> None:
                if stop.is_set():
                    raise InspectionCancelled

            run = partial(inspect, self.engine.model, self.tokenizer, body.text, body.policies, body.budget,
                          question=body.question, answer=body.answer, protocol=body.protocol,
                          kv_bits=body.kv_bits, chunk_size=self.engine.chunk_size,
                          max_new_tokens=body.max_new_tokens, model_name=self.model_name, after_chunk=interrupt)
            work = asyncio.get_running_loop().run_in_executor(self.pool, run)
            while True:
                done, _ = await asyncio.wait([work], timeout=0.25)
                if done:
                    break
                if self.closed or await request.is_disconnected():
                    stop.set()  # a running inspection stops at its next chunk; a waiting one never starts
                    work.cancel()
                    if self.closed:
                        raise shutting_down()
                    raise ClientGone
            try:
                return JSONResponse(work.result())
            except ValueError as err:
                raise ApiError(400, str(err)) from None
            except InspectionCancelled:
                raise shutting_down() from None
        finally:
            self.taken -= 1
            self.stops.discard(stop)

    def stop_all(self) -> None:
        """Stop every inspection (each at its next chunk) and take no more. Safe in a signal handler."""
        self.closed = True
        for stop in list(self.stops):
            stop.set()

    def close(self) -> None:
        self.stop_all()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _route_inspection(app: FastAPI, inspector: Inspector) -> None:
    @app.get("/inspect", response_class=HTMLResponse)
    async def inspect_page():
        """The cache inspector: a form that asks ``/v1/inspect`` (which takes the API key, if the server has one)."""
        from sparsegen.eval.inspect import page

        return HTMLResponse(page(api=True))

    @app.post("/v1/inspect")
    async def inspect_kept(body: InspectRequest, request: Request):
        return await inspector.inspect(body, request)


def _route_operations(app: FastAPI, worker: Worker, bound: int) -> None:
    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    async def health():
        """ok, or 503 once the engine thread is gone (the process then exits); after an engine rebuild, how many
        and the last error."""
        if not worker.is_alive():
            return JSONResponse({"status": "down", "error": worker.died}, status_code=503)
        if worker.draining:  # a load balancer sends no more here
            return JSONResponse({"status": "draining"}, status_code=503)
        body = {"status": "ok"}
        if worker.rebuilds:
            body.update(engine_rebuilds=worker.rebuilds, last_rebuild=worker.last_rebuild)
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics():
        with worker.lock:
            snapshot = dict(worker.snapshot)
        # the line as it is now (a request whose client left is gone from it at once, between two engine steps)
        snapshot.update(worker.line.counts(), kv_bytes_bound=bound, resident_bytes=current_rss() or 0,
                        compiles_total=COMPILES.count, compile_seconds_total=round(COMPILES.seconds, 3))
        lines = []
        for name, value in snapshot.items():
            metric = f"sparsegen_{name}"
            lines.append(f"# TYPE {metric} {'counter' if name.endswith('_total') else 'gauge'}")
            lines.append(f"{metric} {value}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def make_server(app: FastAPI, host: str, port: int, log_level: str = "warning", shutdown_grace: float = 30.0):
    """A uvicorn server of ``app`` on this server's HTTP protocol (``sparsegen.serve.protocol``) that drains on
    SIGTERM or Ctrl-C: no new connection or request is taken (queued ones get 503), the replies in flight have
    ``shutdown_grace`` seconds to finish, then each ends with a 503 (a stream: an error event and ``[DONE]``), and
    ``run`` returns (no re-raised signal: the process exits 0). A second Ctrl-C stops at once."""
    import uvicorn

    from sparsegen.serve.protocol import protocol

    if isinstance(shutdown_grace, bool) or not isinstance(shutdown_grace, (int, float)) or not 0 <= shutdown_grace \
            < float("inf"):
        raise ValueError(f"the shutdown grace is a number of seconds >= 0, got {shutdown_grace!r}")
    drain = app.state.drain

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                drain(shutdown_grace)
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):  # uvicorn re-raises the signal after a shutdown; a drained one exits 0
                captured.clear()

    # uvicorn's own wait for open connections outlasts the drain, which answers every request by its end
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol(
        app.state.limits.header_timeout), timeout_graceful_shutdown=shutdown_grace + 5)
    server = Server(config)
    app.state.worker.on_death = lambda: setattr(server, "should_exit", True)
    return server


def run_server(app: FastAPI, host: str, port: int, log_level: str = "warning", shutdown_grace: float = 30.0) -> int:
    """Serve ``app`` until stopped (``make_server``); the exit status: 0, or 3 when the engine thread died (so that
    a supervisor, systemd or Kubernetes, restarts the server instead of leaving it hanging)."""
    server = make_server(app, host, port, log_level, shutdown_grace)
    worker: Worker = app.state.worker
    if not log.handlers:  # the server's own lines (disconnects, rebuilds) beside uvicorn's, at its level
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.setLevel(log_level.upper())
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: a clean stop
        pass
    if worker.died is not None:
        print(f"sparsegen serve: the engine thread died ({worker.died}); exiting with status 3", file=sys.stderr)
        return 3
    return 0
