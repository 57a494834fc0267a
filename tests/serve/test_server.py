"""The real server on a loopback port, talked to over HTTP."""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

import sparsegen
from sparsegen.bench.spawn import free_port as _free_port
from sparsegen.engine import Engine
from sparsegen.engine.generate import generate
from sparsegen.kv import PolicySpec
from sparsegen.serve.schemas import Limits
from sparsegen.serve.server import build_app, make_server

BUDGET = 48


def wait_healthy(url: str, alive=lambda: True, seconds: float = 60) -> None:
    """Until ``url``'s /health answers 200 (the server process, while ``alive()``, is still starting)."""
    deadline = time.time() + seconds
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.ConnectError:
            assert time.time() < deadline and alive(), "the server did not start"
            time.sleep(0.1)


class Running:
    """A server in a thread: ``url``, ``app`` and ``stop()``."""

    def __init__(self, model, tokenizer, limits: Limits, policy="streaming", defaults=None, kv_bits=None,
                 shutdown_grace: float = 30.0, **engine):
        self.engine = Engine(model, tokenizer, PolicySpec(policy, BUDGET, kv_bits=kv_bits), chunk_size=32,
                             max_sessions=limits.max_sessions, max_batch=limits.max_batch, **engine)
        self.app = build_app(self.engine, limits, "reference", defaults)
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = make_server(self.app, "127.0.0.1", port, log_level="error", shutdown_grace=shutdown_grace)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)

    def metrics(self) -> dict:
        text = httpx.get(f"{self.url}/metrics", headers=self.headers).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}

    headers: dict = {}

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def reference():
    return sparsegen.load("reference")


@pytest.fixture(scope="module")
def server(reference):
    running = Running(*reference, Limits(max_sessions=8, max_batch=8, max_tokens=64, max_messages=6,
                                         max_request_bytes=4096))
    yield running
    running.stop()
    assert not running.app.state.worker.is_alive()  # clean shutdown


def _chat(server, messages, **extra):
    return httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 16, **extra},
                      headers=server.headers, timeout=60)


def test_health_and_models(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "reference"


def test_answers_equal_sparsegen_generate_streaming_or_not(server, reference):
    model, tokenizer = reference
    prompt = "It was late in the evening when the old man came back to the house, and"
    expected = generate(model, tokenizer, prompt, policy="streaming", budget=BUDGET, max_new_tokens=16, chunk_size=32)
    body = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 16}, timeout=60).json()
    assert body["choices"][0]["text"] == expected.text and body["usage"]["completion_tokens"] == 16
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 16, "stream": True},
                      timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == expected.text

    messages = [{"role": "user", "content": "Where is the ship?"}]
    rendered = "User: Where is the ship?\nAssistant:"
    expected = generate(model, tokenizer, rendered, policy="streaming", budget=BUDGET, max_new_tokens=16, chunk_size=32)
    reply = _chat(server, messages).json()["choices"][0]
    assert reply["message"]["content"] == expected.text.removeprefix(" ").split("\nUser:")[0]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": messages, "max_tokens": 16, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == reply["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == reply["finish_reason"]


def test_a_session_second_turn_encodes_only_the_new_message(server, reference):
    messages = [{"role": "user", "content": "Tell me about the old house by the river."}]
    first = _chat(server, messages, session_id="s1").json()
    before = server.metrics()
    messages += [first["choices"][0]["message"], {"role": "user", "content": "And the garden?"}]
    second = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 16},
                        headers={"X-Session-Id": "s1"}, timeout=60).json()
    after = server.metrics()
    fed = after["sparsegen_prefill_tokens_total"] - before["sparsegen_prefill_tokens_total"]
    usage, cached = second["usage"], second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # (a new session encodes everything)
    # OpenAI's meaning: prompt_tokens is the whole prompt; cached_tokens what this turn did not encode again
    assert fed == usage["prompt_tokens"] - cached < first["usage"]["prompt_tokens"] <= cached
    assert cached <= first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]  # the turn it extends
    new_text = reference[1]("\nUser: And the garden?\nAssistant:", add_special_tokens=False)["input_ids"]
    assert fed <= len(new_text) + 1  # the new message in its template, and the reply's last token; not the history
    assert after["sparsegen_reencoded_sessions_total"] == before["sparsegen_reencoded_sessions_total"]
    assert second["session_id"] == "s1"


def test_bad_requests_get_openai_shaped_errors(server):
    url = f"{server.url}/v1/chat/completions"
    cases = [
        (httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400, "not valid JSON"),
        (httpx.post(url, json=[1, 2]), 400, "JSON object"),
        (httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}), 400,
         "temperature"),
        (httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "frequency": 1}), 400, "frequency"),
        (httpx.post(url, json={"messages": [{"role": "user", "content": 3}]}), 400, "content"),
        (httpx.post(url, json={"messages": [{"role": "robot", "content": "hi"}]}), 400, "role"),
        (httpx.post(url, json={"messages": []}), 400, "messages"),
        (httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 65}), 400, "limit of 64"),
        (httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "n": 2}), 400, "n"),
        (httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}] * 7}), 400, "limit of 6"),
        (httpx.post(url, json={"messages": [{"role": "user", "content": "x" * 5000}]}), 413, "larger than 4096"),
        (httpx.post(f"{server.url}/v1/completions", json={"prompt": ""}), 400, "prompt"),
    ]
    for response, status, words in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert words in error["message"] and error["type"]
    assert _chat(server, [{"role": "user", "content": "still fine?"}]).status_code == 200


def test_a_cancelled_stream_frees_its_session(server):
    messages = [{"role": "user", "content": "Tell me a long story."}]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers={"X-Session-Id": "cancel"}, timeout=60,
                      json={"messages": messages, "max_tokens": 64, "stream": True}) as response:
        next(response.iter_lines())  # the first chunk, then hang up
    deadline = time.time() + 10
    while True:  # the session is released once the worker sees the cancellation
        reply = _chat(server, messages, session_id="cancel")
        if reply.status_code == 200 or time.time() > deadline:
            break
        assert reply.status_code == 409
        time.sleep(0.1)
    assert reply.status_code == 200


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = client.chat.completions.create(model="reference", max_tokens=8,
                                           messages=[{"role": "user", "content": "Good morning."}])
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens <= 8
    streamed = client.chat.completions.create(model="reference", max_tokens=8, stream=True,
                                              messages=[{"role": "user", "content": "Good morning."}])
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == reply.choices[0].message.content


def test_api_key(reference):
    running = Running(*reference, Limits(api_keys=("s3cret",), max_sessions=2, max_batch=2))
    try:
        url = f"{running.url}/v1/completions"
        assert httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}).status_code == 401
        wrong = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        right = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200
        assert httpx.get(f"{running.url}/health").status_code == 200
        assert httpx.get(f"{running.url}/metrics").status_code == 401
    finally:
        running.stop()


def test_overload_gets_429_and_a_failing_step_only_fails_its_replies(reference, monkeypatch):
    running = Running(*reference, Limits(max_sessions=4, max_batch=1, max_queue=1, max_tokens=64))
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*[client.post(f"{running.url}/v1/completions",
                                                          json={"prompt": "The sea", "max_tokens": 64})
                                              for _ in range(8)])

        statuses = sorted(r.status_code for r in asyncio.run(burst()))
        assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
        original = running.engine.step

        def broken(jobs):
            raise RuntimeError("boom")

        monkeypatch.setattr(running.engine, "step", broken)
        failed = httpx.post(f"{running.url}/v1/completions", json={"prompt": "The sea", "max_tokens": 8}, timeout=60)
        assert failed.status_code == 500 and "boom" in failed.json()["error"]["message"]
        monkeypatch.setattr(running.engine, "step", original)
        assert httpx.post(f"{running.url}/v1/completions", json={"prompt": "The sea", "max_tokens": 8},
                          timeout=60).status_code == 200
    finally:
        running.stop()


@pytest.mark.heavy
def test_bounded_load_32_sessions_by_5_turns(reference):
    """Every request succeeds, sessions are batched, KV memory stays under the bound printed at start-up."""
    running = Running(*reference, Limits(max_sessions=32, max_batch=16, max_queue=64, max_tokens=16))
    bound = running.app.state.kv_bound
    try:
        async def session(client, index):
            messages, statuses = [], []
            for turn in range(5):
                messages.append({"role": "user", "content": f"Question {turn} from reader {index}?"})
                response = await client.post(f"{running.url}/v1/chat/completions",
                                             headers={"X-Session-Id": f"r{index}"},
                                             json={"messages": messages, "max_tokens": 8})
                statuses.append(response.status_code)
                messages.append(response.json()["choices"][0]["message"])
            return statuses

        async def everyone():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*[session(client, i) for i in range(32)])

        statuses = [s for row in asyncio.run(everyone()) for s in row]
        assert statuses == [200] * 160
        metrics = running.metrics()
        assert metrics["sparsegen_errors_total"] == 0 and metrics["sparsegen_sessions"] == 32
        assert metrics["sparsegen_reencoded_sessions_total"] == 0
        assert 0 < metrics["sparsegen_kv_bytes"] <= bound
        assert metrics["sparsegen_decode_tokens_total"] < 160 * 8  # several replies per step: batched
    finally:
        running.stop()


def test_bench_serve_reports_latency_and_memory(server, tmp_path, capsys):
    from sparsegen.cli import main

    out = tmp_path / "load.json"
    assert main(["bench-serve", "--url", server.url, "--sessions", "4", "--turns", "3", "--max-tokens", "4",
                 "--json", str(out), "--plot", str(tmp_path / "load.png")]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 12 and report["errors"] == 0 and report["reencoded_sessions"] == 0
    assert [m["turn"] for m in report["memory"]] == [1, 2, 3]
    assert 0 < report["ttft_p50_s"] <= report["ttft_p99_s"] and report["tokens_per_s"] > 0
    assert "4 sessions x 3 turns (4 at a time): 12 requests, 0 errors" in capsys.readouterr().out
    assert (tmp_path / "load.png").stat().st_size > 0


@pytest.mark.heavy
def test_the_serve_command_prints_its_memory_bound_answers_and_stops_cleanly(tmp_path):
    """And SIGTERM with streams running drains: each stream ends with an error event and [DONE] after the grace,
    the process exits 0 with no traceback (before: streams cut mid-body, exit by the re-raised signal, 143)."""
    import os
    import signal
    import subprocess
    import sys

    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "sparsegen", "serve", "--model", "reference", "--budget", "64",
                                "--port", str(port), "--max-sessions", "4", "--max-batch", "2", "--api-key", "k",
                                "--shutdown-grace", "1", "--log-level", "info"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": "Bearer k"}
    try:
        banner = next(line for line in process.stdout if "sparsegen serve:" in line)
        assert "worst-case KV memory" in banner and "4 sessions + 2 in flight" in banner
        wait_healthy(url, alive=lambda: process.poll() is None)
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "The sea", "max_tokens": 3}, headers=headers,
                           timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3

        async def streams():
            async with httpx.AsyncClient(timeout=60, headers=headers) as client:
                async def one():
                    async with client.stream("POST", f"{url}/v1/completions", json={
                            "prompt": "Once", "max_tokens": 1000, "stream": True, "ignore_eos": True}) as response:
                        events = []
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                                if len(events) == 3:
                                    process.send_signal(signal.SIGTERM)
                        return events

                return await asyncio.gather(one(), one())

        started = time.monotonic()
        for events in asyncio.run(streams()):
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert process.wait(timeout=30) == 0 and time.monotonic() - started < 1 + 5
    finally:
        if process.poll() is None:
            process.kill()
    output = process.stdout.read()
    assert "Traceback" not in output and "CancelledError" not in output


def test_the_serve_command_refuses_an_unbounded_policy(capsys):
    from sparsegen.cli import main

    assert main(["serve", "--model", "reference", "--policy", "full"]) == 2
    assert "grows without bound" in capsys.readouterr().err


def _post(server, path, body, **kw):
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60, **kw)


def _stream_texts(url, body, headers=None):
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        return response.status_code, [line for line in response.iter_lines() if line.startswith("data: ")]


def test_a_tiny_temperature_neither_fails_nor_poisons_other_replies(server):
    """Row 1: 2.4e-38 overflowed 1/T inside the shared decode step and failed every concurrent reply."""
    url = f"{server.url}/v1/completions"
    results = {}

    def run(name, temperature):
        results[name] = _stream_texts(url, {"prompt": "Once upon a time", "temperature": temperature,
                                            "max_tokens": 32, "stream": True})

    threads = [threading.Thread(target=run, args=(name, t)) for name, t in (("tiny", 2.4e-38), ("other", 0.7))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for status, lines in results.values():
        assert status == 200 and lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    tiny = {"prompt": "Once", "temperature": 5e-324, "max_tokens": 4}
    assert _post(server, "/v1/completions", tiny).status_code == 200
    nan = httpx.post(url, content=b'{"prompt": "Once", "temperature": '
                                  b'NaN}', headers={"content-type": "application/json"})
    assert nan.status_code == 400 and "temperature" in nan.json()["error"]["message"]


def test_stop_strings_are_limited_in_count_and_length(server):
    """Row 2: four 250K-character stop strings cost seconds per token."""
    for stop in (["x" * 250_000] * 4, ["a", "b", "c", "d", "e"]):
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Once", "max_tokens": 6, "stop": stop},
                           timeout=60)
        assert reply.status_code in (400, 413) and reply.json()["error"]["type"] == "invalid_request_error"
    reply = _post(server, "/v1/completions", {"prompt": "Once", "max_tokens": 6, "stop": ["y" * 256]})
    assert reply.status_code == 200


def test_a_long_prompt_is_refused_or_interleaved(reference):
    """Row 3: no limit on prompt tokens, and one long prefill held every other reply back."""
    running = Running(*reference, Limits(max_sessions=4, max_batch=4, max_tokens=16, max_prompt_tokens=2000))
    try:
        url = f"{running.url}/v1/completions"
        too_long = httpx.post(url, json={"prompt": "the sea " * 1500, "max_tokens": 1}, timeout=60)
        assert too_long.status_code == 400 and "limit of 2000" in too_long.json()["error"]["message"]
        assert running.metrics()["sparsegen_requests_total"] == 0  # tokenized and refused before the worker
        finished = {}

        def send(name, prompt, tokens):
            httpx.post(url, json={"prompt": prompt, "max_tokens": tokens}, timeout=120)
            finished[name] = time.perf_counter()

        long = threading.Thread(target=send, args=("long", "It was late in the evening. " * 250, 1))
        long.start()
        time.sleep(0.3)
        send("short", "The sea", 4)
        long.join()
        assert finished["short"] < finished["long"]  # served between the long prompt's chunks
    finally:
        running.stop()


def test_a_chunked_upload_is_cut_off_at_the_limit(server):
    """Row 4: a chunked body was read whole before the 413."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(8):  # 8 KiB of a body that never ends; the limit is 4096
            sock.sendall(b"400\r\n" + b" " * 1024 + b"\r\n")
        answer = b""
        while b"too_large" not in answer:  # answered now, not when the body ends
            received = sock.recv(4096)
            assert received, answer
            answer += received
    assert answer.startswith(b"HTTP/1.1 413")


def test_text_the_tokenizer_cannot_take_gets_a_400(server):
    """Row 5: a lone surrogate in chat content was a 500 with tokenizer internals."""
    body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    reply = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "surrogate" in reply.json()["error"]["message"]


@pytest.mark.parametrize("session_id", ["\U0001f600", "a\r\nb", "x" * 129, "semi;colon"])
def test_session_ids_are_checked_in_the_body_and_the_header(server, session_id):
    """Row 6: a non-Latin-1 session id in a stream was a 500, one with CR LF dropped the connection."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "session_id": session_id}, timeout=60)
    assert reply.status_code == 400 and "session" in reply.json()["error"]["message"]
    if session_id.isprintable() and session_id.isascii():
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"X-Session-Id": session_id})
        assert reply.status_code == 400


def test_limits_below_one_are_refused():
    """Row 7: --max-batch 0 started a server that admitted nothing and spun a core."""
    for name in ("max_batch", "max_queue", "max_tokens", "max_request_bytes", "max_messages", "max_prompt_tokens"):
        with pytest.raises(ValueError, match=name):
            Limits(**{name: 0})


def test_a_disconnected_client_cancels_its_unstreamed_reply(reference):
    """Row 8: a killed client's non-streamed request decoded all its tokens."""
    running = Running(*reference, Limits(max_sessions=2, max_batch=2, max_tokens=4000))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{running.url}/v1/completions", json={"prompt": "Once", "max_tokens": 4000}, timeout=1.0)
        deadline = time.time() + 10
        while running.metrics()["sparsegen_active_replies"] and time.time() < deadline:
            time.sleep(0.1)
        metrics = running.metrics()
        assert metrics["sparsegen_active_replies"] == 0 and metrics["sparsegen_decode_tokens_total"] < 2000
    finally:
        running.stop()


def test_server_defaults_apply_to_requests_that_leave_them_out(reference):
    """Row 9: serve's --max-new-tokens, --temperature, --top-p and --seed were ignored."""
    from sparsegen.engine import Sampling

    running = Running(*reference, Limits(max_tokens=64), defaults=Sampling(max_tokens=5, temperature=0.9, seed=3))
    try:
        url = f"{running.url}/v1/completions"
        texts = [httpx.post(url, json={"prompt": "The sea"}, timeout=60).json() for _ in range(2)]
        assert all(t["usage"]["completion_tokens"] == 5 for t in texts)
        assert texts[0]["choices"][0]["text"] == texts[1]["choices"][0]["text"]  # seed 3 both times
        greedy = httpx.post(url, json={"prompt": "The sea", "temperature": 0, "max_tokens": 5}, timeout=60).json()
        sampled = [httpx.post(url, json={"prompt": "The sea", "seed": s}, timeout=60).json()["choices"][0]["text"]
                   for s in range(4)]
        assert any(text != greedy["choices"][0]["text"] for text in sampled)  # 0.9, not greedy
    finally:
        running.stop()
    with pytest.raises(ValueError, match="over the limit"):
        build_app(running.engine, Limits(max_tokens=4), "reference", Sampling(max_tokens=5))


def test_a_stop_string_reply_is_extended_by_the_next_turn(server):
    """Row 10: a reply ending on a client stop string made the next turn re-encode the whole history."""
    messages = [{"role": "user", "content": "Tell me about the old house by the river."}]
    free = _chat(server, messages).json()["choices"][0]["message"]["content"]
    stop = free.split()[2]
    first = _chat(server, messages, session_id="stops", stop=[stop]).json()
    assert first["choices"][0]["finish_reason"] == "stop"
    before = server.metrics()
    messages += [first["choices"][0]["message"], {"role": "user", "content": "And the garden?"}]
    second = _chat(server, messages, session_id="stops", stop=[stop]).json()
    after = server.metrics()
    assert after["sparsegen_reencoded_sessions_total"] == before["sparsegen_reencoded_sessions_total"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert second["usage"]["prompt_tokens"] - cached < first["usage"]["prompt_tokens"] <= cached


def test_sessions_belong_to_their_api_key(reference):
    """Row 11: any client could reset another's conversation by guessing its id."""
    running = Running(*reference, Limits(api_keys=("alice", "bob"), max_sessions=4, max_batch=2, max_tokens=16))
    try:
        url = f"{running.url}/v1/chat/completions"
        alice, bob = ({"Authorization": f"Bearer {key}"} for key in ("alice", "bob"))
        running.headers = alice
        messages = [{"role": "user", "content": "My name is Alice."}]
        first = httpx.post(url, json={"messages": messages, "max_tokens": 4, "session_id": "s"}, headers=alice,
                           timeout=60).json()
        httpx.post(url, json={"messages": [{"role": "user", "content": "Something else."}], "max_tokens": 4,
                              "session_id": "s"}, headers=bob, timeout=60)
        follow = messages + [first["choices"][0]["message"], {"role": "user", "content": "What is my name?"}]
        before = running.metrics()
        httpx.post(url, json={"messages": follow, "max_tokens": 4, "session_id": "s"}, headers=alice, timeout=60)
        after = running.metrics()
        assert after["sparsegen_sessions"] == 2  # one "s" per key
        assert after["sparsegen_reencoded_sessions_total"] == before["sparsegen_reencoded_sessions_total"]
    finally:
        running.stop()


def test_a_non_json_content_type_gets_a_415(server):
    """Row 12: a text/plain POST (which any web page may send cross-origin) was served."""
    reply = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "Once", "max_tokens": 2}',
                       headers={"content-type": "text/plain", "origin": "http://evil.example"})
    assert reply.status_code == 415 and reply.json()["error"]["code"] == "unsupported_media_type"


def test_openai_shapes_usage_chunks_models_and_the_schema(server):
    """Row 16: include_usage ignored, any model accepted, 404/405 not in the OpenAI shape, no request schema."""
    status, lines = _stream_texts(f"{server.url}/v1/completions", {"prompt": "Once", "max_tokens": 3, "stream": True,
                                                                    "stream_options": {"include_usage": True}})
    usage = json.loads(lines[-2][6:])
    assert status == 200 and usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    wrong = _post(server, "/v1/completions", {"prompt": "Once", "model": "gpt-4"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    named = {"prompt": "Once", "model": "reference", "max_tokens": 1}
    assert _post(server, "/v1/completions", named).status_code == 200
    for reply, status in ((httpx.get(f"{server.url}/v1/nothing"), 404),
                          (httpx.get(f"{server.url}/v1/completions"), 405)):
        assert reply.status_code == status and reply.json()["error"]["message"]
    schema = httpx.get(f"{server.url}/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("ChatRequest")
    assert "messages" in schema["components"]["schemas"]["ChatRequest"]["properties"]
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/Completion")
    assert "text/event-stream" in responses["200"]["content"]
    assert all(responses[str(code)]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorReply")
               for code in (400, 401, 413, 415, 429))


def test_bench_serve_hostile_client_does_not_fail_the_others(server, capsys):
    from sparsegen.cli import main

    assert main(["bench-serve", "--url", server.url, "--sessions", "3", "--turns", "2", "--max-tokens", "4",
                 "--hostile"]) == 0
    out = capsys.readouterr().out
    assert "6 requests, 0 errors" in out and "engine rebuilds 0" in out
    hostile = next(line for line in out.splitlines() if line.startswith("hostile client meanwhile:"))
    assert "tiny temperature: 200" in hostile and "upload: 413" in hostile and ": 5" not in hostile


@pytest.mark.heavy
def test_bench_serve_chaos_soak_fails_no_good_reply_and_memory_stays_flat(reference, tmp_path, capsys):
    """Far more distinct conversations than the server keeps, with clients misbehaving meanwhile: every good reply
    succeeds, no fault gets a 5xx, and the K/V the server holds stops growing once it keeps max_sessions."""
    from sparsegen.cli import main

    # 8 kept sessions, far fewer than the 48 conversations (new sessions beyond them wait for one)
    running = Running(*reference, Limits(max_sessions=8, max_batch=8, max_tokens=64))
    try:
        out = tmp_path / "soak.json"
        assert main(["bench-serve", "--url", running.url, "--sessions", "48", "--concurrency", "4", "--turns", "2",
                     "--max-tokens", "4", "--chaos", "3", "--sample-every", "12", "--json", str(out),
                     "--plot", str(tmp_path / "soak.png")]) == 0
        report = json.loads(out.read_text())
        assert report["errors"] == 0 and report["server_faults"] == 0 and report["health"] == {"status": "ok"}
        faults = {outcome.split(":")[0] for outcome in report["chaos"]}
        assert len(faults) >= 6 and sum(report["chaos"].values()) >= 10
        samples = report["samples"]
        assert [s["conversations"] for s in samples] == [12, 24, 36, 48]
        assert all(s["sessions_kept"] <= 8 for s in samples)
        assert samples[-1]["kv_bytes"] <= samples[0]["kv_bytes"] * 1.5  # bounded by 8 small sessions, not growing
        assert running.engine.counters["evicted_sessions"] >= 48 - 8
        assert "server faults" in capsys.readouterr().out
    finally:
        running.stop()


def test_bench_serve_exits_non_zero_when_a_good_reply_fails(reference, monkeypatch, capsys):
    from sparsegen.cli import main

    running = Running(*reference, Limits(max_sessions=4, max_batch=4, max_tokens=64))
    try:
        monkeypatch.setattr(running.engine, "step", lambda jobs: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(SystemExit) as exit_:
            main(["bench-serve", "--url", running.url, "--sessions", "2", "--turns", "1", "--max-tokens", "2"])
        assert exit_.value.code == 1 and "FAILED" in capsys.readouterr().err
    finally:
        running.stop()


def test_the_memory_bound_counts_quantized_caches_as_they_are_stored(reference):
    """With --kv-bits the printed bound shrinks with the storage and still holds a session filled to its peak."""
    from sparsegen.engine import Sampling
    from sparsegen.serve.worker import kv_bound

    model, tokenizer = reference
    limits = Limits(max_sessions=1, max_batch=1)
    bounds = {}
    for bits in (None, 4):
        engine = Engine(model, tokenizer, PolicySpec("h2o", BUDGET, kv_bits=bits), chunk_size=16)
        bounds[bits] = kv_bound(engine, limits)
    job = engine.begin(engine.session("kept"), Sampling(max_tokens=8), prompt="the house was quiet " * 40)
    while not job.done:
        engine.step([job])
    assert 0 < engine.kv_bytes() <= bounds[4] < bounds[None]


@pytest.mark.parametrize("policy", ["streaming", "kvzip", "expected-attention"])
def test_a_compressed_context_is_served_by_name(reference, policy):
    """Requests that name a --context continue it from its compressed cache: the same text as generate on it, with
    only the request's own tokens encoded (a query-agnostic one, KVzip's, too)."""
    model, tokenizer = reference
    document = "It was late in the evening when the old man came back to the house by the river. " * 6
    compressed = sparsegen.compress(model, tokenizer, document, policy=policy, budget=BUDGET)
    running = Running(model, tokenizer, Limits(max_sessions=4, max_batch=4, max_tokens=64), policy=policy,
                      contexts={"doc": compressed})
    try:
        question = " The old man said that"
        expected = generate(model, tokenizer, context=compressed, question=question, max_new_tokens=12)
        before = running.metrics()
        body = httpx.post(f"{running.url}/v1/completions", timeout=60,
                          json={"prompt": question, "max_tokens": 12, "context": "doc"}).json()
        assert body["choices"][0]["text"] == expected.text
        fed = running.metrics()["sparsegen_prefill_tokens_total"] - before["sparsegen_prefill_tokens_total"]
        assert fed == len(tokenizer(question, add_special_tokens=False)["input_ids"])  # not the document
        turns = [httpx.post(f"{running.url}/v1/completions", timeout=60, headers={"X-Session-Id": "c1"},
                            json={"prompt": question, "max_tokens": 6, "context": "doc"}).json()]
        follow = question + turns[0]["choices"][0]["text"] + " and then"
        turns.append(httpx.post(f"{running.url}/v1/completions", timeout=60, headers={"X-Session-Id": "c1"},
                                json={"prompt": follow, "max_tokens": 6, "context": "doc"}))
        assert turns[1].headers["X-Session-History"] == "kept"
        if policy == "streaming":  # (an order policy keeps the same tokens however the turns came in chunks; an
            # attention policy's choice depends on the chunks: the first turn's reply came a token at a time)
            assert turns[1].json()["choices"][0]["text"] == generate(
                model, tokenizer, context=compressed, question=follow, max_new_tokens=6).text
        unknown = httpx.post(f"{running.url}/v1/completions", timeout=60,
                             json={"prompt": question, "max_tokens": 4, "context": "nope"})
        assert unknown.status_code == 400 and "unknown context 'nope'" in unknown.json()["error"]["message"]
        chat = httpx.post(f"{running.url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Who came back?"}], "max_tokens": 6,
                                "context": "doc"})
        assert chat.status_code == 200
    finally:
        running.stop()
    other = sparsegen.compress(model, tokenizer, document, policy="h2o", budget=BUDGET)
    with pytest.raises(ValueError, match="compressed under"):
        Engine(model, tokenizer, PolicySpec(policy, BUDGET), contexts={"doc": other})
