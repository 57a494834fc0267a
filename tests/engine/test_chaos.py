"""Chaos: one reply aborted at every point it can be, under batches of 1, 2 and 8 and every kind of cache. The others
must give exactly the tokens of an undisturbed run, the engine must be left clean (no stacked batch, no busy session,
the aborted session usable), and every dropped cache must really be freed."""

import gc
import weakref

import pytest
import torch

from sparsegen.engine import Engine, Sampling, scheduler
from sparsegen.engine.speculative import Speculation, draft_policy
from sparsegen.kv import PolicySpec
from tests.kv.families import VOCAB, tiny_model
from tests.serve.ids import IdTokenizer

CONFIGS = {  # name: Engine keyword arguments
    "full": dict(policy=PolicySpec("full")),
    "streaming": dict(policy=PolicySpec("streaming", 12)),
    "h2o": dict(policy=PolicySpec("h2o", 12)),
    "adakv": dict(policy=PolicySpec("adakv", 12)),
    "streaming+kv4": dict(policy=PolicySpec("streaming", 12, kv_bits=4)),
    "speculative": dict(policy=PolicySpec("full"),
                        speculation=lambda: Speculation(draft_policy("window:6"), 3)),
}
POINTS = ("queued", "prefilling", "decoding", "failing")  # "decoding" is "speculating" for a speculative reply alone
CHUNK = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _prompts(batch: int, point: str) -> list[str]:
    """The victim (0) has a prompt of three chunks when it is aborted before decoding, else a short one (it then
    joins the batch first: row 0, whose gap the last row fills); the others have 2 to 12 tokens."""
    generator = torch.Generator().manual_seed(batch)
    lengths = [13 if point in ("queued", "prefilling") else 3] + [2 + (5 * i) % 11 for i in range(1, batch)]
    return [" ".join(map(str, torch.randint(3, VOCAB, (n,), generator=generator).tolist())) for n in lengths]


def _run(model, config: str, batch: int, point: str, abort: bool) -> tuple[Engine, list]:
    """``point``'s prompts begun at once, each in its own session, and stepped until all are done; the victim aborted
    at ``point`` if ``abort``."""
    engine = Engine(model, IdTokenizer(), chunk_size=CHUNK, max_batch=batch, **CONFIGS[config])
    prompts = _prompts(batch, point)
    point = point if abort else None

    def decoding(job) -> bool:  # past its second token, and in the stacked batch unless it decodes alone
        return len(job.tokens) >= 2 and (batch == 1 or any(row is job for row in engine._rows))

    def on_text(job, text):
        if point == "failing" and job.session.id == "s0" and decoding(job):
            engine.aborted_at = "stacked" if engine._rows else "alone"
            raise RuntimeError("the client's callback failed")

    jobs = [engine.begin(engine.session(f"s{i}"), Sampling(max_tokens=40 if i == 0 else 8), prompt=prompt,
                         on_text=on_text) for i, prompt in enumerate(prompts)]
    victim = jobs[0]
    while not all(job.done for job in jobs):
        abort = (point == "queued" and engine._ticks == 0) or \
                (point == "prefilling" and victim.feed and engine._ticks >= 1 and victim.served) or \
                (point == "decoding" and decoding(victim))
        if abort and not victim.done:
            engine.aborted_at = "stacked" if engine._rows else "alone" if point == "decoding" else point
            engine.cancel(victim)
        engine.step(jobs)
    return engine, jobs


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("batch", [1, 2, 8])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_an_abort_leaves_the_others_exact_and_the_engine_clean(model, config, batch, point):
    _, undisturbed = _run(model, config, batch, point, abort=False)
    engine, jobs = _run(model, config, batch, point, abort=True)
    victim = jobs[0]
    assert victim.finish_reason == ("error" if point == "failing" else "cancelled")
    decoded = "alone" if batch == 1 else "stacked"  # alone, a speculative reply speculates
    assert engine.aborted_at == {"queued": "queued", "prefilling": "prefilling"}.get(point, decoded)
    if point == "prefilling":
        assert victim.tokens == []  # it was stopped inside its prompt
    assert [job.tokens for job in jobs[1:]] == [job.tokens for job in undisturbed[1:]]
    assert [job.content for job in jobs[1:]] == [job.content for job in undisturbed[1:]]
    assert [job.session.cache.allocated_bytes() for job in jobs[1:]] == \
        [job.session.cache.allocated_bytes() for job in undisturbed[1:]]
    assert engine._batch is None and engine._rows == [] and not any(s.busy for s in engine.sessions.values())
    assert engine.kv_bytes() == sum(s.cache.allocated_bytes() for s in engine.sessions.values())
    # the aborted conversation goes on
    again = engine.begin(victim.session, Sampling(max_tokens=4), prompt="5 6 7")
    while not again.done:
        engine.step([again])
    assert again.finish_reason == "length" and len(again.tokens) == 4
    # every cache is freed as soon as its session is dropped (no reference cycle waits for the collector)
    caches = [weakref.ref(s.cache) for s in engine.sessions.values()]
    gc.disable()
    try:
        del jobs, victim, again, undisturbed
        engine.sessions.clear()
        assert all(ref() is None for ref in caches)
    finally:
        gc.enable()


def test_an_error_between_steps_is_recovered_without_a_tensor_touched(model, monkeypatch):
    """``recover`` (the server's answer to an error outside any one reply) fails the replies in flight, starts their
    sessions over and forgets the stacked batch, even when the batch itself cannot be read any more."""
    engine = Engine(model, IdTokenizer(), chunk_size=CHUNK, max_batch=4, **CONFIGS["h2o"])
    jobs = [engine.begin(engine.session(f"s{i}"), Sampling(max_tokens=8), prompt=p)
            for i, p in enumerate(_prompts(4, "decoding"))]
    for _ in range(6):
        engine.step(jobs)
    assert engine._batch is not None
    monkeypatch.setattr(scheduler, "remove_row", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
    engine.recover(jobs, RuntimeError("the worker failed"))
    assert all(job.finish_reason == "error" for job in jobs) and engine._batch is None
    assert all(not s.busy and s.cache.length == 0 and s.text == "" for s in engine.sessions.values())
    monkeypatch.undo()
    fresh = engine.begin(engine.session("s0"), Sampling(max_tokens=3), prompt="4 5 6")
    while not fresh.done:
        engine.step([fresh])
    assert len(fresh.tokens) == 3


def test_many_more_sessions_than_kept_hold_memory_flat(model):
    """Sessions beyond ``max_sessions`` evict the least recently used idle one, whose caches are freed at once; a
    short conversation holds a small allocation, not its whole budget."""
    engine = Engine(model, IdTokenizer(), chunk_size=64, max_sessions=4, policy=PolicySpec("h2o", 512))
    freed, sizes = [], []
    for i in range(40):
        session = engine.session(f"conversation-{i}")
        job = engine.begin(session, Sampling(max_tokens=3), prompt=f"{3 + i % 50} 9 10 11")
        while not job.done:
            engine.step([job])
        freed.append(weakref.ref(session.cache))
        sizes.append(engine.kv_bytes())
        del session, job
    assert len(engine.sessions) == 4 and engine.counters["evicted_sessions"] == 36
    assert sum(ref() is not None for ref in freed) == 4  # only the four kept sessions' caches live
    assert max(sizes[4:]) == sizes[3]  # flat once full
    budget_bytes = 2 * 2 * 512 * 16 * 4 * 2  # layers x (K, V) x budget x head_dim x fp32 x kv heads
    assert sizes[3] < 4 * budget_bytes / 4  # each session holds far less than its budget's worth
