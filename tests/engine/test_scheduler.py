import pytest
import torch

import sparsegen
from sparsegen.engine import ChatTemplate, Engine, Sampling
from sparsegen.engine.generate import generate
from sparsegen.engine.prefill import prefill
from sparsegen.engine.warmup import warm_up
from sparsegen.kv import EvictionCache, PolicySpec, make_policy
from sparsegen.kv.policies import policy_class
from sparsegen.kv.rows import stack
from sparsegen.models.compat import cache_kwargs
from sparsegen.serve.chat import chat
from tests.engine.test_reconstruct import sharpened
from tests.kv.families import VOCAB, tiny_model
from tests.serve.ids import IdTokenizer


@pytest.fixture(scope="module")
def reference():
    return sparsegen.load("reference")


def _run(engine, job):
    while not job.done:
        engine.step([job])
    return job


@pytest.mark.parametrize("policy,budget", [("full", None), ("streaming", 24), ("h2o", 24), ("kvzip", 24),
                                           ("expected-attention", 24)])
def test_a_completion_equals_sparsegen_generate(reference, policy, budget):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, PolicySpec(policy, budget), chunk_size=16)
    prompt = "It was late in the evening when the old man came back to the house, and"
    job = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=24), prompt=prompt))
    expected = generate(model, tokenizer, prompt, policy=policy, budget=budget, max_new_tokens=24, chunk_size=16)
    assert job.content == expected.text and len(job.tokens) == expected.new_tokens[0]


@pytest.mark.parametrize("policy,kv_bits", [("full", None), ("window", None), ("streaming", None), ("h2o", None),
                                            ("streaming-h2o", None), ("h2o", 4), ("streaming", 8), ("adakv", None),
                                            ("scissorhands", 4), ("kvzip", None), ("expected-attention", None)])
@pytest.mark.parametrize("packed", [True, False])
def test_batched_decode_of_separate_sessions_equals_each_alone(policy, kv_bits, packed):
    """Sessions at different lengths, stacked into one batch (joining and leaving at different steps), give the
    tokens each gives alone, and their caches come back as they would be (quantized ones too); a prompt that
    arrives while they decode is encoded in their steps' forwards (``packed``) or in forwards of its own (a
    session's first prompt under a policy that compresses it whole, KVzip's, always)."""
    _assert_batched_sessions_equal_each_alone(policy, kv_bits, packed)


@pytest.mark.heavy
@pytest.mark.parametrize("policy,kv_bits", [("full", None), ("streaming", None), ("h2o", 4), ("snapkv", None)])
def test_compiled_batched_decode_takes_the_fixed_step_and_equals_each_alone(policy, kv_bits, compiled_step_batches):
    """``serve --compile``: the stacked rows (different lengths, joining and leaving) decode through the compiled
    fixed-shape step and give the tokens each session gives alone, uncompiled."""
    _assert_batched_sessions_equal_each_alone(policy, kv_bits, packed=True, compile=True)
    assert max(compiled_step_batches) == 3  # (stacked rows: the batch of three, then four less those that left)


def _assert_batched_sessions_equal_each_alone(policy: str, kv_bits, packed: bool, compile: bool = False) -> None:
    model = tiny_model("llama")

    def engine_of(compile: bool) -> Engine:
        return Engine(model, IdTokenizer(), PolicySpec.sharing(policy, 12, kv_bits=kv_bits),
                      chunk_size=5, packed_prefill=packed, compile=compile)

    engine, single_engine = engine_of(compile), engine_of(False)
    generator = torch.Generator().manual_seed(0)
    prompts = [" ".join(map(str, torch.randint(3, VOCAB, (n,), generator=generator).tolist())) for n in (7, 19, 3, 11)]
    limits = [10, 7, 4, 6]

    def start(i, on=engine):
        return on.begin(on.session(None), Sampling(max_tokens=limits[i]), prompt=prompts[i])

    alone = [_run(single_engine, start(i, single_engine)) for i in range(4)]
    jobs = [start(i) for i in range(3)]
    for _ in range(2):
        engine.step(jobs)
    jobs.append(start(3))  # joins a running batch; the others leave at different steps
    while not all(j.done for j in jobs):
        engine.step(jobs)
    # (the fourth prompt, 11 tokens, came in 3 chunks)
    assert (engine.counters["packed_steps"] > 0) == (packed and not policy_class(policy).compresses_whole)
    for job, single in zip(jobs, alone):
        assert job.tokens == single.tokens
        mine, theirs = job.session.cache, single.session.cache
        assert mine.length == theirs.length and torch.equal(mine.seen, theirs.seen)
        for layer, other in zip(mine.layers, theirs.layers):
            assert layer.used == other.used
            if kv_bits:  # the residual holds the same tokens (their keys as computed in a batch: to rounding)
                real = layer.ring_index[:, :-1]  # (the last ring slot takes other tokens' writes)
                assert torch.equal(real, other.ring_index[:, :-1])
                torch.testing.assert_close(layer.ring_keys[:, :, :-1], other.ring_keys[:, :, :-1])
                torch.testing.assert_close(layer.key_channels, other.key_channels)
            for head in range(layer.index.shape[1]):
                held = lambda lay: sorted(lay.index[0, head, :lay.used][lay.valid[0, head, :lay.used]].tolist())  # noqa: E731
                assert held(layer) == held(other)


def test_a_soft_prompt_is_fed_once_per_session_and_positions_follow_it(reference):
    from sparsegen.prompt import PromptPrefix, attach, detach

    model, tokenizer = reference
    attach(model, PromptPrefix(torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))))
    try:
        engine = Engine(model, tokenizer, PolicySpec("h2o", 40), chunk_size=16)  # original positions
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
        stack(model, [EvictionCache(model, make_policy("window", 4))])
    fed = []
    for policy in ("window", "streaming"):
        fed.append(EvictionCache(model, make_policy(policy, 8)))
        model(input_ids=torch.tensor([[5, 6, 7]]), **cache_kwargs(fed[-1]))
    with pytest.raises(ValueError, match="same policy"):
        stack(model, fed)
    model = sharpened(tiny_model("llama"))
    shared = EvictionCache(model, make_policy("kvzip-global", 12))
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    prefill(model, shared, ids, torch.ones_like(ids), 16)
    assert len({layer.policy.budget for layer in shared.layers}) > 1
    with pytest.raises(ValueError, match="batch's budgets"):  # (each layer's share of its own context's scores)
        stack(model, [shared])


def test_a_server_refuses_a_policy_whose_layer_budgets_differ_by_conversation(reference):
    model, tokenizer = reference
    with pytest.raises(ValueError, match="cannot decode in one batch: serve kvzip-heads"):
        Engine(model, tokenizer, PolicySpec("kvzip-global", 16))


def test_a_conversation_encodes_only_each_new_turn(reference):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, PolicySpec("streaming", 64), chunk_size=32)
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


def test_a_fractional_budget_is_that_share_of_the_longest_conversation(reference):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, PolicySpec("h2o", 0.25), chunk_size=32, max_context=256)
    assert engine.policy.budget == 64 and engine.new_cache().policy.budget == 64
    job = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=8), prompt="word " * 120))
    assert job.session.cache.length > 120 and max(job.session.cache.held_tokens()) <= 64
    default = Engine(model, tokenizer, PolicySpec("h2o", 0.25), chunk_size=32)  # of the model's context length
    assert default.policy.budget == round(0.25 * model.config.max_position_embeddings)
    spec = PolicySpec("streaming", 0.5)
    with pytest.raises(ValueError, match="give --max-context TOKENS"):
        spec.fixed(None)
    assert spec.fixed(100).budget == 50 and PolicySpec("streaming", 40).fixed(None).budget == 40


def test_edited_history_or_an_evicted_session_starts_over(reference):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, PolicySpec("window", 48), chunk_size=32, max_sessions=1)
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
    engine = Engine(model, tokenizer, PolicySpec("window", 64))
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


def test_a_long_prompt_is_encoded_a_chunk_per_step_while_other_replies_decode(reference):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, PolicySpec("streaming", 64), chunk_size=16)
    short = engine.begin(engine.session(None), Sampling(max_tokens=6), prompt="The sea")
    long_prompt = "It was late in the evening when the old man came back. " * 12
    long = engine.begin(engine.session(None), Sampling(max_tokens=4), prompt=long_prompt)
    chunks = -(-long.prompt_tokens // 16)
    assert chunks >= 6
    steps = 0
    while not short.done:
        engine.step([short, long])
        steps += 1
    assert steps < chunks and long.feed and not long.tokens  # the short reply finished during the long prefill
    alone = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=4), prompt=long_prompt))
    assert _run(engine, long).tokens == alone.tokens


def test_a_cancelled_prefill_frees_its_session_and_the_session_starts_over(reference):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, PolicySpec("window", 64), chunk_size=8)
    session = engine.session("s")
    job = engine.begin(session, Sampling(max_tokens=4), prompt="It was late in the evening when the old man came.")
    engine.step([job])
    engine.cancel(job)
    assert job.finish_reason == "cancelled" and not session.busy and session.text == "" and session.cache.length == 0


def test_prompt_token_limit_and_bad_text_are_refused_before_any_work(reference):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, PolicySpec("window", 64), max_prompt_tokens=8)
    session = engine.session("s")
    with pytest.raises(ValueError, match="over this server's limit of 8"):
        engine.begin(session, Sampling(), prompt="one two three four five six seven eight nine ten eleven")
    with pytest.raises(ValueError, match="lone surrogate"):
        engine.begin(session, Sampling(), messages=[{"role": "user", "content": "a\ud800b"}])
    assert not session.busy and engine.counters["requests"] == 0


@pytest.mark.parametrize("temperature", [5e-324, 2.4e-38, 1e-300])
def test_a_tiny_temperature_is_greedy(reference, temperature):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, PolicySpec("window", 64))
    greedy = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=8), prompt="The sea"))
    tiny = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=8, temperature=temperature),
                                     prompt="The sea"))
    assert tiny.finish_reason == "length" and tiny.tokens == greedy.tokens


@pytest.mark.parametrize("bad", [dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=0),
                                 dict(top_p=float("nan")), dict(seed=2**70), dict(seed=-1), dict(max_tokens=0),
                                 dict(temperature=True)])
def test_sampling_settings_are_checked(bad):
    with pytest.raises(ValueError):
        Sampling(**bad)


def test_one_failing_reply_in_a_batched_step_fails_only_itself(reference, monkeypatch):
    import sparsegen.engine.scheduler as engine_module

    model, tokenizer = reference
    engine = Engine(model, tokenizer, PolicySpec("window", 64))
    good = engine.begin(engine.session("good"), Sampling(max_tokens=8), prompt="The sea")
    bad = engine.begin(engine.session("bad"), Sampling(max_tokens=8, temperature=0.5), prompt="The sea")
    engine.step([good, bad])
    engine.step([good, bad])
    original = engine_module.next_token

    def fails_when_sampling(logits, temperature, top_p, generator):
        if temperature > 0:
            raise RuntimeError("probability tensor contains either inf, nan")
        return original(logits, temperature, top_p, generator)

    monkeypatch.setattr(engine_module, "next_token", fails_when_sampling)
    while not good.done:
        engine.step([good, bad])
    assert bad.finish_reason == "error" and "inf, nan" in bad.error and not engine.sessions["bad"].busy
    assert engine.sessions["bad"].cache.length == 0  # its session starts over
    monkeypatch.setattr(engine_module, "next_token", original)
    alone = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=8), prompt="The sea"))
    assert good.finish_reason == "length" and good.tokens == alone.tokens


def test_a_reply_cut_at_a_stop_string_leaves_the_session_extendable(reference):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, PolicySpec("window", 4096), chunk_size=32)
    messages = [{"role": "user", "content": "Tell me about the old house."}]
    free = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=24), messages=messages))
    stop = free.content.split()[3]
    session = engine.session("s")
    first = _run(engine, engine.begin(session, Sampling(max_tokens=24, stop=(stop,)), messages=messages))
    assert first.finish_reason == "stop" and stop not in first.content
    # the cache holds exactly the session's text: the reply's tokens past the cut were forgotten
    assert session.cache.length == len(tokenizer(session.text)["input_ids"]) and session.pending == []
    follow = messages + [{"role": "assistant", "content": first.content}, {"role": "user", "content": "And then?"}]
    second = _run(engine, engine.begin(session, Sampling(max_tokens=4, stop=(stop,)), messages=follow))
    assert not second.reencoded and engine.counters["reencoded_sessions"] == 0
    assert second.prompt_tokens <= len(tokenizer("\nUser: And then?\nAssistant:", add_special_tokens=False)
                                       ["input_ids"]) + 1


def test_stop_strings_are_searched_only_in_new_text():
    from sparsegen.engine.session import held_back

    assert held_back("the end is nea", ("near", "x")) == 3 and held_back("abc", ("zzz",)) == 0
    assert held_back("ab", ("abab",)) == 2 and held_back("aba", ("abab",)) == 3



@pytest.mark.parametrize("reply", [" plain", "  two spaces", " \nnewline", "\nno space", " "])
def test_a_reply_sent_back_renders_as_the_text_the_cache_holds(reference, reply):
    from sparsegen.engine.session import template_space

    content = reply[template_space(reply):]
    rendered = ChatTemplate(reference[1]).render([{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": content}])
    assert rendered.startswith("User: hi\nAssistant:" + reply + "\n")


def _speculating(model, tokenizer, draft="window:6", k=3, **kw):
    from sparsegen.engine.speculative import Speculation, draft_policy

    return Engine(model, tokenizer, PolicySpec("full"), chunk_size=kw.pop("chunk_size", 16),
                  speculation=lambda: Speculation(draft_policy(draft), k), **kw)


def test_speculative_conversations_equal_full_ones_alone_and_batched(reference):
    """Two sessions, three turns each, replies decoding together and then alone: the same tokens and the same session
    caches as an engine without speculation; drafts were accepted."""
    model, tokenizer = reference
    plain = Engine(model, tokenizer, PolicySpec("full"), chunk_size=16, max_batch=4)
    drafted = _speculating(model, tokenizer, "streaming:12", max_batch=4)
    turns = ["Hello there.", "What is the sea like?", "Tell me more."]
    results = {}
    for engine in (plain, drafted):
        history = {"a": [], "b": []}
        replies = []
        for turn in turns:
            jobs = []
            for name, limit in (("a", 14), ("b", 6)):  # b finishes first: a then decodes alone
                history[name].append({"role": "user", "content": turn})
                jobs.append(engine.begin(engine.session(name), Sampling(max_tokens=limit), messages=history[name]))
            while not all(job.done for job in jobs):
                engine.step(jobs)
            for name, job in zip("ab", jobs):
                history[name].append({"role": "assistant", "content": job.content})
                replies.append((job.tokens, job.reencoded))
        results[engine is drafted] = (replies, [(s.cache.length, s.text, s.pending) for s in engine.sessions.values()])
    assert results[True] == results[False]
    assert drafted.counters["accepted_tokens"] > 0 and drafted.counters["drafted_tokens"] > 0


def test_a_speculative_reply_cut_at_a_stop_string_forgets_what_follows(reference):
    """Stops that fall inside a round's accepted drafts as well as on its last token: the caches hold exactly the
    session's text, and the next turn continues as in a session that never speculated."""
    model, tokenizer = reference
    engine = _speculating(model, tokenizer, "window:2000", k=6, chunk_size=32)  # drafts the full cache accepts
    messages = [{"role": "user", "content": "Tell me about the old house."}]
    free = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=24), messages=messages))
    for i, stop in enumerate(free.content.split()[1:6]):
        session = engine.session(f"s{i}")
        first = _run(engine, engine.begin(session, Sampling(max_tokens=24, stop=(stop,)), messages=messages))
        assert first.finish_reason == "stop" and free.content.startswith(first.content)
        held = len(tokenizer(session.text)["input_ids"])
        assert session.cache.length == held and session.draft.length + len(session.draft_lag) == held, stop
        follow = messages + [{"role": "assistant", "content": first.content}, {"role": "user", "content": "And?"}]
        second = _run(engine, engine.begin(session, Sampling(max_tokens=8), messages=follow))
        alone = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=8), messages=follow))
        assert not second.reencoded and second.tokens == alone.tokens


def test_speculation_needs_the_full_cache_and_a_fixed_draft_length(reference):
    from sparsegen.engine.speculative import Speculation

    model, tokenizer = reference
    with pytest.raises(ValueError, match="--policy full"):
        Engine(model, tokenizer, PolicySpec("streaming", 64),
               speculation=lambda: Speculation(make_policy("window", 8), 4))
    with pytest.raises(ValueError, match="--draft-tokens K"):
        Engine(model, tokenizer, PolicySpec("full"),
               speculation=lambda: Speculation(make_policy("window", 8), "auto"))


def test_chat_command_speculates_with_the_full_caches_replies(tmp_path, capsys):
    import json

    from sparsegen.cli import main

    script = tmp_path / "turns.txt"
    script.write_text("Good evening.\nWhere is the ship?\n")
    replies = {}
    for extra in ([], ["--speculative", "streaming:16", "--draft-tokens", "3"]):
        out = tmp_path / f"turns{len(extra)}.json"
        assert main(["chat", "--model", "reference", "--policy", "full", "--max-new-tokens", "10", "--script",
                     str(script), "--json", str(out), *extra]) == 0
        replies[bool(extra)] = capsys.readouterr().out
        assert len(json.loads(out.read_text())["turns"]) == 2
    assert replies[True] == replies[False]
    assert main(["chat", "--model", "reference", "--speculative", "streaming:16", "--script", str(script)]) == 2
    assert "--policy full" in capsys.readouterr().err


@pytest.mark.parametrize("at_step", [1, 7])  # inside the prompt, inside the reply
def test_ctrl_c_in_chat_stops_the_reply_and_the_conversation_goes_on(reference, monkeypatch, at_step):
    import io

    model, tokenizer = reference
    engine = Engine(model, tokenizer, PolicySpec("streaming", 64), chunk_size=4)
    step, calls = engine.step, []

    def interrupted(jobs):
        calls.append(1)
        if len(calls) == at_step:
            raise KeyboardInterrupt
        step(jobs)

    monkeypatch.setattr(engine, "step", interrupted)
    out = io.StringIO()
    turns = chat(engine, Sampling(max_tokens=6), ["Tell me a long story about the sea.", "And then?"], out=out)
    assert "[interrupted]" in out.getvalue()
    answered = 2 if at_step == 7 else 1  # a question interrupted before any text is dropped from the conversation
    assert len(turns) == answered and turns[-1]["new_tokens"] == 6
    assert turns[-1]["reencoded"] == (at_step == 7)  # the interrupted step left its cache in doubt: encoded again
    assert not engine.sessions["chat"].busy and engine._batch is None


def _encoded_per_step(engine, short, prompt_tokens: int) -> list[int]:
    """Prompt tokens each step encodes of a new ``prompt_tokens``-token prompt while ``short`` decodes."""
    long = engine.begin(engine.session(None), Sampling(max_tokens=2), prompt=" ".join(["9"] * prompt_tokens))
    encoded = []
    while long.feed:
        before = engine.counters["prefill_tokens"]
        engine.step([short, long])
        encoded.append(engine.counters["prefill_tokens"] - before)
    return encoded


def test_a_packed_step_that_fails_midway_fails_its_replies_and_their_sessions_start_over(monkeypatch):
    """A forward that fails after some layers wrote (a packed step's rows and chunk alike are then in doubt) ends
    every reply in it with an error; the engine goes on, and the same sessions then answer as fresh ones would."""
    from sparsegen.kv.packed import PackedLayer

    model = tiny_model("llama")
    engine = Engine(model, IdTokenizer(), PolicySpec("h2o", 24), chunk_size=4)
    jobs = [engine.begin(engine.session(f"s{i}"), Sampling(max_tokens=12), prompt="5 6 7") for i in range(2)]
    engine.step(jobs)
    engine.step(jobs)  # both decoding, in one batch
    late = engine.begin(engine.session("late"), Sampling(max_tokens=12), prompt=" ".join(["9"] * 10))
    update = PackedLayer.update

    def fails_at_the_second_layer(layer, *args, **kwargs):
        if layer.layer_idx == 1:
            raise RuntimeError("the device fell over")
        return update(layer, *args, **kwargs)

    monkeypatch.setattr(PackedLayer, "update", fails_at_the_second_layer)
    engine.step(jobs + [late])
    assert all(job.finish_reason == "error" and "fell over" in job.error for job in jobs + [late])
    assert engine._batch is None and not any(session.busy for session in engine.sessions.values())
    monkeypatch.setattr(PackedLayer, "update", update)
    fresh = Engine(model, IdTokenizer(), PolicySpec("h2o", 24), chunk_size=4)
    for name, prompt in (("s0", "5 6 7"), ("late", " ".join(["9"] * 10))):
        again, alone = (_run(e, e.begin(e.session(name), Sampling(max_tokens=12), prompt=prompt))
                        for e in (engine, fresh))
        assert again.finish_reason == "length" and again.tokens == alone.tokens


def test_a_long_prompt_encodes_at_most_the_prefill_budget_per_step_while_others_decode():
    model = tiny_model("llama")
    engine = Engine(model, IdTokenizer(), PolicySpec("h2o", 24), chunk_size=16, prefill_budget=4)
    short = engine.begin(engine.session(None), Sampling(max_tokens=30), prompt="5 6 7")
    engine.step([short])  # its prompt, alone: a whole chunk
    assert _encoded_per_step(engine, short, 40) == [4] * 10  # short decoded meanwhile: 4 tokens a step, not 16
    with pytest.raises(ValueError, match="prefill_budget must be between 1 and the chunk size"):
        Engine(model, IdTokenizer(), PolicySpec("h2o", 24), chunk_size=16, prefill_budget=32)


def test_an_auto_prefill_budget_settles_where_a_chunk_costs_one_decode_step():
    from sparsegen.engine.prefill import PrefillBudget

    budget = PrefillBudget(chunk_size=256)
    assert budget.tokens == 16
    budget.encoded(16, 0.4)  # nothing decoded yet: nothing to compare with
    assert budget.tokens == 16
    budget.decoded(0.1)
    budget.encoded(16, 0.4)  # 4x a step: at most halved at once
    assert budget.tokens == 8
    budget.encoded(8, 0.08)  # 0.8x a step
    assert budget.tokens == 10
    for _ in range(20):  # cheap chunks grow it, doubling at most, up to the chunk size
        budget.encoded(budget.tokens, 0.001)
    assert budget.tokens == 256
    for _ in range(20):  # a chunk that costs 4 steps however small: one token, never none
        budget.encoded(budget.tokens, 0.4)
    assert budget.tokens == 1
    budget.decoded(0.6)  # slower steps (a bigger batch): a moving average, 0.1 -> 0.2
    assert budget.step_seconds == pytest.approx(0.2)


def test_the_engine_feeds_an_auto_budget_what_its_chunks_and_steps_cost():
    model = tiny_model("llama")
    engine = Engine(model, IdTokenizer(), PolicySpec("h2o", 24), chunk_size=16, prefill_budget="auto")
    seen = []
    engine._budget.encoded = lambda tokens, seconds: seen.append(("chunk", tokens))
    engine._budget.tokens = 5
    short = engine.begin(engine.session(None), Sampling(max_tokens=30), prompt="5 6 7")
    engine.step([short])  # its prompt, alone: a whole chunk, not the budget's business
    assert seen == [] and engine._budget.step_seconds > 0  # (then it decoded its first step)
    assert _encoded_per_step(engine, short, 12) == [5, 5, 2]  # the last, short chunk teaches nothing
    assert seen == [("chunk", 5), ("chunk", 5)]
    for bad in (0, 17, "fast"):
        with pytest.raises(ValueError, match="or 'auto'"):
            Engine(model, IdTokenizer(), PolicySpec("h2o", 24), chunk_size=16, prefill_budget=bad)


def test_an_auto_budget_riding_in_decode_steps_lets_every_ninth_decode_alone():
    """Chunks in the others' steps leave no step without one to time, so every REFRESH-th step decodes alone: the
    step time the budget aims at stays the present batch's."""
    model = tiny_model("llama")
    engine = Engine(model, IdTokenizer(), PolicySpec("h2o", 24), chunk_size=16, prefill_budget="auto")
    engine._budget.encoded = lambda tokens, seconds: None  # (the size stays put)
    engine._budget.tokens = 2
    short = engine.begin(engine.session(None), Sampling(max_tokens=40), prompt="5 6 7")
    engine.step([short])
    assert _encoded_per_step(engine, short, 34) == [2] * 8 + [0] + [2] * 8 + [0] + [2]
    assert engine.counters["packed_steps"] == 17


def test_ignore_eos_decodes_max_tokens_past_an_end_of_sequence():
    model = tiny_model("llama")
    tokenizer = IdTokenizer()
    engine = Engine(model, tokenizer, PolicySpec("h2o", 24), chunk_size=16)
    first = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=6), prompt="5 6 7"))
    tokenizer.eos_token_id = first.tokens[0]  # the model's first reply token now ends a reply
    stopped = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=6), prompt="5 6 7"))
    kept_going = _run(engine, engine.begin(engine.session(None), Sampling(max_tokens=6, ignore_eos=True),
                                           prompt="5 6 7"))
    assert stopped.tokens == first.tokens[:1] and stopped.finish_reason == "stop"
    assert kept_going.tokens == first.tokens and kept_going.finish_reason == "length"


@pytest.mark.parametrize("mode", ["regional", "whole"])
@pytest.mark.parametrize("policy", ["streaming", "h2o", "full"])
def test_a_warm_up_compiles_every_graph_that_traffic_then_meets(policy, mode, monkeypatch):
    """``serve`` warms up before ``/health`` says ok: afterwards, replies alone and stacked at every batch size up to
    ``max_batch`` (joining and leaving) compile nothing more, and the warm-up leaves no session and no count. Two
    graphs: a lone cache's and a stacked batch's of any size (a lone row leaves the batch, so no batch of one row
    has a graph of its own). (An unbounded policy's slots are one shape with ``max_context``.)"""
    import sparsegen.engine.step as decoding

    graphs = []

    def count(graph, inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    compiled = torch.compile(decoding._step, fullgraph=True, backend=count)
    block = torch.compile(decoding.run_block, fullgraph=True, backend=count)
    monkeypatch.setattr(decoding, "_compiled_step", lambda cuda_graphs: compiled)
    monkeypatch.setattr(decoding, "_compiled_block", lambda: block)
    engine = Engine(tiny_model("llama"), IdTokenizer(), PolicySpec(policy, None if policy == "full" else 12),
                    chunk_size=5, max_batch=4, compile=mode, max_context=64 if policy == "full" else None)
    warm_up(engine, rows=3)
    warmed = len(graphs)
    assert warmed == 2 and engine.counters["requests"] == 0 and not engine.sessions and engine.kv_bytes() == 0
    generator = torch.Generator().manual_seed(1)
    prompts = [" ".join(map(str, torch.randint(3, VOCAB, (n,), generator=generator).tolist())) for n in (9, 4, 15, 6)]
    jobs = [engine.begin(engine.session(f"s{i}"), Sampling(max_tokens=4 + 3 * i), prompt=p)
            for i, p in enumerate(prompts)]
    while not all(job.done for job in jobs):
        engine.step(jobs)
    alone = engine.begin(engine.session("s0"), Sampling(max_tokens=5), prompt=prompts[0] + " 7 8")
    _run(engine, alone)
    assert len(graphs) == warmed, f"{len(graphs) - warmed} graphs compiled during traffic"
