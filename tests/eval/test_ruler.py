import json
import re
from collections import Counter

import pytest
import torch

import sparsegen
from sparsegen.cli import main
from sparsegen.data import data_dir
from sparsegen.engine.generate import generate_tokens
from sparsegen.eval import ruler
from sparsegen.kv import PolicySpec, make_policy

BOOK = data_dir() / "books" / "test" / "great_expectations.txt"


@pytest.fixture(scope="module")
def haystack(tiny_tokenizer):
    return ruler.Haystack(tiny_tokenizer, BOOK.read_text()[:60_000])


@pytest.fixture(scope="module")
def book_slice(tmp_path_factory):
    path = tmp_path_factory.mktemp("hay") / "slice.txt"
    path.write_text(BOOK.read_text()[:60_000])
    return path


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_every_task_fills_its_length_and_its_context_holds_the_answers(haystack, task):
    samples = ruler.make_samples(haystack, task, 1500, 3)  # (the test tokenizer spends ~4 tokens a word)
    decode = haystack.tokenizer.decode
    for sample in samples:
        assert 0.8 * 1500 <= len(sample.ids) <= 1500 and 0 < sample.context_tokens < len(sample.ids)
        context, question = decode(sample.ids[:sample.context_tokens]), decode(sample.ids[sample.context_tokens:])
        if task in ("cwe", "fwe"):  # the answers are the most common words, above every other
            counts = Counter(re.findall(r"[a-z]+", context.split("\n", 1)[1] if task == "cwe" else context))
            others = max(n for w, n in counts.items() if w not in sample.answers and len(w) >= 4)
            assert min(counts[a] for a in sample.answers) > others
        else:
            assert all(answer in context and answer not in question for answer in sample.answers)
    assert ruler.make_samples(haystack, task, 1500, 3)[2].ids == samples[2].ids  # seeded
    assert ruler.make_samples(haystack, task, 1500, 3, seed=1)[2].ids != samples[2].ids


def test_the_queried_needle_sits_at_its_depth_of_the_haystack(haystack):
    where = []
    for depth in (0.0, 0.5, 1.0):
        sample = ruler.make_samples(haystack, "niah_single_2", 4000, 1, depths=[depth])[0]
        text = haystack.tokenizer.decode(sample.ids[:sample.context_tokens])
        hay = text[text.index("afterwards.") + len("afterwards."):]
        where.append(hay.index(sample.answers[0]) / len(hay))
    assert where[0] < 0.05 and 0.45 < where[1] < 0.55 and where[2] > 0.95


def test_multi_needle_tasks_ask_for_every_queried_value(haystack):
    multivalue = ruler.make_samples(haystack, "niah_multivalue", 1500, 1)[0]
    multiquery = ruler.make_samples(haystack, "niah_multiquery", 1500, 1)[0]
    assert len(multivalue.answers) == 4 and len(multiquery.answers) == 4
    assert haystack.tokenizer.decode(multiquery.ids[multiquery.context_tokens:]).count(" and ") >= 1


def test_rulers_string_match():
    assert ruler.score("The numbers are 123 and 456.", ["123", "789"]) == 0.5
    assert ruler.score("ANSWER: Abc-Def", ["abc-def"]) == 1.0


def test_bad_requests(haystack, tiny_tokenizer):
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.make_samples(haystack, "qa_1", 600, 1)
    with pytest.raises(ValueError, match="depths"):
        ruler.make_samples(haystack, "niah_single_1", 1500, 1, depths=[1.5])
    with pytest.raises(ValueError, match="cannot hold"):
        ruler.make_samples(haystack, "niah_multikey_1", 300, 1)
    with pytest.raises(ValueError, match="distinct plain words"):
        ruler.Haystack(tiny_tokenizer, "only a few words here")


def _count_forwards(monkeypatch) -> list[int]:
    """The tokens of every forward into a cache, prefill chunks and decode steps alike, in order."""
    import sparsegen.engine.prefill
    import sparsegen.engine.step

    fed, forward = [], sparsegen.engine.step.forward

    def counted(model, cache, ids, *args, **kwargs):
        fed.append(ids.shape[1])
        return forward(model, cache, ids, *args, **kwargs)

    for module in (sparsegen.engine.step, sparsegen.engine.prefill):
        monkeypatch.setattr(module, "forward", counted)
    return fed


def test_the_context_protocol_encodes_the_context_in_one_pass_and_keeps_the_full_caches_answer(
        tiny_checkpoint, monkeypatch):
    model, _ = sparsegen.load(tiny_checkpoint)
    ids = torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(0))
    fed = _count_forwards(monkeypatch)
    outputs = [generate_tokens(model, ids, torch.ones_like(ids), make_policy("full"), max_new_tokens=6,
                               chunk_size=64, first_chunk=first)[0] for first in (None, 250)]
    assert fed[:5] == [64, 64, 64, 64, 44] and fed[5 + 5:][:2] == [250, 50]  # (5 decode steps between)
    assert torch.equal(*outputs)


def test_query_aware_encodes_the_whole_prompt_question_included_in_one_pass(tiny_checkpoint, monkeypatch):
    """SnapKV's own setting: the compression's scores see the question, so the first pass is the whole prompt (the
    context protocol's is the context alone); a budget of a share of the context keeps as many tokens either way."""
    model, tokenizer = sparsegen.load(tiny_checkpoint)
    sample = ruler.make_samples(ruler.Haystack(tokenizer, BOOK.read_text()[:60_000]), "niah_single_1", 600, 1)[0]
    fed = _count_forwards(monkeypatch)
    answers = {}
    for protocol in ("context", "query-aware", "stream"):
        fed.clear()
        for policy in ("full", "snapkv"):
            result, = ruler.evaluate(model, tokenizer, [sample],
                                     PolicySpec.sharing(policy, 0.25), protocol,
                                     chunk_size=128, max_new_tokens=3, progress=False)
            answers[protocol, policy] = result["answer"]
        first = {"context": sample.context_tokens, "query-aware": len(sample.ids), "stream": 128}[protocol]
        assert fed[0] == first, (protocol, fed)
    assert answers["query-aware", "full"] == answers["stream", "full"] == answers["context", "full"]


def test_cli_rows_per_policy_protocol_task_and_length(tiny_checkpoint, book_slice, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["ruler", "--model", str(tiny_checkpoint), "--haystack", str(book_slice), "--tasks",
                 "niah_single_1,vt", "--length", "600", "--samples", "2", "--policies", "full,streaming",
                 "--budget", "0.5", "--protocol", "stream,context", "--max-new-tokens", "3", "--chunk-size", "64",
                 "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["policy"], r["protocol"], r["task"]) for r in rows] == [
        (p, protocol, t) for p in ("full", "streaming") for protocol in ("stream", "context")
        for t in ("niah_single_1", "vt")]
    assert all(0 <= r["score"] <= 1 and r["length"] == 600 and len(r["samples"]) == 2 for r in rows)
    streaming = [r for r in rows if r["policy"] == "streaming"]
    assert all(r["budget"] < 300 for r in streaming)
    # streamed: never more than the budget (half the context) and a chunk; the context protocol holds the whole
    # context, once
    peak = {(r["protocol"], r["task"]): r["kv_tokens_peak"] for r in streaming}
    assert all(peak["stream", t] <= 600 // 2 + 64 < peak["context", t] for t in ("niah_single_1", "vt")), peak
    full = {(r["protocol"], r["task"]): [s["answer"] for s in r["samples"]] for r in rows if r["policy"] == "full"}
    assert all(full["stream", task] == full["context", task] for task in ("niah_single_1", "vt"))
    assert rows[0]["depths"] and rows[1]["depths"] is None
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "| full | all | stream | 600 |" in capsys.readouterr().out
    assert main(["ruler", "--model", str(tiny_checkpoint), "--haystack", str(book_slice), "--protocol", "once"]) == 2
    assert "--protocol takes stream, context" in capsys.readouterr().err
    assert main(["ruler", "--model", str(tiny_checkpoint), "--haystack", str(book_slice), "--tasks", "qa_1"]) == 2
    assert "unknown RULER task(s) qa_1" in capsys.readouterr().err


@pytest.mark.heavy
def test_cli_compile_answers_through_the_compiled_step_as_eager_does(tiny_checkpoint, book_slice, tmp_path,
                                                                      monkeypatch):
    """``--compile``: every answer token through the compiled decode step (one graph with the eviction), the eager
    answers."""
    import sparsegen.engine.step as decoding

    compiled = []
    step = decoding.DecodeStep.__call__
    monkeypatch.setattr(decoding.DecodeStep, "__call__",
                        lambda self, *a: compiled.append(self.compiled) or step(self, *a))
    answers = {}
    for flags in ([], ["--compile"]):
        out = tmp_path / f"r{len(flags)}.json"
        assert main(["ruler", "--model", str(tiny_checkpoint), "--haystack", str(book_slice), "--tasks",
                     "niah_single_1", "--length", "600", "--samples", "2", "--policies", "streaming", "--budget", "0.5",
                     "--protocol", "context", "--max-new-tokens", "4", "--json", str(out), *flags]) == 0
        answers[bool(flags)] = [s["answer"] for s in json.loads(out.read_text())["rows"][0]["samples"]]
        assert compiled and set(compiled) == {bool(flags)}
        compiled.clear()
    assert answers[True] == answers[False]


def test_context_once_holds_the_question_and_answer(tiny_checkpoint):
    """kvpress's exact protocol: the context compressed once to the budget, nothing evicted after (the cache grows by
    the question and the answer); ``context`` holds the budget throughout."""
    import torch

    import sparsegen
    from sparsegen.engine.generate import generate_tokens
    from sparsegen.kv import make_policy

    model, tokenizer = sparsegen.load(tiny_checkpoint)
    ids = torch.tensor([tokenizer("it was the best of times, it was the worst of times " * 6)["input_ids"]])
    context = ids.shape[1] - 6
    runs = {hold: generate_tokens(model, ids, torch.ones_like(ids), make_policy("knorm", 16), max_new_tokens=5,
                                  first_chunk=context, hold_after_first=hold)[2] for hold in (False, True)}
    assert runs[False]["kv_tokens"] == 16
    assert runs[True]["kv_tokens"] == 16 + 6 + 4  # the compressed context, the question, the answer's fed tokens
    full = generate_tokens(model, ids, torch.ones_like(ids), make_policy("full"), max_new_tokens=5)[0]
    once = generate_tokens(model, ids, torch.ones_like(ids), make_policy("knorm", context), max_new_tokens=5,
                           first_chunk=context, hold_after_first=True)[0]
    assert torch.equal(once, full)  # a budget that holds the whole context: the model's own tokens
    with pytest.raises(ValueError, match="protocol must be one of"):
        ruler.evaluate(model, tokenizer, [], PolicySpec(), protocol="twice")


def test_query_aware_once_compresses_the_whole_prompt_once_then_holds(tiny_checkpoint):
    """kvpress's ``compress_questions``: the prompt, question included, compressed once in one pass, then nothing
    evicted (the cache grows by the answer); ``query-aware`` holds the budget through the answer. Both compress the
    same, so their first answer token is the same."""
    import torch

    import sparsegen
    from sparsegen.engine.generate import generate_tokens
    from sparsegen.eval.protocols import protocol_feed
    from sparsegen.kv import make_policy

    model, tokenizer = sparsegen.load(tiny_checkpoint)
    ids = torch.tensor([tokenizer("it was the best of times, it was the worst of times " * 6)["input_ids"]])
    runs = {protocol: generate_tokens(model, ids, torch.ones_like(ids), make_policy("knorm", 16), max_new_tokens=5,
                                      **protocol_feed(protocol, ids.shape[1], ids.shape[1] - 6))
            for protocol in ("query-aware", "query-aware-once")}
    assert runs["query-aware"][2]["kv_tokens"] == 16
    assert runs["query-aware-once"][2]["kv_tokens"] == 16 + 4  # the compressed prompt and the answer's fed tokens
    assert runs["query-aware"][2]["kv_tokens_peak"] == runs["query-aware-once"][2]["kv_tokens_peak"] == ids.shape[1]
    assert torch.equal(runs["query-aware"][0][:, 0], runs["query-aware-once"][0][:, 0])


def test_cli_resume_keeps_finished_rows_and_runs_the_rest(tiny_checkpoint, book_slice, tmp_path, capsys,
                                                          monkeypatch):
    out = tmp_path / "r.json"
    common = ["ruler", "--model", str(tiny_checkpoint), "--haystack", str(book_slice), "--length", "600",
              "--samples", "1", "--max-new-tokens", "2", "--chunk-size", "64", "--json", str(out)]
    assert main([*common, "--tasks", "niah_single_1"]) == 0
    first = json.loads(out.read_text())
    first["rows"][0]["score"] = 0.123  # a row a resumed run would recompute shows up as changed
    del first["settings"]["draft_tokens"]  # (as if written before that option existed)
    out.write_text(json.dumps(first))
    assert main([*common, "--tasks", "niah_single_1,vt", "--resume"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["task"], r["score"] == 0.123) for r in rows] == [("niah_single_1", True), ("vt", False)]
    assert "resuming" in capsys.readouterr().out
    real = ruler.evaluate

    def cut_off(model, tokenizer, samples, *args):  # the run stops on its second new task
        if samples[0].task == "niah_single_2":
            raise KeyboardInterrupt
        return real(model, tokenizer, samples, *args)

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(ruler, "evaluate", cut_off)
        main([*common, "--tasks", "niah_single_1,vt,fwe,niah_single_2", "--resume"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["task"] for r in rows] == ["niah_single_1", "vt", "fwe"] and rows[0]["score"] == 0.123
    assert main([*common, "--tasks", "vt", "--resume"]) == 0  # a resumed run of fewer tasks keeps the others
    assert [r["task"] for r in json.loads(out.read_text())["rows"]] == ["vt", "niah_single_1", "fwe"]
    assert main([*common, "--tasks", "vt", "--resume", "--seed", "1"]) == 2
    assert "other settings: seed (0 there, 1 now)" in capsys.readouterr().err
    assert main([*common[:-2], "--resume"]) == 2
    assert "give --json OUT" in capsys.readouterr().err


def test_cli_speculative_rows_give_the_full_caches_answers_and_the_drafts_acceptance(tiny_checkpoint, book_slice,
                                                                                      tmp_path, capsys):
    common = ["ruler", "--model", str(tiny_checkpoint), "--haystack", str(book_slice), "--tasks", "niah_single_1,vt",
              "--length", "600", "--samples", "2", "--max-new-tokens", "6", "--chunk-size", "64"]
    plain, drafted = tmp_path / "plain.json", tmp_path / "drafted.json"
    assert main([*common, "--json", str(plain)]) == 0
    assert main([*common, "--speculative", "streaming:0.2", "--draft-tokens", "3", "--json", str(drafted)]) == 0
    expected, got = (json.loads(p.read_text())["rows"] for p in (plain, drafted))
    assert [[s["answer"] for s in r["samples"]] for r in got] == [[s["answer"] for s in r["samples"]]
                                                                   for r in expected]  # lossless
    for row in got:
        assert row["draft"]["policy"] == "streaming" and row["draft"]["budget"] < 600 // 4
        assert 0 <= row["draft"]["acceptance_rate"] <= 1 and 1 <= row["draft"]["tokens_per_step"] <= 4
        assert all(s["speculation"]["draft_tokens"] == 3 for s in row["samples"])
    out = capsys.readouterr().out
    assert "accepted" in out and "| full (draft streaming 20%) |" in out
    assert main([*common, "--speculative", "streaming:0.2", "--policies", "full,h2o", "--budget", "0.5"]) == 2
    refused = capsys.readouterr()
    assert "run --policies full, not h2o" in refused.err and "niah_single_1:" not in refused.out  # before any row
    assert main([*common, "--draft-model", str(tiny_checkpoint)]) == 2
    assert "give --speculative too" in capsys.readouterr().err
    assert main([*common, "--speculative", "streaming:0.2", "--protocol", "context"]) == 2
    assert "use --protocol stream" in capsys.readouterr().err
    assert main([*common, "--speculative", "full"]) == 2
    assert "give an evicting policy" in capsys.readouterr().err
