import json

import numpy as np
import pytest

import sparsegen
from sparsegen.cli import main
from sparsegen.eval.fidelity import cut_prompts, fidelity
from sparsegen.kv import PolicySpec


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_checkpoint):
    return sparsegen.load(tiny_checkpoint)


def test_cut_prompts():
    rows = cut_prompts(np.arange(100, 200), count=3, length=11, bos_id=0)
    assert rows.shape == (3, 11) and (rows[:, 0] == 0).all()
    assert rows[0, 1:].tolist() == list(range(100, 110)) and rows[-1, -1].item() == 198
    with pytest.raises(ValueError, match="fewer than one prompt"):
        cut_prompts(np.arange(5), count=1, length=11, bos_id=0)


@pytest.mark.parametrize("name, budget", [("full", None), ("h2o", 200), ("streaming", 200)])
def test_a_policy_that_keeps_everything_is_perfect(model_and_tokenizer, name, budget):
    model, tokenizer = model_and_tokenizer
    prompts = cut_prompts(np.random.default_rng(0).integers(2, 300, 500), count=3, length=40, bos_id=0)
    result = fidelity(model, tokenizer, prompts, PolicySpec(name, budget), new_tokens=12, progress=False)
    assert result["rouge_l"] == 1.0
    assert result["tokens_to_divergence"] == 12
    assert result["kl"] == pytest.approx(0.0, abs=1e-6)


def test_a_small_budget_loses_something(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompts = cut_prompts(np.random.default_rng(1).integers(2, 300, 500), count=3, length=40, bos_id=0)
    result = fidelity(model, tokenizer, prompts, PolicySpec("window", 4), new_tokens=12, progress=False)
    assert result["kl"] > 1e-3


def test_fidelity_cli(tiny_checkpoint, corpus, tmp_path):
    out = tmp_path / "f.json"
    assert main(["fidelity", "--model", str(tiny_checkpoint), "--text", str(corpus / "books/test/c.txt"),
                 "--policy", "h2o", "--policy", "window", "--budget", "0.5", "--prompts", "2",
                 "--prompt-tokens", "30", "--new-tokens", "5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [p["policy"] for p in report["policies"]] == ["h2o", "window"]
    assert report["policies"][0]["budget"] == 15
    assert {"rouge_l", "tokens_to_divergence", "kl"} <= set(report["policies"][1])
