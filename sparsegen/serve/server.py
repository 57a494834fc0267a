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
import hashlib
import hmac
import itertools
import json
import logging
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from sparsegen.engine.scheduler import Engine
from sparsegen.engine.session import Job, Sampling, TokenLogprob
from sparsegen.engine.step import COMPILES
from sparsegen.memory import current_rss
from sparsegen.serve.inspector import Inspector, route_inspection
from sparsegen.serve.schemas import (
    REFUSED,
    SESSION_ID,
    SESSION_ID_RULE,
    ApiError,
    ChatChoice,
    ChatCompletion,
    ChatRequest,
    ClientGone,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ErrorReply,
    GenerationRequest,
    Limits,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ReplyMessage,
    Usage,
    documented,
    log_5xx,
    refused_field,
)
from sparsegen.serve.worker import Pending, Worker, kv_bound, texts_of

log = logging.getLogger("sparsegen.serve")
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
            match = [ns for key, ns in self.keys.items() if hmac.compare_digest(given.encode(), f"Bearer "
                                                                                                f"{key}".encode())]
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
    if not engine.policy.bounded and engine.memory is None:
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
    route_inspection(app, inspector)
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

    def check(self, parsed: GenerationRequest, request: Request) -> tuple[str | None, Sampling]:
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

    def sampling(self, parsed: GenerationRequest, max_tokens: int) -> Sampling:
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

    async def serve(self, request: Request, kind: str, parsed: GenerationRequest):
        session_id, sampling = self.check(parsed, request)
        session = self.engine.sessions.get(session_id) if session_id else None
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        pendings: list[Pending] = []
        try:
            for index, text in enumerate(texts_of(parsed)):
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
    cached = sum(job.cached_tokens for job in jobs)
    prompt, completion = sum(job.prompt_tokens for job in jobs) + cached, sum(len(job.tokens) for job in jobs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


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
    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=documented(ChatCompletion))
    async def chat_completions(body: ChatRequest, request: Request):
        return await api.serve(request, "chat", body)

    @app.post("/v1/completions", response_model=Completion, responses=documented(Completion))
    async def completions(body: CompletionRequest, request: Request):
        return await api.serve(request, "completion", body)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=api.model_name, created=api.started)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorReply}})
    async def model(model_id: str) -> ModelCard:
        api.served(model_id)
        return ModelCard(id=api.model_name, created=api.started)


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

    def measured() -> dict:
        with worker.lock:
            snapshot = dict(worker.snapshot)
        # the line as it is now (a request whose client left is gone from it at once, between two engine steps)
        snapshot.update(worker.line.counts(), kv_bytes_bound=bound, resident_bytes=current_rss() or 0,
                        compiles_total=COMPILES.count, compile_seconds_total=round(COMPILES.seconds, 3))
        return snapshot

    # what /metrics shows: this process's numbers (a Ray Serve replica sets it to every replica's and their sum)
    app.state.measured, app.state.show_metrics = measured, lambda: prometheus({"": measured()})

    @app.get("/metrics")
    async def metrics():
        # (off the event loop: under Ray Serve it waits on the other replicas' numbers)
        text = await asyncio.to_thread(app.state.show_metrics)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def prometheus(series: dict[str, dict]) -> str:
    """Prometheus text of ``{label: {name: value}}``: each name once, one line per label (``""``: unlabelled; else
    ``replica="label"``)."""
    names = list(dict.fromkeys(name for values in series.values() for name in values))
    lines = []
    for name in names:
        metric = f"sparsegen_{name}"
        lines.append(f"# TYPE {metric} {'counter' if name.endswith('_total') else 'gauge'}")
        for label, values in series.items():
            if name in values:
                lines.append(f'{metric}{{replica="{label}"}} {values[name]}' if label else f"{metric} {values[name]}")
    return "\n".join(lines) + "\n"


def make_server(app: FastAPI, host: str, port: int, log_level: str = "warning", shutdown_grace: float = 30.0):
    """A uvicorn server of ``app`` on this server's HTTP protocol (``sparsegen.serve.protocol``) that drains on
    SIGTERM or Ctrl-C: no new request starts (it and the queued ones get 503, ``/health`` says ``draining``), the
    replies in flight have ``shutdown_grace`` seconds to finish, then each ends with a 503 (a stream: an error event
    and ``[DONE]``). Only when none is left does the server stop listening, and ``run`` returns (no re-raised signal:
    the process exits 0). A second Ctrl-C stops at once."""
    import uvicorn

    from sparsegen.serve.protocol import protocol

    if isinstance(shutdown_grace, bool) or not isinstance(shutdown_grace, (int, float)) or not 0 <= shutdown_grace \
            < float("inf"):
        raise ValueError(f"the shutdown grace is a number of seconds >= 0, got {shutdown_grace!r}")
    drain = app.state.drain

    worker: Worker = app.state.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # (uvicorn's own would re-raise the signal after its stop)
            if not (worker.draining or self.should_exit):
                # uvicorn's stop closes the listener and the idle connections: it waits until every reply is answered
                worker.on_drained = lambda: setattr(self, "should_exit", True)
                drain(shutdown_grace)
            elif sig == signal.SIGINT:  # a second Ctrl-C
                self.should_exit = self.force_exit = True

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
