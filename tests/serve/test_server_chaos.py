"""Chaos through HTTP: clients that hang up mid-stream or while queued, an engine error outside any reply, and an
engine thread that dies. The other replies are exact, the server keeps answering (or, when its engine is gone, says
so and exits non-zero), no traceback is logged for a normal disconnect, and no KV memory stays behind."""

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest

from sparsegen.serve.schemas import Limits
from sparsegen.serve.server import build_app, run_server
from tests.serve.test_server import Running, _free_port, reference, wait_healthy  # noqa: F401  (the fixture)

PROMPTS = [f"Story {i}: once upon a time, in a town by the sea," for i in range(8)]
HANG_UP = {0: 1, 3: 3, 6: 5}  # client -> the events it reads before closing the connection


@pytest.fixture
def server_log():
    """uvicorn's error log, where "Exception in ASGI application" tracebacks go."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


async def _streamed(client, url: str, prompt: str, max_tokens: int, hang_up_after: int | None = None) -> str | None:
    """A streamed completion's text, or None if this client hung up after ``hang_up_after`` events."""
    text, events = [], 0
    async with client.stream("POST", f"{url}/v1/completions",
                             json={"prompt": prompt, "max_tokens": max_tokens, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text.append(event["choices"][0]["text"])
            events += 1
            if hang_up_after is not None and events >= hang_up_after:
                return None  # leaving the block closes the connection mid-stream
    return "".join(text)


def _settle(running: Running) -> dict:
    deadline = time.time() + 20
    while (metrics := running.metrics())["sparsegen_active_replies"] and time.time() < deadline:
        time.sleep(0.05)
    return metrics


@pytest.mark.parametrize("policy,kv_bits,compile", [("streaming", None, False), ("h2o", None, False),
                                                    ("adakv", None, False), ("h2o", 4, False), ("h2o", None, True)])
@pytest.mark.heavy
def test_clients_hanging_up_mid_stream_leave_the_others_exact(reference, server_log, compiled_step_batches, policy,
                                                              kv_bits, compile):
    """``compile``: ``serve --compile``'s stacked batches through the compiled step, rows leaving it mid-stream."""
    running = Running(*reference, Limits(max_sessions=16, max_batch=8, max_tokens=2000), policy=policy,
                      kv_bits=kv_bits, compile=compile)
    try:
        expected = [httpx.post(f"{running.url}/v1/completions", json={"prompt": p, "max_tokens": 24},
                               timeout=60).json()["choices"][0]["text"] for p in PROMPTS]

        async def load():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*[
                    _streamed(client, running.url, prompt, 2000 if i in HANG_UP else 24, HANG_UP.get(i))
                    for i, prompt in enumerate(PROMPTS)])

        got = asyncio.run(load())
        assert [t for i, t in enumerate(got) if i not in HANG_UP] == [t for i, t in enumerate(expected)
                                                                       if i not in HANG_UP]
        metrics = _settle(running)
        assert metrics["sparsegen_cancelled_total"] == len(HANG_UP)
        assert metrics["sparsegen_decode_tokens_total"] < 8 * 24 + 3 * 500  # the hung-up replies stopped early
        assert metrics["sparsegen_kv_bytes"] == 0 and metrics["sparsegen_errors_total"] == 0  # stateless: all freed
        assert httpx.get(f"{running.url}/health").json() == {"status": "ok"}
        again = httpx.post(f"{running.url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 24}, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected[1]
        assert not [r for r in server_log if r.levelno >= logging.ERROR], [r.getMessage() for r in server_log]
        assert (max(compiled_step_batches, default=0) > 1) == compile  # stacked rows took the compiled step
    finally:
        running.stop()


@pytest.mark.heavy
def test_a_client_that_leaves_while_queued_costs_nothing(reference):
    running = Running(*reference, Limits(max_sessions=4, max_batch=2, max_tokens=2000))
    try:
        async def load():
            async with httpx.AsyncClient(timeout=60) as client:
                busy = [asyncio.create_task(_streamed(client, running.url, p, 300)) for p in PROMPTS[:2]]
                while "sparsegen_active_replies 2" not in (await client.get(f"{running.url}/metrics")).text:
                    await asyncio.sleep(0.02)  # both decoding before the third comes (else it could be served first)
                waiting = asyncio.create_task(client.post(f"{running.url}/v1/completions",
                                                          json={"prompt": "Hi", "max_tokens": 5}))
                while (await client.get(f"{running.url}/metrics")).text.count("sparsegen_queued_requests 1") == 0:
                    assert not waiting.done()
                    await asyncio.sleep(0.02)
                waiting.cancel()  # queued behind the two: the client gives up, closing its connection
                return await asyncio.gather(*busy)

        assert all(asyncio.run(load()))
        metrics = _settle(running)
        assert metrics["sparsegen_requests_total"] == 2 and metrics["sparsegen_cancelled_total"] == 1
    finally:
        running.stop()


def test_an_engine_error_outside_any_reply_fails_those_in_flight_and_the_server_goes_on(reference, monkeypatch):
    running = Running(*reference, Limits(max_sessions=4, max_batch=4, max_tokens=2000))
    try:
        def broken(job):
            raise RuntimeError("cancel broke")

        monkeypatch.setattr(running.engine, "cancel", broken)

        async def load():
            async with httpx.AsyncClient(timeout=60) as client:
                others = [asyncio.create_task(client.post(f"{running.url}/v1/completions",
                                                          json={"prompt": p, "max_tokens": 2000}))
                          for p in PROMPTS[1:3]]
                await asyncio.sleep(0.2)
                await _streamed(client, running.url, PROMPTS[0], 2000, hang_up_after=2)  # its cancel fails
                return await asyncio.gather(*others)

        failed = asyncio.run(load())
        assert [r.status_code for r in failed] == [500, 500] and "cancel broke" in failed[0].json()["error"]["message"]
        health = httpx.get(f"{running.url}/health").json()
        assert health["status"] == "ok" and health["engine_rebuilds"] == 1 and "cancel broke" in health["last_rebuild"]
        monkeypatch.undo()
        assert httpx.post(f"{running.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                          timeout=60).status_code == 200
        assert running.metrics()["sparsegen_engine_rebuilds_total"] == 1
    finally:
        running.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_dead_engine_thread_fails_what_waits_reports_down_and_exits_non_zero(reference, monkeypatch):
    from sparsegen.engine import Engine
    from sparsegen.kv import PolicySpec

    class Fatal(BaseException):
        pass

    engine = Engine(*reference, PolicySpec("streaming", 48), chunk_size=32, max_batch=2)
    app = build_app(engine, Limits(max_sessions=2, max_batch=2), "reference")
    worker = app.state.worker
    port = _free_port()
    status = []
    thread = threading.Thread(target=lambda: status.append(run_server(app, "127.0.0.1", port, "critical")))
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    original = worker._tick

    def dying():
        if engine.counters["decode_tokens"] > 3:
            raise Fatal("a bug no handler expects")
        original()

    monkeypatch.setattr(worker, "_tick", dying)
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 1000}, timeout=60)
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
    thread.join(timeout=30)
    assert status == [3] and worker.died == "Fatal: a bug no handler expects"
