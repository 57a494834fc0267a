"""Self-speculative decoding is lossless: greedy output equals the full cache's token for token, sampled output follows
the full cache's distribution (chi-square), whatever the draft cache evicts."""

import json

import pytest
import torch

import sparsegen.engine.speculative as speculative
from sparsegen.engine.generate import generate_tokens
from sparsegen.engine.sampling import sampling_probs
from sparsegen.engine.speculative import Speculation, best_draft_length, draft_length, draft_policy, speculative_tokens
from sparsegen.kv import make_policy
from tests.kv.families import FAMILIES, VOCAB, tiny_model
from tests.kv.test_exactness import _padded_batch


def _full(model, ids, mask, **kw):
    return generate_tokens(model, ids, mask, make_policy("full"), chunk_size=16, **kw)


def _speculate(model, ids, mask, policy, k, family="llama", **kw):
    spec = Speculation(policy, k, positions="original" if family == "opt" else None)
    return speculative_tokens(model, ids, mask, spec, chunk_size=16, **kw)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_output_is_the_full_caches_for_every_family(family):
    """Padded rows of different lengths, a draft cache far below the sequence, fixed and adaptive draft lengths."""
    model = tiny_model(family)
    ids, mask = _padded_batch([40, 33, 20], 40, seed=7)
    expected, expected_counts, _, _, _ = _full(model, ids, mask, max_new_tokens=24)
    for policy, k in ((make_policy("streaming", 8), 3), (make_policy("h2o", 8), "auto")):
        new, counts, stats, _, _ = _speculate(model, ids, mask, policy, k, family, max_new_tokens=24)
        assert torch.equal(new, expected) and torch.equal(counts, expected_counts), (family, policy.name)
        report = stats["speculation"]
        assert report["rounds"] < 24  # drafts were accepted: fewer target steps than tokens
        assert 0 < report["acceptance_rate"] < 1
        if family != "gemma3":  # (whose sliding layers keep their window, plus room to roll back)
            assert stats["draft_cache"]["kv_tokens_peak"] <= 8 + 16  # the budget plus one prefill chunk


@pytest.mark.parametrize("name", ["window", "streaming-h2o", "tova", "snapkv", "knorm", "pyramid"])
def test_any_policy_drafts_losslessly(name):
    model = tiny_model("llama")
    ids, mask = _padded_batch([30, 30], 30, seed=8)
    expected, _, _, _, _ = _full(model, ids, mask, max_new_tokens=16)
    new, _, _, _, _ = _speculate(model, ids, mask, make_policy(name, 6), 4, max_new_tokens=16)
    assert torch.equal(new, expected)


def test_rows_stop_at_their_end_token_as_without_speculation():
    model = tiny_model("qwen2")
    ids, mask = _padded_batch([25, 18], 25, seed=9)
    reference, _, _, _, _ = _full(model, ids, mask, max_new_tokens=20)
    eos = int(reference[1, 5])  # the second row meets it after 5 tokens (the first maybe too)
    expected, expected_counts, _, _, _ = _full(model, ids, mask, max_new_tokens=20, eos_id=eos)
    new, counts, _, _, _ = _speculate(model, ids, mask, make_policy("streaming", 6), 5, max_new_tokens=20, eos_id=eos)
    assert torch.equal(counts, expected_counts) and int(counts[1]) <= 6
    for row in range(2):
        assert torch.equal(new[row, : counts[row]], expected[row, : expected_counts[row]])


def test_rows_that_are_done_stop_growing_the_caches():
    """A row done early is still fed each round (the batch's shapes), but keeps none of it: the full cache holds at
    most the prompt, the answer and one round's drafts, the room it was sized for (no reallocation)."""
    model = tiny_model("qwen2")
    ids, mask = _padded_batch([25, 18], 25, seed=9)
    reference, _, _, _, _ = _full(model, ids, mask, max_new_tokens=40)
    eos = int(reference[1, 0])  # row 1 is done at its first token, row 0 never meets it
    new, counts, stats, _, _ = _speculate(model, ids, mask, make_policy("streaming", 6), 5, max_new_tokens=40,
                                          eos_id=eos)
    assert counts.tolist() == [40, 1] and stats["speculation"]["rounds"] >= 7
    assert torch.equal(new[0], reference[0])
    assert stats["kv_tokens_peak"] <= 25 + 40 + 5 + 1
    assert stats["draft_cache"]["tokens_seen"] <= 25 + 40 + 5 + 1


def _target_marginals(model, prompt, temperature, top_p):
    """Exact distributions of the first and second new token under the full model (no cache, no speculation)."""
    with torch.no_grad():
        first = sampling_probs(model(prompt[None]).logits[0, -1], temperature, top_p)
        first = first / first.sum()
        both = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        second = sampling_probs(model(both).logits[:, -1], temperature, top_p)
        second = second / second.sum(-1, keepdim=True)
    return first, first @ second


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` under ``probs``; categories expected fewer than 5 times are pooled."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def _sample_second_tokens(model, prompt, rows, temperature, top_p):
    ids = prompt.expand(rows, -1).contiguous()
    new, _, stats, _, _ = _speculate(model, ids, torch.ones_like(ids), make_policy("window", 2), 3,
                                     max_new_tokens=3, temperature=temperature, top_p=top_p, seed=3)
    return torch.bincount(new[:, 1], minlength=VOCAB), stats["speculation"]


def test_sampled_tokens_follow_the_full_caches_distribution(monkeypatch):
    """4,000 rows sampled at once: the second new token (the first one drafted) has the full model's marginal. The
    same test rejects a sampler that keeps every draft, so it can fail."""
    model = tiny_model("llama", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # a peaked distribution, so that the draft's differs from the target's
    prompt = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(4))
    temperature, top_p = 0.8, 0.95
    _, expected = _target_marginals(model, prompt, temperature, top_p)
    counts, report = _sample_second_tokens(model, prompt, 4000, temperature, top_p)
    assert 0.05 < report["acceptance_rate"] < 0.95  # the draft cache (2 tokens) often disagrees
    assert _chi_square_p(counts, expected) > 1e-3

    def keep_every_draft(drafts, draft_probs, target_logits, temperature, top_p, generator):
        rows = torch.arange(drafts.shape[0])
        accepted = torch.full_like(rows, drafts.shape[1])
        last = sampling_probs(target_logits[:, -1], temperature, top_p)
        return accepted, torch.multinomial(last, 1, generator=generator).squeeze(-1)

    monkeypatch.setattr(speculative, "accept", keep_every_draft)
    wrong, _ = _sample_second_tokens(model, prompt, 4000, temperature, top_p)
    assert _chi_square_p(wrong, expected) < 1e-6


def test_the_draft_length_follows_acceptance_and_costs():
    assert best_draft_length(0.0, 0.1, 1.0) == 1
    assert best_draft_length(0.95, 0.05, 1.0) >= 8  # cheap, accurate drafts: long rounds
    assert best_draft_length(0.95, 1.0, 1.0) < best_draft_length(0.95, 0.05, 1.0)  # drafts as dear as verifying
    assert best_draft_length(0.5, 0.1, 1.0) < best_draft_length(0.9, 0.1, 1.0)


@pytest.mark.parametrize("spec, words", [("full:100", "evicting policy"), ("streaming", "needs a budget"),
                                         ("nope:8", "unknown policy"), ("", "takes POLICY"),
                                         ("streaming:0", "positive")])
def test_bad_draft_policies_say_what_to_give(spec, words):
    with pytest.raises(ValueError, match=words):
        draft_policy(spec, input_length=100)


@pytest.mark.parametrize("value", [0, 17, "x", "1.5", True])
def test_bad_draft_lengths_are_refused(value):
    with pytest.raises(ValueError, match="draft-tokens"):
        draft_length(value)


def test_a_draft_model_must_share_the_vocabulary():
    model = tiny_model("llama")
    other = tiny_model("gpt_neox")
    other.resize_token_embeddings(VOCAB + 3)
    ids, mask = _padded_batch([10], 10)
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_tokens(model, ids, mask, Speculation(make_policy("window", 4), 2, model=other))


def test_a_separate_draft_model_drafts_losslessly():
    """A different model (here another random llama) drafts; the output is still the target's."""
    model, other = tiny_model("llama"), tiny_model("llama", seed=5)
    ids, mask = _padded_batch([20, 14], 20, seed=10)
    expected, _, _, _, _ = _full(model, ids, mask, max_new_tokens=12)
    new, _, stats, _, _ = speculative_tokens(model, ids, mask, Speculation(make_policy("window", 8), 2, model=other),
                                             max_new_tokens=12, chunk_size=16)
    assert torch.equal(new, expected)
    assert stats["speculation"]["acceptance_rate"] < 0.5  # an unrelated drafter is mostly wrong


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_compiled_drafting_is_lossless_and_runs_the_compiled_step(name, compiled_step_batches):
    """``compile=True``: the draft's one-token steps take the compiled fixed-shape step, and the output is still the
    full cache's."""
    model = tiny_model("llama")
    ids, mask = torch.randint(3, VOCAB, (2, 30), generator=torch.Generator().manual_seed(3)), torch.ones(2, 30).long()
    expected, _, _, _, _ = _full(model, ids, mask, max_new_tokens=16)
    torch._dynamo.utils.counters.clear()
    new, _, stats, _, _ = _speculate(model, ids, mask, make_policy(name, 8), 3, max_new_tokens=16, compile=True)
    report = stats["speculation"]
    assert torch.equal(new, expected)
    # (each draft token a step; a round after one whose drafts were all accepted first feeds the last of them)
    assert 0 < report["draft_compiled_steps"] <= report["draft_steps"] + report["rounds"]
    # one graph, though the rows came to hold different counts midway (a second compile there stalled a run)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.heavy  # compiles the draft's step: 25 s
def test_a_round_after_every_draft_was_accepted_feeds_the_last_one_through_the_compiled_step(monkeypatch):
    """A draft cache as good as the full one (every draft accepted, so every round after the first carries its last
    draft in): the draft is fed only by compiled one-token steps, never by an eager forward of two tokens (what a
    carried draft cost before: a SmolLM2 8K draft step averaged 18 ms against ~7 ms compiled)."""
    model = tiny_model("llama")
    ids, mask = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(5)), torch.ones(1, 30).long()
    expected, _, _, _, _ = _full(model, ids, mask, max_new_tokens=16)
    eager_draft_calls, forward = [], speculative.forward

    def counted(model, cache, ids, *args, **kwargs):
        eager_draft_calls.extend([ids.shape[1]] if cache.policy.budget is not None else [])
        return forward(model, cache, ids, *args, **kwargs)

    monkeypatch.setattr(speculative, "forward", counted)
    new, _, stats, _, _ = _speculate(model, ids, mask, make_policy("window", 64), 3, max_new_tokens=16, compile=True)
    report = stats["speculation"]
    assert torch.equal(new, expected) and report["acceptance_rate"] == 1.0 and report["rounds"] > 2
    assert eager_draft_calls == []
    assert report["draft_compiled_steps"] == report["draft_steps"] + report["rounds"] - 1


def test_generate_cli_speculative_prints_the_full_caches_text(tiny_checkpoint, capsys):
    from sparsegen.cli import main

    args = ["generate", "--model", str(tiny_checkpoint), "--prompt", "it was the best of times, it was the worst of",
            "--max-new-tokens", "20", "--json"]
    assert main(args) == 0
    full = json.loads(capsys.readouterr().out)
    assert main(args + ["--speculative", "window:4", "--draft-tokens", "auto"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["text"] == full["text"] and 0 <= drafted["acceptance_rate"] <= 1
    assert drafted["cache"]["draft_cache"]["budget"] == 4 and drafted["cache"]["speculation"]["rounds"] >= 1
    assert main(args + ["--speculative", "window:4", "--draft-model", str(tiny_checkpoint)]) == 0  # a separate drafter
    assert json.loads(capsys.readouterr().out)["text"] == full["text"]


def test_compare_cli_has_a_speculative_row(tiny_checkpoint, capsys):
    from sparsegen.cli import main

    assert main(["compare", "--model", str(tiny_checkpoint), "--prompt", "it was the best of times",
                 "--policies", "full,speculative:streaming:6,speculative:h2o", "--budget", "8",
                 "--max-new-tokens", "12", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows["speculative:streaming:6"]["text"] == rows["full"]["text"] == rows["speculative:h2o"]["text"]
    assert rows["speculative:h2o"]["cache"]["draft_cache"]["budget"] == 8


@pytest.mark.heavy
@pytest.mark.parametrize("compile", [False, True])
def test_bench_cli_speculative_rows(tiny_checkpoint, tmp_path, capsys, corpus, compiled_step_batches, compile):
    """``--compile``: the draft's steps run compiled, compiled before the timing by a short run of the same draft
    shape."""
    from sparsegen.cli import main

    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(tiny_checkpoint), "--policies", "full,speculative:streaming:16",
                 "--contexts", "64", "--batch", "2", "--new-tokens", "8", "--warmup", "1", "--chunk-size", "32",
                 "--text", str(corpus / "books/test"), "--json", str(out)] + ["--compile"] * compile) == 0
    printed = capsys.readouterr().out
    assert "speculative:streaming:16 vs full at 64 x 2" in printed and "lossless" in printed
    row = json.loads(out.read_text())["rows"][1]
    assert row["policy"] == "speculative:streaming:16" and row["tokens_per_s"] > 0
    assert 0 <= row["acceptance_rate"] <= 1 and row["tokens_per_step"] >= 1 and 0 < row["kv_share"] < 1
    assert (row["compiled_share"] > 0.5, row["compile_seconds"] is not None) == (compile, compile)
    assert 0 < row["rows_per_round"] <= 2


def test_rounds_count_the_rows_still_generating():
    """A batch runs rounds until its slowest row is done; the report says how many rows a round served."""
    from sparsegen.engine.speculative import _Counters

    counters = _Counters()
    counters.add(torch.tensor([4, 1]), 4, [True, True], 0.1, 0.2)
    counters.add(torch.tensor([0, 2]), 4, [False, True], 0.1, 0.2)
    report = counters.report(4)
    assert report["rows_per_round"] == 1.5 and report["tokens_per_step"] == round((5 + 2 + 3) / 3, 3)


@pytest.mark.parametrize("argv, words", [
    (["--speculative", "full:8"], "evicting policy"),
    (["--speculative", "streaming:8", "--policy", "h2o", "--budget", "8"], "leave the policy at 'full'"),
    (["--speculative", "streaming:8", "--draft-tokens", "0"], "draft-tokens"),
    (["--draft-model", "reference"], "give --speculative too"),
])
def test_generate_cli_bad_speculation_is_one_line(tiny_checkpoint, capsys, argv, words):
    from sparsegen.cli import main

    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_a_soft_prompt_prefixes_both_caches_and_the_output_stays_the_full_caches():
    """Compress, then prompt, then speculate: the prefix is pinned in the draft cache as in the full one."""
    from sparsegen.prompt import PromptPrefix, attach

    model = tiny_model("llama")
    attach(model, PromptPrefix(torch.randn(3, 32, generator=torch.Generator().manual_seed(1)) * 0.1))
    ids, mask = _padded_batch([24, 17], 24, seed=11)
    expected, _, _, _, _ = _full(model, ids, mask, max_new_tokens=14)
    new, _, stats, _, _ = _speculate(model, ids, mask, make_policy("streaming", 8), 3, max_new_tokens=14)
    assert torch.equal(new, expected) and stats["speculation"]["accepted"] > 0
