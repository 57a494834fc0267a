"""Admission by K/V memory (``--kv-memory``): live sessions are set by what their caches reserve, the K/V bytes
allocated never pass the cap, idle sessions are dropped least recently used first and their clients are told, and
requests that do not fit wait (429 beyond the queue) instead of failing."""

import concurrent.futures
import threading
import time

import httpx
import pytest

from sparsegen.engine import Engine, Sampling
from sparsegen.kv import PolicySpec
from sparsegen.models.spec import kv_bytes_per_token
from sparsegen.serve.schemas import Limits
from tests.kv.families import tiny_model
from tests.serve.ids import IdTokenizer
from tests.serve.test_server import Running, reference  # noqa: F401  (the fixture)

CHUNK = 8


def _engine(policy: str, budget: int | None, cap_sessions: float, **extra) -> Engine:
    model = tiny_model("llama")
    per_token = kv_bytes_per_token(model.config, 4)
    own = extra.get("max_context") if budget is None else budget + CHUNK
    cap = int(cap_sessions * own * per_token)
    return Engine(model, IdTokenizer(), PolicySpec(policy, budget), chunk_size=CHUNK, kv_memory=cap,
                  **extra)


def _prompt(n: int, start: int = 3) -> str:
    return " ".join(str(start + i % 50) for i in range(n))


@pytest.mark.parametrize("policy,budget,context", [("h2o", 16, None), ("streaming", 16, None), ("full", None, 64)])
def test_a_cap_holds_as_many_sessions_as_their_reservations_allow(policy, budget, context):
    engine = _engine(policy, budget, 3.5, max_context=context, idle_grace=0)
    memory = engine.memory
    assert memory.most_live == 3
    sessions = [engine.session(f"s{i}") for i in range(4)]
    jobs = []
    for session in sessions[:3]:
        assert engine.admit(session)
        jobs.append(engine.begin(session, Sampling(max_tokens=6), prompt=_prompt(40)))
    assert not engine.admit(sessions[3])  # all three busy: the fourth waits
    peak = 0
    while not all(job.done for job in jobs):
        engine.step(jobs)
        peak = max(peak, engine.kv_bytes())
        assert all(s.cache.held_bytes() >= 0 for s in sessions[:3])  # parked ones (in the batch) too
    assert 0 < peak <= memory.cap and memory.reserved <= memory.cap
    for job in jobs:
        engine.settle(job)
    assert engine.admit(sessions[3])  # an idle one is dropped for it: the least recently used
    assert engine.counters["dropped_sessions"] == 1 and sessions[0].text == "" and sessions[0].cache.length == 0
    assert sessions[1].cache.length > 0


def test_a_dropped_session_starts_over_and_its_reply_says_so():
    engine = _engine("h2o", 16, 1.2, idle_grace=0)
    first, second = engine.session("a"), engine.session("b")
    prompt = _prompt(20)
    assert engine.admit(first)
    job = engine.begin(first, Sampling(max_tokens=4), prompt=prompt)
    while not job.done:
        engine.step([job])
    engine.settle(job)
    assert not job.reencoded
    assert engine.admit(second)  # only one fits: "a" goes
    assert engine.admit(first)
    assert engine.begin(first, Sampling(max_tokens=4), prompt=first.text + " " + _prompt(5, 9)).reencoded


def test_an_idle_session_is_safe_for_its_grace_period():
    engine = _engine("streaming", 16, 1.5, idle_grace=60)
    first, second = engine.session("a"), engine.session("b")
    assert engine.admit(first)
    job = engine.begin(first, Sampling(max_tokens=2), prompt=_prompt(12))
    while not job.done:
        engine.step([job])
    engine.settle(job)
    assert not engine.admit(second) and engine.counters["dropped_sessions"] == 0
    first.idle_since = time.monotonic() - 61
    assert engine.admit(second)


def test_bad_caps_and_contexts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="holds no session.*raise it"):
        _engine("h2o", 16, 0.5)
    with pytest.raises(ValueError, match="per-head budgets"):
        _engine("adakv", 16, 4)
    engine = _engine("full", None, 2, max_context=32)
    session = engine.session("a")
    with pytest.raises(ValueError, match="over this server's --max-context 32"):
        engine.begin(session, Sampling(max_tokens=8), prompt=_prompt(30))


def test_over_http_sessions_wait_for_memory_and_none_fails(reference):  # noqa: F811
    """Six conversations of two turns against a cap of two live sessions: every reply arrives, the K/V bytes never
    pass the cap, and /metrics shows the reservations."""
    model, tokenizer = reference
    per_session = (48 + 32) * kv_bytes_per_token(model.config, 4)  # budget + chunk
    running = Running(model, tokenizer, Limits(max_sessions=8, max_batch=8, max_tokens=16), policy="h2o",
                      kv_memory=int(2.5 * per_session), idle_grace=0.2)
    engine = running.engine
    try:
        peak = [0]

        def watch(done):
            while not done.is_set():
                peak[0] = max(peak[0], running.metrics()["sparsegen_kv_bytes"])
                time.sleep(0.02)

        def converse(index: int) -> list[str]:
            messages, seen = [], []
            for turn in range(2):
                messages.append({"role": "user", "content": f"Reader {index} asks question {turn}: what next?"})
                reply = httpx.post(f"{running.url}/v1/chat/completions", timeout=120,
                                   json={"messages": messages, "max_tokens": 12, "session_id": f"r{index}"})
                assert reply.status_code == 200, reply.text
                seen.append(reply.headers["X-Session-History"])
                messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
            return seen

        done = threading.Event()
        watcher = threading.Thread(target=watch, args=(done,), daemon=True)
        watcher.start()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            histories = list(pool.map(converse, range(6)))
        done.set()
        watcher.join()
        metrics = running.metrics()
        assert all(h[0] == "kept" for h in histories)  # a first turn has nothing to re-encode
        assert 0 < peak[0] <= engine.memory.cap
        assert metrics["sparsegen_live_sessions"] <= 2 and metrics["sparsegen_most_live_sessions"] == 2
        assert metrics["sparsegen_kv_memory_bytes"] == engine.memory.cap
        assert metrics["sparsegen_errors_total"] == 0
    finally:
        running.stop()


def test_sliding_window_layers_reserve_their_window_only():
    """Gemma 3's sliding layers hold their window whatever the policy: a session reserves that, not the budget."""
    model = tiny_model("gemma3")
    per_layer = kv_bytes_per_token(model.config, 4) // 3
    engine = Engine(model, IdTokenizer(), PolicySpec("full", None), chunk_size=CHUNK, kv_memory=1 << 30,
                    max_context=64)
    window = 6 - 1 + CHUNK  # the window's tokens and a chunk, in each of the two sliding layers
    assert engine.memory.per_session == (64 + 2 * window) * per_layer
