"""The server under hostile and careless clients (the second round): bodies nested to the parser's limit, tiny
budgets on /v1/inspect, failures while a request begins under --kv-memory, clients that leave while queued, more new
sessions than the server keeps, abandoned inspections, loose types, malformed or slow HTTP, a graceful stop."""

import asyncio
import json
import logging
import signal
import socket
import time

import httpx
import pytest

from sparsegen.serve.schemas import Limits
from tests.kv.families import named_policies
from tests.serve.test_server import Running, reference  # noqa: F401  (the fixture)
from tests.serve.test_server_chaos import _settle

TEXT = "It was late in the evening when the old man came back to the house, and the dog barked twice at the gate. "


@pytest.fixture(scope="module")
def server(reference):
    running = Running(*reference, Limits(max_sessions=4, max_batch=8, max_queue=16, max_tokens=64,
                                         header_timeout=0.5, body_timeout=0.5))
    yield running
    running.stop()


@pytest.fixture
def server_log():
    """The server's own log lines and uvicorn's ("Exception in ASGI application" tracebacks go there)."""
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loggers = [logging.getLogger("uvicorn.error"), logging.getLogger("sparsegen.serve")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    yield records
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)


async def _until(condition, seconds: float = 30) -> None:
    """Wait (letting the test's other clients run) until ``condition()``; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the server never reached the state the test waits for"
        await asyncio.sleep(0.02)


def _openai_error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _nested(depth: int, leaf: str = "[]") -> str:
    return "[" * depth + leaf + "]" * depth


@pytest.mark.parametrize("where", ["metadata", "unknown", "content", "top"])
def test_bodies_nested_to_the_parsers_limit_get_400(server, where):
    """Nested 959-962 deep, the surrogate check's recursion raised RecursionError: a 500 with a traceback."""
    messages = '[{"role": "user", "content": "hi"}]'
    for depth in [*range(900, 1001, 20), 959, 960, 961, 962]:
        body = {"metadata": f'{{"messages": {messages}, "metadata": {_nested(depth)}}}',
                "unknown": f'{{"messages": {messages}, "x": {_nested(depth)}}}',
                "content": f'{{"messages": [{{"role": "user", "content": {_nested(depth)}}}]}}',
                "top": _nested(depth)}[where]
        reply = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                           headers={"content-type": "application/json"}, timeout=30)
        _openai_error(reply, 400)
    ok = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "metadata": {"a": "b"}})
    assert ok.status_code == 200


@pytest.mark.parametrize("body", [{"max_tokens": "10"}, {"stream": "yes"}, {"logprobs": "yes"}, {"max_tokens": True},
                                  {"seed": 1.5}, {"temperature": "0.5"}, {"top_logprobs": "2", "logprobs": True}])
def test_loose_types_are_refused_not_coerced(server, body):
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert _openai_error(reply, 400)["param"] == next(iter(body))


@pytest.mark.heavy
def test_every_policy_at_budgets_1_to_4_inspects_and_generates_or_names_the_fix(reference):
    """snapkv, pyramid-snapkv and snapkv-layers at budgets under 4 had an observation window of 0 queries, which
    observed every query: a size mismatch (500 on /v1/inspect)."""
    from sparsegen.engine.generate import generate
    from sparsegen.eval.inspect import inspect

    model, tokenizer = reference
    for name in named_policies():
        for budget in (1, 2, 3, 4):
            for protocol in ("stream", "context"):
                try:
                    result = inspect(model, tokenizer, TEXT * 2, [name], budget, question=" Who barked?",
                                     protocol=protocol, chunk_size=16, max_new_tokens=2)
                    held = result["policies"][name]["kv_tokens"]
                    assert name == "full" or held <= budget * (2 if named_policies()[name].shares_slots else 1) + 16
                except ValueError as err:  # a budget the policy cannot take: said so, with the fix
                    assert "raise the budget" in str(err), (name, budget, err)
            try:
                reply = generate(model, tokenizer, TEXT * 2, policy=name, budget=None if name == "full" else budget,
                                 max_new_tokens=3, chunk_size=16)
                assert reply.new_tokens[0] > 0
            except ValueError as err:
                assert "raise the budget" in str(err), (name, budget, err)


def test_inspect_at_budget_1_over_http(server):
    for policy in ("snapkv", "pyramid-snapkv", "snapkv-layers", "lagkv"):
        for protocol, question in (("stream", None), ("context", " Who barked?")):
            reply = httpx.post(f"{server.url}/v1/inspect", timeout=60, json={
                "text": TEXT, "policies": policy, "budget": 1, "protocol": protocol, "question": question})
            if reply.status_code != 200:
                assert "raise the budget" in _openai_error(reply, 400)["message"]


def test_a_begin_that_fails_under_kv_memory_gives_its_memory_back(reference, monkeypatch, server_log):
    """A non-ValueError in ``begin`` kept its reservation for ever: every later request waited."""
    running = Running(*reference, Limits(max_sessions=4, max_batch=4, max_tokens=64), policy="streaming",
                      kv_memory=300_000)
    try:
        engine = running.engine
        assert engine.memory.most_live == 1
        original = engine._start_from_context

        def broken(session, context):
            monkeypatch.setattr(engine, "_start_from_context", original)
            raise KeyError("length")

        monkeypatch.setattr(engine, "_start_from_context", broken)
        for session in (None, "s1"):
            monkeypatch.setattr(engine, "_start_from_context", broken)
            failed = httpx.post(f"{running.url}/v1/completions", timeout=30,
                                json={"prompt": "Once", "max_tokens": 2, "session_id": session})
            assert "KeyError" in _openai_error(failed, 500)["message"]
            request_id = failed.headers["x-request-id"]
            assert [r.getMessage() for r in server_log if request_id in r.getMessage()] == [
                f"request {request_id}: 500 {failed.json()['error']['message']}"]  # one line, where it is answered
            ok = httpx.post(f"{running.url}/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=10)
            assert ok.status_code == 200
        assert _settle(running)["sparsegen_kv_bytes_reserved"] == 0
    finally:
        running.stop()


@pytest.mark.heavy
def test_queued_clients_that_time_out_free_their_places_at_once(reference):
    running = Running(*reference, Limits(max_sessions=8, max_batch=2, max_queue=4, max_tokens=2000))
    try:
        async def load():
            async with httpx.AsyncClient(timeout=60) as client:
                busy = [asyncio.create_task(client.post(f"{running.url}/v1/completions",
                                                        json={"prompt": "Once", "max_tokens": 400, "ignore_eos": True}))
                        for _ in range(2)]
                await _until(lambda: running.metrics()["sparsegen_active_replies"] == 2)

                async def give_up():
                    try:
                        await client.post(f"{running.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                                          timeout=0.5)
                    except httpx.TimeoutException:
                        return "timeout"

                gave_up = await asyncio.gather(*[give_up() for _ in range(4)])
                left = time.monotonic()
                while running.metrics()["sparsegen_queued_requests"] and time.monotonic() - left < 5:
                    await asyncio.sleep(0.02)
                freed = time.monotonic() - left
                metrics = running.metrics()
                after = await client.post(f"{running.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert all(r.status_code == 200 for r in await asyncio.gather(*busy))
                return gave_up, freed, metrics, after

        gave_up, freed, metrics, after = asyncio.run(load())
        assert gave_up == ["timeout"] * 4
        assert metrics["sparsegen_queued_requests"] == 0 and freed < 1.0
        assert metrics["sparsegen_active_replies"] == 2  # the long replies were still decoding: no place freed by them
        assert after.status_code == 200  # not 429
        assert _settle(running)["sparsegen_cancelled_total"] == 4
    finally:
        running.stop()


def test_more_new_sessions_than_the_server_keeps_wait_for_one(reference):
    running = Running(*reference, Limits(max_sessions=2, max_batch=8, max_tokens=64))
    try:
        async def load():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*[client.post(f"{running.url}/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"Hello {i}"}], "max_tokens": 24,
                    "session_id": f"new-{i}"}) for i in range(6)])

        replies = asyncio.run(load())
        assert [r.status_code for r in replies] == [200] * 6
        assert running.engine.counters["evicted_sessions"] == 4
    finally:
        running.stop()


def test_inspections_are_bounded_sized_first_and_stop_with_their_client(reference, monkeypatch):
    running = Running(*reference, Limits(max_sessions=2, max_batch=2, max_inspections=1, max_prompt_tokens=4096))
    inspector_calls = []
    try:
        import sparsegen.eval.inspect as inspect_module

        original = inspect_module.prefill

        def counted(*args, **kwargs):
            inspector_calls.append(time.monotonic())
            return original(*args, **kwargs)

        monkeypatch.setattr(inspect_module, "prefill", counted)
        long_body = {"text": TEXT * 60, "policies": ",".join(["h2o", "snapkv", "window", "streaming"] * 4),
                     "budget": 16}

        async def load():
            async with httpx.AsyncClient(timeout=60) as client:
                first = asyncio.create_task(client.post(f"{running.url}/v1/inspect", json=long_body, timeout=1.0))
                await asyncio.sleep(0.3)
                second = await client.post(f"{running.url}/v1/inspect", json=long_body)
                try:
                    await first
                except httpx.TimeoutException:
                    return second, "timeout"
                return second, "answered"

        second, first = asyncio.run(load())
        assert _openai_error(second, 429)["code"] == "overloaded" and first == "timeout"
        gone = time.monotonic()
        time.sleep(1.0)
        assert all(t < gone + 0.5 for t in inspector_calls)  # the abandoned inspection stopped at its next chunk
        assert len(inspector_calls) < 17  # (it would have run 17 prefills)
        tokenized, tokenizer = [], running.engine._spare_tokenizer
        monkeypatch.setattr(running.engine, "_spare_tokenizer", lambda *a, **k: tokenized.append(1))
        started = time.monotonic()
        huge = httpx.post(f"{running.url}/v1/inspect", json={"text": "the sea " * 125_000}, timeout=30)
        assert "--max-prompt-tokens" in _openai_error(huge, 400)["message"] and not tokenized
        assert time.monotonic() - started < 1.0
        running.engine._spare_tokenizer = tokenizer
        ok = httpx.post(f"{running.url}/v1/inspect", json={"text": TEXT, "policies": "h2o", "budget": 8}, timeout=30)
        assert ok.status_code == 200 and ok.json()["policies"]["h2o"]["kv_tokens"] <= 8 + 32
    finally:
        running.stop()


def _raw(server, data: bytes, then: float = 0.0) -> bytes:
    """What the server answers on a raw connection to ``data`` (sent, then ``then`` seconds of silence)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(data)
        time.sleep(then)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    return reply


def test_malformed_or_slow_http_gets_openai_shaped_errors(server):
    reply = _raw(server, b"GARBAGE \x00\x01 NOT HTTP\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["code"] == "bad_http_request"
    started = time.monotonic()  # headers never finished: closed at the header timeout (0.5 s)
    reply = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appli")
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply and time.monotonic() - started < 3
    started = time.monotonic()  # a body that stops halfway: 408 at the body timeout (0.5 s)
    reply = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply and time.monotonic() - started < 3
    assert httpx.head(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_a_handler_bug_is_a_500_with_one_log_line(server, monkeypatch, server_log):
    def broken(*args, **kwargs):
        raise TypeError("a bug")

    monkeypatch.setattr(type(server.app.state.worker), "submit", broken)
    reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=30)
    assert _openai_error(reply, 500)["type"] == "server_error"
    lines = [r for r in server_log if reply.headers["x-request-id"] in r.getMessage()]
    assert len(lines) == 1 and "TypeError: a bug" in lines[0].getMessage() and lines[0].exc_info is None
    assert not [r for r in server_log if "Exception in ASGI application" in r.getMessage()]
    monkeypatch.undo()
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "Once", "max_tokens": 2}).status_code == 200


def test_sigterm_drains_streams_to_done_and_answers_the_queue_503(reference, server_log):
    """Before: uvicorn cut the streams after its 5 s grace (no [DONE]), and the queued requests got plain-text 500s
    with CancelledError tracebacks."""
    running = Running(*reference, Limits(max_sessions=8, max_batch=6, max_tokens=8000), shutdown_grace=1.0)
    url = f"{running.url}/v1/completions"
    streamed: list[list[str]] = [[] for _ in range(6)]

    async def stream(client, events):
        async with client.stream("POST", url, json={"prompt": "Once upon a time", "max_tokens": 8000,
                                                    "stream": True, "ignore_eos": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    async def load():
        async with httpx.AsyncClient(timeout=60) as client:
            streams = [asyncio.create_task(stream(client, events)) for events in streamed]
            await _until(lambda: running.metrics()["sparsegen_active_replies"] == 6)
            queued = [asyncio.create_task(client.post(url, json={"prompt": "Hi", "max_tokens": 4})) for _ in range(2)]
            await _until(lambda: running.metrics()["sparsegen_queued_requests"] == 2)
            stopped, at_stop = time.monotonic(), [len(events) for events in streamed]
            running.server.handle_exit(signal.SIGTERM, None)
            refused = await client.post(url, json={"prompt": "Hi", "max_tokens": 4})
            health = await client.get(f"{running.url}/health")
            replies = await asyncio.gather(*queued)
            await asyncio.gather(*streams)
            return replies, refused, health, at_stop, time.monotonic() - stopped

    replies, refused, health, at_stop, seconds = asyncio.run(load())
    for reply in [*replies, refused]:
        assert _openai_error(reply, 503)["code"] == "shutting_down"
    assert health.status_code == 503 and health.json()["status"] == "draining"
    for events, before in zip(streamed, at_stop):
        assert len(events) > before + 2  # the replies in flight went on decoding through the grace
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert 1.0 <= seconds < 1.0 + 5
    running.thread.join(timeout=10)
    assert not running.thread.is_alive()
    assert not [r for r in server_log if r.exc_info or "Exception in ASGI" in r.getMessage()]
