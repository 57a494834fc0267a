"""``sparsegen serve``: an OpenAI-compatible HTTP server whose conversations live in bounded, compressed KV caches.

One worker thread owns the model and an ``Engine``. Requests queue to it (bounded: a full queue answers 429); it
admits them between steps, and each step encodes one chunk of one new prompt and runs one batched decode step for
every reply in progress, pushing text to the waiting handlers — so a long prompt delays the others by at most a
chunk per token. A request with a session id (``session_id`` in the body or an ``X-Session-Id`` header) keeps its
cache for the next turn, which then encodes only the new message; without one a request is stateless. Sessions
belong to the API key that made them. A client that disconnects cancels its reply at the next step.

Every request is checked before it costs anything: API key, JSON content type, body size (counted as it arrives,
chunked uploads included), then the typed schema, the server's limits, and text the tokenizer could not take.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import queue
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException

from sparsegen.bench.memory import current_rss
from sparsegen.serve.engine import Engine, Job, Prepared, Sampling

SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
SESSION_ID_RULE = "1-128 characters from A-Z a-z 0-9 . _ : @ -"


@dataclass(frozen=True)
class Limits:
    """What one server accepts. Every count must be at least 1."""

    max_sessions: int = 64
    max_batch: int = 16  # replies decoded together
    max_queue: int = 64  # requests waiting beyond that: 429
    max_tokens: int = 1024  # per reply
    max_prompt_tokens: int = 8192  # new tokens one request may ask the server to encode
    max_messages: int = 256
    max_stops: int = 4
    max_stop_chars: int = 256
    max_request_bytes: int = 1 << 20
    api_keys: tuple[str, ...] = ()  # none: no authentication

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "api_keys" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
        if any(not isinstance(key, str) or not key.strip() or not key.isprintable() for key in self.api_keys):
            raise ValueError("API keys must be non-empty printable strings")


def _no_surrogates(value):
    """Text the tokenizer can take: JSON may carry lone UTF-16 surrogates ("\\ud800") that no UTF-8 text has."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"a string holds a lone surrogate at character {err.start}; send valid Unicode") from None
    elif isinstance(value, dict):
        for item in value.values():
            _no_surrogates(item)
    elif isinstance(value, list):
        for item in value:
            _no_surrogates(item)
    return value


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints take; unset sampling fields take the server's defaults."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None
    session_id: str | None = Field(default=None, pattern=f"^{SESSION_ID.pattern}$")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        return _no_surrogates(data)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Request):
    prompt: str = Field(min_length=1)


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
    finish_reason: Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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


@dataclass
class Pending:
    """A request on its way through the worker: what it asks, and the channel its text comes back on."""

    kind: str  # "chat" or "completion"
    request: _Request
    session_id: str | None  # namespaced by API key
    sampling: Sampling
    prepared: Prepared
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    job: Job | None = None
    cancelled: bool = False

    def send(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Worker(threading.Thread):
    def __init__(self, engine: Engine, limits: Limits):
        super().__init__(name="sparsegen-engine", daemon=True)
        self.engine, self.limits = engine, limits
        self.inbox: queue.Queue[Pending] = queue.Queue(maxsize=limits.max_queue)
        self.active: list[Pending] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.errors = 0
        self.snapshot: dict = {}
        self._publish()

    def submit(self, pending: Pending) -> None:
        if self.stopping.is_set():
            raise ApiError(503, "the server is shutting down", "server_error")
        try:
            self.inbox.put_nowait(pending)
        except queue.Full:
            raise ApiError(429, f"{self.limits.max_queue} requests are already waiting; retry later",
                           "rate_limit_error", "overloaded") from None

    def run(self) -> None:
        while not self.stopping.is_set():
            self._admit()
            for pending in self.active:
                if pending.cancelled and not pending.job.done:
                    self.engine.cancel(pending.job)
            self._retire()
            if self.active:
                try:
                    self.engine.step([p.job for p in self.active])
                except Exception as err:  # noqa: BLE001  an engine bug fails the replies in flight, not the server
                    self._fail_active(err)
                self._retire()
            self._publish()
        for pending in self.active:
            pending.send(("error", ApiError(503, "the server shut down before the reply finished", "server_error")))

    def _retire(self) -> None:
        for pending in self.active:
            job = pending.job
            if job.done and not pending.cancelled:
                if job.finish_reason == "error":
                    self.errors += 1
                    pending.send(("error", ApiError(500, f"the reply failed: {job.error}", "server_error")))
                else:
                    pending.send(("done", job))
        self.active = [p for p in self.active if not p.job.done]

    def _admit(self) -> None:
        while len(self.active) < self.limits.max_batch:
            try:
                pending = self.inbox.get(timeout=0.05) if not self.active else self.inbox.get_nowait()
            except queue.Empty:
                return
            if pending.cancelled:
                continue
            try:
                self.active.append(self._begin(pending))
            except ApiError as err:
                pending.send(("error", err))
            except Exception as err:  # noqa: BLE001
                self.errors += 1
                pending.send(("error", ApiError(500, f"the request failed: {err}", "server_error")))

    def _begin(self, pending: Pending) -> Pending:
        engine, request = self.engine, pending.request
        session = engine.sessions.get(pending.session_id) if pending.session_id else None
        if session is not None and session.busy:
            raise ApiError(409, "this session is already answering another request", code="busy")
        try:
            session = engine.session(pending.session_id)
        except RuntimeError as err:
            raise ApiError(503, str(err), "server_error", "overloaded") from None
        # a streamed reply's text goes out as it comes; an unstreamed one's handler waits quietly for the end (and
        # notices a disconnected client meanwhile)
        on_text = (lambda job, text: pending.send(("text", text))) if request.stream else None  # noqa: E731
        try:
            pending.job = engine.begin(session, pending.sampling, on_text=on_text, prepared=pending.prepared,
                                       **_text_of(request))
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        return pending

    def _fail_active(self, err: Exception) -> None:
        """An engine bug: the replies in flight fail (their sessions start over), the server goes on."""
        self.engine.discard_batch()  # the stacked rows may be half-updated
        for pending in self.active:
            self.engine.fail(pending.job, err)
        self._retire()

    def _publish(self) -> None:
        engine = self.engine
        snapshot = {**{f"{k}_total": v for k, v in engine.counters.items()}, "errors_total": self.errors,
                    "sessions": len(engine.sessions), "active_replies": len(self.active),
                    "queued_requests": self.inbox.qsize(), "kv_bytes": engine.kv_bytes()}
        with self.lock:
            self.snapshot = snapshot


def _text_of(request: _Request) -> dict:
    """``messages=`` or ``prompt=``, as the engine takes them."""
    if isinstance(request, ChatRequest):
        return {"messages": [m.model_dump(exclude={"name"}) for m in request.messages]}
    return {"prompt": request.prompt}


def kv_bound(engine: Engine, limits: Limits) -> int:
    """Worst-case K/V bytes: every stored session and every in-flight reply at its full allocation, plus the
    stacked copy of a full decode batch."""
    from sparsegen.models.spec import kv_bytes_per_sequence, kv_bytes_per_token

    element = next(engine.model.parameters()).element_size()
    per_token = kv_bytes_per_token(engine.model.config, element, engine.quantization)
    per_row = kv_bytes_per_sequence(engine.model.config, element, engine.quantization)
    budget = engine.make_policy().budget
    per_session = (budget + engine.chunk_size) * per_token + per_row
    return (limits.max_sessions + limits.max_batch) * per_session + limits.max_batch * ((budget + 1) * per_token
                                                                                         + per_row)


class Guard:
    """ASGI middleware that checks a request before the app reads it: the API key (which also names the request's
    session namespace, in ``scope["state"]``), a JSON content type on POST, and the body size — counted as the body
    arrives, so a chunked upload is cut off at the limit instead of being read whole first."""

    def __init__(self, app, limits: Limits):
        self.app, self.limit = app, limits.max_request_bytes
        # a session belongs to the key that made it: its namespace is a digest of the key, never the key itself
        self.keys = {key: hashlib.sha256(key.encode()).hexdigest()[:16] for key in limits.api_keys}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        namespace = ""
        if self.keys and scope["path"] != "/health":
            given = headers.get("authorization", "")
            match = [ns for key, ns in self.keys.items() if hmac.compare_digest(given.encode(), f"Bearer {key}".encode())]
            if not match:
                return await _reply(send, ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                                   "authentication_error", "invalid_api_key"))
            namespace = match[0]
        scope.setdefault("state", {})["namespace"] = namespace
        if scope["method"] == "POST":
            content_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if content_type != "application/json":
                return await _reply(send, ApiError(415, f"the body must be JSON sent as Content-Type: application/json, "
                                                        f"not {content_type or 'none'!r}", code="unsupported_media_type"))
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _reply(send, self._too_large())
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, counted, send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request is larger than {self.limit} bytes", code="too_large")


async def _reply(send, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}


def build_app(engine: Engine, limits: Limits, model_name: str, defaults: Sampling | None = None) -> FastAPI:
    """The app serving ``engine`` as ``model_name``; ``defaults``: sampling for fields a request leaves out."""
    if engine.make_policy().budget is None:
        raise ValueError("serve keeps every conversation's cache, and policy 'full' grows without bound; use window, "
                         "streaming, h2o or streaming-h2o with a --budget")
    defaults = defaults or Sampling(max_tokens=min(Sampling.max_tokens, limits.max_tokens))
    if defaults.max_tokens > limits.max_tokens:
        raise ValueError(f"the default max_tokens ({defaults.max_tokens}) is over the limit ({limits.max_tokens})")
    engine.max_prompt_tokens = limits.max_prompt_tokens
    worker = Worker(engine, limits)
    bound = kv_bound(engine, limits)
    started = time.time()

    # requests are rendered and tokenized here, one at a time, beside the worker: in one thread, so the memory a
    # long text briefly takes is reused rather than kept by one allocator arena per thread
    preparer = ThreadPoolExecutor(1, thread_name_prefix="sparsegen-prepare")

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stopping.set()
        preparer.shutdown(cancel_futures=True)
        await asyncio.to_thread(worker.join, 30)

    app = FastAPI(title="sparsegen", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(Guard, limits=limits)
    app.state.worker, app.state.kv_bound = worker, bound

    def error(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        return error(err)

    @app.exception_handler(HTTPException)
    async def _http_error(request, err: HTTPException):
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return error(ApiError(err.status_code, str(err.detail), kind, HTTP_CODES.get(err.status_code)))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err: RequestValidationError):
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
        if first["type"] == "json_invalid":
            message = "the body is not valid JSON"
        elif where == "body":
            message = f"the body must be a JSON object with the request's fields ({first['msg']})"
        else:
            message = f"{where}: {first['msg']}"
        return error(ApiError(400, message, param=None if where == "body" else where))

    @app.exception_handler(Exception)
    async def _internal(request, err: Exception):  # never a bare 500 page
        worker.errors += 1
        return error(ApiError(500, f"internal error: {type(err).__name__}", "server_error"))

    def check(parsed: _Request, request: Request) -> tuple[str | None, Sampling]:
        """The server's own limits on a well-formed request; its session id (namespaced) and sampling."""
        if parsed.model is not None and parsed.model != model_name:
            raise ApiError(404, f"the model {parsed.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
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
        sampling = Sampling(
            max_tokens=wanted,
            temperature=defaults.temperature if parsed.temperature is None else parsed.temperature,
            top_p=defaults.top_p if parsed.top_p is None else parsed.top_p,
            seed=defaults.seed if parsed.seed is None else parsed.seed, stop=tuple(parsed.stop))
        namespace = request.scope.get("state", {}).get("namespace", "")
        return (None if session_id is None else f"{namespace}/{session_id}"), sampling

    async def serve(request: Request, kind: str, parsed: _Request):
        session_id, sampling = check(parsed, request)
        session = engine.sessions.get(session_id) if session_id else None
        try:  # tokenized beside the worker: a long text costs its sender, not the replies decoding
            prepared = await asyncio.get_running_loop().run_in_executor(
                preparer, partial(engine.prepare, session, elsewhere=True, **_text_of(parsed)))
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        pending = Pending(kind, parsed, session_id, sampling, prepared, asyncio.get_running_loop())
        worker.submit(pending)
        ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        shown_id = session_id.split("/", 1)[1] if session_id else None
        if parsed.stream:
            first = await next_event(request, pending)  # errors found on admission keep their HTTP status
            if first[0] == "error":
                raise first[1]
            usage = parsed.stream_options is not None and parsed.stream_options.include_usage
            return StreamingResponse(stream(request, pending, kind, ident, created, first, usage),
                                     media_type="text/event-stream", headers={"X-Session-Id": shown_id or ""})
        job = await wait(request, pending)
        common = dict(id=ident, created=created, model=model_name, usage=usage_of(job), session_id=shown_id)
        if kind == "chat":
            reply = ChatCompletion(choices=[ChatChoice(message=ReplyMessage(content=job.content),
                                                       finish_reason=job.finish_reason)], **common)
        else:
            reply = Completion(choices=[CompletionChoice(text=job.content, finish_reason=job.finish_reason)],
                               **common)
        return JSONResponse(reply.model_dump())

    def usage_of(job: Job) -> Usage:
        return Usage(prompt_tokens=job.prompt_tokens, completion_tokens=len(job.tokens),
                     total_tokens=job.prompt_tokens + len(job.tokens))

    async def next_event(request: Request, pending: Pending):
        while True:
            try:
                return await asyncio.wait_for(pending.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    pending.cancelled = True
                    raise asyncio.CancelledError from None

    async def wait(request: Request, pending: Pending) -> Job:
        try:
            while True:
                event = await next_event(request, pending)
                if event[0] == "error":
                    raise event[1]
                if event[0] == "done":
                    return event[1]
        finally:
            if pending.job is None or not pending.job.done:
                pending.cancelled = True  # the handler was cancelled (the client went away): stop decoding

    def chunk(kind: str, ident: str, created: int, text: str | None, finish: str | None, role: bool = False,
              usage: dict | None = None) -> str:
        if usage is not None:
            choices = []
        elif kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
        body = {"id": ident, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": created, "model": model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage.model_dump()
        return f"data: {json.dumps(body)}\n\n"

    async def stream(request: Request, pending: Pending, kind: str, ident: str, created: int, event: tuple,
                     usage: bool):
        try:
            if kind == "chat":
                yield chunk(kind, ident, created, None, None, role=True)
            while True:
                if event[0] == "text":
                    yield chunk(kind, ident, created, event[1], None)
                elif event[0] == "done":
                    yield chunk(kind, ident, created, None, event[1].finish_reason)
                    if usage:
                        yield chunk(kind, ident, created, None, None, usage=usage_of(event[1]))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield f"data: {json.dumps(event[1].body())}\n\n"
                    return
                event = await next_event(request, pending)
        finally:
            if pending.job is None or not pending.job.done:
                pending.cancelled = True  # the client went away (or the stream was closed): stop decoding

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=_documented(ChatCompletion))
    async def chat_completions(body: ChatRequest, request: Request):
        return await serve(request, "chat", body)

    @app.post("/v1/completions", response_model=Completion, responses=_documented(Completion))
    async def completions(body: CompletionRequest, request: Request):
        return await serve(request, "completion", body)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=int(started))])

    @app.get("/health")
    async def health():
        alive = worker.is_alive()
        return JSONResponse({"status": "ok" if alive else "down"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        with worker.lock:
            snapshot = dict(worker.snapshot)
        snapshot.update(kv_bytes_bound=bound, resident_bytes=current_rss() or 0)
        lines = []
        for name, value in snapshot.items():
            metric = f"sparsegen_{name}"
            lines.append(f"# TYPE {metric} {'counter' if name.endswith('_total') else 'gauge'}")
            lines.append(f"{metric} {value}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app
