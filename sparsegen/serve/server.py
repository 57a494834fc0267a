"""``sparsegen serve``: an OpenAI-compatible HTTP server whose conversations live in bounded, compressed KV caches.

One worker thread owns the model and an ``Engine``. Requests queue to it (bounded: a full queue answers 429); it
admits them between decode steps, encodes each one's new text, and runs one batched decode step for every reply
in progress, pushing text to the waiting handlers. A request with a session id (``session_id`` in the body or an
``X-Session-Id`` header) keeps its cache for the next turn, which then encodes only the new message; without one
a request is stateless. A client that disconnects cancels its reply at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import queue
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sparsegen.bench.memory import current_rss
from sparsegen.serve.engine import Engine, Job, Sampling


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 64
    max_batch: int = 16  # replies decoded together
    max_queue: int = 64  # requests waiting beyond that: 429
    max_tokens: int = 1024  # per reply
    max_messages: int = 256
    max_request_bytes: int = 1 << 20
    api_key: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None
    session_id: str | None = Field(default=None, min_length=1, max_length=128)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Request):
    prompt: str = Field(min_length=1)


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
    session_id: str | None
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
                except Exception as err:  # noqa: BLE001  one failing step fails its replies, not the server
                    self._fail_active(err)
                self._retire()
            self._publish()
        for pending in self.active:
            pending.send(("error", ApiError(503, "the server shut down before the reply finished", "server_error")))

    def _retire(self) -> None:
        for pending in self.active:
            if pending.job.done and not pending.cancelled:
                pending.send(("done", pending.job))
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
            raise ApiError(409, f"session {pending.session_id!r} is already answering another request", code="busy")
        try:
            session = engine.session(pending.session_id)
        except RuntimeError as err:
            raise ApiError(503, str(err), "server_error", "overloaded") from None
        sampling = Sampling(max_tokens=request.max_completion_tokens or request.max_tokens or 128,
                            temperature=request.temperature, top_p=request.top_p, seed=request.seed or 0,
                            stop=tuple(request.stop or ()))
        on_text = lambda job, text: pending.send(("text", text))  # noqa: E731
        try:
            if pending.kind == "chat":
                messages = [m.model_dump(exclude={"name"}) for m in request.messages]
                pending.job = engine.begin(session, sampling, messages=messages, on_text=on_text)
            else:
                pending.job = engine.begin(session, sampling, prompt=request.prompt, on_text=on_text)
        except ValueError as err:
            session.busy = False
            raise ApiError(400, str(err)) from None
        except Exception:
            engine.reset(session)
            session.busy = False
            raise
        return pending

    def _fail_active(self, err: Exception) -> None:
        self.errors += 1
        self.engine.discard_batch()  # the stacked rows may be half-updated: those sessions start over
        for pending in self.active:
            self.engine.reset(pending.job.session)
            pending.job.session.busy = False
            pending.job.finish_reason = "error"
            pending.send(("error", ApiError(500, f"decoding failed: {err}", "server_error")))
        self.active = []

    def _publish(self) -> None:
        engine = self.engine
        snapshot = {**{f"{k}_total": v for k, v in engine.counters.items()}, "errors_total": self.errors,
                    "sessions": len(engine.sessions), "active_replies": len(self.active),
                    "queued_requests": self.inbox.qsize(), "kv_bytes": engine.kv_bytes()}
        with self.lock:
            self.snapshot = snapshot


def kv_bound(engine: Engine, limits: Limits) -> int:
    """Worst-case K/V bytes: every stored session and every in-flight reply at its full allocation, plus the
    stacked copy of a full decode batch."""
    from sparsegen.models.spec import kv_bytes_per_token

    element = next(engine.model.parameters()).element_size()
    per_token = kv_bytes_per_token(engine.model.config, element)
    budget = engine.make_policy().budget
    per_session = (budget + engine.chunk_size) * per_token
    return (limits.max_sessions + limits.max_batch) * per_session + limits.max_batch * (budget + 1) * per_token


def build_app(engine: Engine, limits: Limits, model_name: str) -> FastAPI:
    if engine.make_policy().budget is None:
        raise ValueError("serve keeps every conversation's cache, and policy 'full' grows without bound; use window, "
                         "streaming, h2o or streaming-h2o with a --budget")
    worker = Worker(engine, limits)
    bound = kv_bound(engine, limits)
    started = time.time()

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stopping.set()
        await asyncio.to_thread(worker.join, 30)

    app = FastAPI(title="sparsegen", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.worker, app.state.kv_bound = worker, bound

    def error(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        return error(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err: RequestValidationError):
        first = err.errors()[0]
        return error(ApiError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}"))

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if request.url.path != "/health" and limits.api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {limits.api_key}".encode()):
                return error(ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                      "authentication_error", "invalid_api_key"))
        length = request.headers.get("content-length", "0")
        if not length.isdigit() or int(length) > limits.max_request_bytes:
            return error(ApiError(413, f"the request is larger than {limits.max_request_bytes} bytes", code="too_large"))
        try:
            return await call_next(request)
        except Exception as err:  # noqa: BLE001  never take the server down
            worker.errors += 1
            return error(ApiError(500, f"internal error: {err}", "server_error"))

    async def parse(request: Request, schema):
        body = await request.body()
        if len(body) > limits.max_request_bytes:
            raise ApiError(413, f"the request is larger than {limits.max_request_bytes} bytes", code="too_large")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the body is not valid JSON") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        try:
            parsed = schema.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            raise ApiError(400, f"{'.'.join(map(str, first['loc'])) or 'body'}: {first['msg']}",
                           param=".".join(map(str, first["loc"]))) from None
        wanted = parsed.max_completion_tokens or parsed.max_tokens or 0
        if wanted > limits.max_tokens:
            raise ApiError(400, f"max_tokens {wanted} is over this server's limit of {limits.max_tokens}",
                           param="max_tokens")
        if getattr(parsed, "messages", None) is not None and len(parsed.messages) > limits.max_messages:
            raise ApiError(400, f"{len(parsed.messages)} messages is over this server's limit of {limits.max_messages}",
                           param="messages")
        return parsed

    async def serve(request: Request, kind: str, schema):
        parsed = await parse(request, schema)
        session_id = parsed.session_id or request.headers.get("x-session-id")
        pending = Pending(kind, parsed, session_id, asyncio.get_running_loop())
        worker.submit(pending)
        ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if parsed.stream:
            first = await next_event(request, pending)  # errors found on admission keep their HTTP status
            if first[0] == "error":
                raise first[1]
            return StreamingResponse(stream(request, pending, kind, ident, created, first),
                                     media_type="text/event-stream", headers={"X-Session-Id": session_id or ""})
        job = await wait(request, pending)
        usage = {"prompt_tokens": job.prompt_tokens, "completion_tokens": len(job.tokens),
                 "total_tokens": job.prompt_tokens + len(job.tokens)}
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": job.content},
                      "finish_reason": job.finish_reason}
        else:
            choice = {"index": 0, "text": job.content, "logprobs": None, "finish_reason": job.finish_reason}
        return JSONResponse({"id": ident, "object": "chat.completion" if kind == "chat" else "text_completion",
                             "created": created, "model": model_name, "choices": [choice], "usage": usage,
                             "session_id": session_id})

    async def next_event(request: Request, pending: Pending):
        while True:
            try:
                return await asyncio.wait_for(pending.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    pending.cancelled = True
                    raise asyncio.CancelledError from None

    async def wait(request: Request, pending: Pending) -> Job:
        while True:
            event = await next_event(request, pending)
            if event[0] == "error":
                raise event[1]
            if event[0] == "done":
                return event[1]

    def chunk(kind: str, ident: str, created: int, text: str | None, finish: str | None, role: bool = False) -> str:
        if kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [choice]}
        else:
            body = {"id": ident, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n"

    async def stream(request: Request, pending: Pending, kind: str, ident: str, created: int, event: tuple):
        try:
            if kind == "chat":
                yield chunk(kind, ident, created, None, None, role=True)
            while True:
                if event[0] == "text":
                    yield chunk(kind, ident, created, event[1], None)
                elif event[0] == "done":
                    yield chunk(kind, ident, created, None, event[1].finish_reason)
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield f"data: {json.dumps(event[1].body())}\n\n"
                    return
                event = await next_event(request, pending)
        finally:
            if pending.job is None or not pending.job.done:
                pending.cancelled = True  # the client went away (or the stream was closed): stop decoding

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, "chat", ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, "completion", CompletionRequest)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(started),
                                            "owned_by": "sparsegen"}]}

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
