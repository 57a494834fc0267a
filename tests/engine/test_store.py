"""Session snapshots (``SessionStore``): a session continued in another engine from its snapshot is the session
continued where it was, token for token; a stale, foreign or damaged snapshot is never used; the folder is bounded."""

import pytest

import sparsegen
from sparsegen.engine import Engine, Sampling
from sparsegen.engine.store import SessionStore
from sparsegen.kv import PolicySpec

FIRST = [{"role": "user", "content": "Tell me about the old house by the river."}]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return sparsegen.load("reference")  # (a tokenizer whose replies read back as the text it decoded)


def _engine(model_and_tokenizer, store: SessionStore | None, policy=PolicySpec("h2o", 24)) -> Engine:
    return Engine(*model_and_tokenizer, policy, chunk_size=16, store=store)


def _turn(engine: Engine, messages: list[dict], session: str = "s"):
    job = engine.begin(engine.session(session), Sampling(max_tokens=8), messages=messages)
    while not job.done:
        engine.step([job])
    engine.settle(job)
    return job


def _second(first) -> list[dict]:
    return FIRST + [{"role": "assistant", "content": "".join(first.shown)}, {"role": "user", "content": "And then?"}]


def test_a_session_continues_in_another_engine_from_its_snapshot_as_it_would_have_where_it_was(model_and_tokenizer,
                                                                                                 tmp_path):
    here = _engine(model_and_tokenizer, SessionStore(tmp_path, 1 << 30))
    first = _turn(here, FIRST)
    here.store.flush()
    snapshot = here.store.get("s", here.model)  # turn 1's (turn 2 writes over it)
    undisturbed = _turn(here, _second(first))
    elsewhere = _engine(model_and_tokenizer, SessionStore(tmp_path, 1 << 30))
    elsewhere.store.get = lambda *args: snapshot
    moved = _turn(elsewhere, _second(first))
    assert elsewhere.counters["restored_sessions"] == 1 and not moved.reencoded
    assert moved.cached_tokens == undisturbed.cached_tokens > 0 and moved.prompt_tokens == undisturbed.prompt_tokens
    assert moved.tokens == undisturbed.tokens
    without = _turn(_engine(model_and_tokenizer, None), _second(first))  # (no store: the history re-encoded)
    assert without.reencoded and without.cached_tokens == 0


def test_a_stale_foreign_or_damaged_snapshot_is_not_used(model_and_tokenizer, tmp_path):
    here = _engine(model_and_tokenizer, SessionStore(tmp_path, 1 << 30))
    first = _turn(here, FIRST)
    here.store.flush()
    # (each engine's background write of "s" is waited for before the next one reads the folder: a directory listed
    # while a snapshot is renamed over its name may miss it, and a late write would replace the damaged file below)
    elsewhere = _engine(model_and_tokenizer, SessionStore(tmp_path, 1 << 30))
    other = _turn(elsewhere, [{"role": "user", "content": "Something else entirely."}])  # not an extension
    elsewhere.store.flush()
    assert other.cached_tokens == 0
    streaming = _engine(model_and_tokenizer, SessionStore(tmp_path, 1 << 30), PolicySpec("streaming", 24))
    assert _turn(streaming, _second(first)).reencoded  # written under h2o: not restored into streaming
    streaming.store.flush()
    path = next(tmp_path.glob("*.safetensors"))
    path.write_bytes(path.read_bytes()[:100])
    damaged = _engine(model_and_tokenizer, SessionStore(tmp_path, 1 << 30))
    assert _turn(damaged, _second(first)).reencoded and damaged.counters["restored_sessions"] == 0


def test_the_folder_is_bounded_by_bytes(model_and_tokenizer, tmp_path):
    engine = _engine(model_and_tokenizer, SessionStore(tmp_path, 1))
    for session in "abc":
        _turn(engine, FIRST, session)
    engine.store.flush()
    assert len(list(tmp_path.glob("*.safetensors"))) == 1 and engine.store.counters["dropped"] == 2
    with pytest.raises(ValueError, match="at least 1 byte"):
        SessionStore(tmp_path, 0)
