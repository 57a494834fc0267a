import pytest
import torch

import sparsegen
from sparsegen.generation import generate
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.serve import ChatTemplate, Engine, Sampling
from sparsegen.serve.chat import chat
from tests.kv.families import VOCAB, tiny_model


@pytest.fixture(scope="module")
def reference():
    return sparsegen.load("reference")


def _run(engine, job):
    while not job.done:
        engine.step([job])
    return job


@pytest.mark.parametrize("policy,budget", [("full", None), ("streaming", 24), ("h2o", 24)])
def test_a_completion_equals_sparsegen_generate(reference, policy, budget):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, lambda: make_policy(policy, budget), chunk_size=16)
    prompt = "It was late in the evening when the old man came back to the house, and"
    job = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=24), prompt=prompt))
    expected = generate(model, tokenizer, prompt, policy=policy, budget=budget, max_new_tokens=24, chunk_size=16)
    assert job.content == expected.text and len(job.tokens) == expected.new_tokens[0]


@pytest.mark.parametrize("policy", ["full", "window", "streaming", "h2o", "streaming-h2o"])
def test_batched_decode_of_separate_sessions_equals_each_alone(policy):
    """Sessions at different lengths, stacked into one batch (joining and leaving at different steps), give the
    tokens each gives alone, and their caches come back as they would be."""
    model = tiny_model("llama")

    class Tokens:  # a stand-in tokenizer over space-separated ids
        eos_token_id, chat_template = None, None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [int(t) for t in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(f" {i}" for i in ids)

    engine = Engine(model, Tokens(), lambda: make_policy(policy, None if policy == "full" else 12), chunk_size=5)
    generator = torch.Generator().manual_seed(0)
    prompts = [" ".join(map(str, torch.randint(3, VOCAB, (n,), generator=generator).tolist())) for n in (7, 19, 3, 11)]
    limits = [10, 7, 4, 6]

    def start(i):
        return engine.begin(engine.session(None), Sampling(max_tokens=limits[i]), prompt=prompts[i])

    alone = [_run(engine, start(i)) for i in range(4)]
    jobs = [start(i) for i in range(3)]
    for _ in range(2):
        engine.step(jobs)
    jobs.append(start(3))  # joins a running batch; the others leave at different steps
    while not all(j.done for j in jobs):
        engine.step(jobs)
    for job, single in zip(jobs, alone):
        assert job.tokens == single.tokens
        mine, theirs = job.session.cache, single.session.cache
        assert mine.length == theirs.length and torch.equal(mine.seen, theirs.seen)
        for layer, other in zip(mine.layers, theirs.layers):
            assert layer.used == other.used
            for head in range(layer.index.shape[1]):
                held = lambda lay: sorted(lay.index[0, head, :lay.used][lay.valid[0, head, :lay.used]].tolist())  # noqa: E731
                assert held(layer) == held(other)


def test_a_soft_prompt_is_fed_once_per_session_and_positions_follow_it(reference):
    from sparsegen.prompt import PromptPrefix, attach, detach

    model, tokenizer = reference
    attach(model, PromptPrefix(torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))))
    try:
        engine = Engine(model, tokenizer, lambda: make_policy("h2o", 40), chunk_size=16)  # original positions
        prompt = "It was late in the evening when the old man came back to the house, and"
        job = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=20), prompt=prompt))
        expected = generate(model, tokenizer, prompt, policy="h2o", budget=40, max_new_tokens=20, chunk_size=16)
        assert job.content == expected.text
        assert job.session.cache.length == 6 + job.prompt_tokens + 19
    finally:
        detach(model)


def test_stacking_refuses_unfed_or_different_caches():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="fed cache"):
        EvictionCache.stacked(model, [EvictionCache(model, make_policy("window", 4))])
    fed = []
    for policy in ("window", "streaming"):
        fed.append(EvictionCache(model, make_policy(policy, 8)))
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=fed[-1])
    with pytest.raises(ValueError, match="same policy"):
        EvictionCache.stacked(model, fed)


def test_a_conversation_encodes_only_each_new_turn(reference):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, lambda: make_policy("streaming", 64), chunk_size=32)
    turns = chat(engine, Sampling(max_tokens=12), ["Hello there.", "What is the sea like?", "/stats", "Tell me more."],
                 out=open("/dev/null", "w"))
    assert len(turns) == 3 and not any(t["reencoded"] for t in turns)
    template = ChatTemplate(tokenizer)
    session = engine.sessions["chat"]
    whole = len(tokenizer(session.text)["input_ids"])
    assert sum(t["prompt_tokens"] + t["new_tokens"] for t in turns) <= whole + 3  # each token fed once
    assert turns[-1]["prompt_tokens"] < 16
    assert turns[-1]["kv_tokens"] == 64 and session.cache.length > 64
    assert template.render([{"role": "user", "content": "hi"}]) == "User: hi\nAssistant:"


def test_edited_history_or_an_evicted_session_starts_over(reference):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, lambda: make_policy("window", 48), chunk_size=32, max_sessions=1)
    first = [{"role": "user", "content": "Hello there."}]
    job = _run(engine, engine.begin(engine.session("a"), Sampling(max_tokens=6), messages=first))
    follow = first + [{"role": "assistant", "content": job.content}, {"role": "user", "content": "And then?"}]
    assert not _run(engine, engine.begin(engine.session("a"), Sampling(max_tokens=6), messages=follow)).reencoded
    edited = [{"role": "user", "content": "Something else."}] + follow[1:]
    assert _run(engine, engine.begin(engine.session("a"), Sampling(max_tokens=6), messages=edited)).reencoded
    engine.session("b")  # only one session is kept: "a" is dropped
    assert "a" not in engine.sessions and engine.counters["evicted_sessions"] == 1


def test_stop_strings_end_a_reply_and_are_not_shown(reference):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, lambda: make_policy("window", 64))
    free = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=20), prompt="The old man said that"))
    word = free.content.split()[2]
    shown = []
    job = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=20, stop=(word,)),
                                    prompt="The old man said that", on_text=lambda j, t: shown.append(t)))
    assert job.finish_reason == "stop" and word not in job.content
    assert "".join(shown) == job.content and free.content.startswith(job.content)


def test_chat_command_with_a_script(tmp_path, capsys):
    import json

    from sparsegen.cli import main

    script = tmp_path / "turns.txt"
    script.write_text("Good evening.\n\n/stats\nWhere is the ship?\n")
    assert main(["chat", "--model", "reference", "--budget", "32", "--max-new-tokens", "8", "--script", str(script),
                 "--json", str(tmp_path / "turns.json"), "--plot", str(tmp_path / "turns.png")]) == 0
    out = capsys.readouterr().out
    assert out.count("User: ") == 2 and "KV tokens held" in out
    turns = json.loads((tmp_path / "turns.json").read_text())["turns"]
    assert [t["turn"] for t in turns] == [1, 2] and not turns[1]["reencoded"]
    assert (tmp_path / "turns.png").stat().st_size > 0
