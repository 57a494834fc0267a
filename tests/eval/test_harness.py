"""The lm-eval adapter: under the full cache its log-likelihoods are the model's own; under a budget the cache holds
no more than the budget and a chunk; lm-eval runs a local task through it (no hub)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

import sparsegen  # noqa: E402
from sparsegen.cli import main  # noqa: E402
from sparsegen.eval.harness import SparsegenLM  # noqa: E402
from sparsegen.kv import spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "lm_eval"
REINSTALL = "the install lacks sparsegen-lm-eval.pth or its module is stale: reinstall (pip install -e .)"
TEXT = "it was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness"


def _request(kind: str, args: tuple) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.fixture(scope="module")
def full(tiny_checkpoint):
    return SparsegenLM(pretrained=str(tiny_checkpoint), chunk_size=8)


def _model_logprob(model, ids: list[int], start: int) -> float:
    logits = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return float(sum(logits[i - 1, ids[i]] for i in range(start, len(ids))))


def test_full_cache_loglikelihoods_are_the_models_own(full):
    model, tokenizer = full.model, full.tokenizer
    context, continuation = "it was the best of times,", " it was the worst"
    (ours, _), (empty, _) = full.loglikelihood([_request("loglikelihood", (context + " ", continuation.lstrip())),
                                                _request("loglikelihood", ("", continuation))])
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.inference_mode():
        assert abs(ours - _model_logprob(model, whole, start)) <= 1e-4
        alone = [full.prefix] + tokenizer(continuation, add_special_tokens=False)["input_ids"]
        assert abs(empty - _model_logprob(model, alone, 1)) <= 1e-4
        rolling, = full.loglikelihood_rolling([_request("loglikelihood_rolling", (TEXT,))])
        ids = [full.prefix] + tokenizer(TEXT, add_special_tokens=False)["input_ids"]
        assert len(ids) > 3 * 8 and abs(rolling - _model_logprob(model, ids, 1)) <= 1e-4  # over several chunks


def test_greedy_continuations_are_flagged_as_greedy(full):
    ids = full._encode(TEXT)
    with torch.inference_mode():
        greedy = full.model(torch.tensor([ids])).logits[0, -1].argmax()
    continuation = full.tokenizer.decode([int(greedy)])
    _, is_greedy = full.loglikelihood([_request("loglikelihood", (TEXT, continuation))])[0]
    assert is_greedy == (full._encode(TEXT + continuation)[len(ids):] == [int(greedy)])


def test_generation_stops_at_the_first_stop_string(full):
    text = sparsegen.generate(full.model, full.tokenizer, TEXT, max_new_tokens=12, progress=False).texts[0]
    assert len(text) > 2
    stop = text[len(text) // 2:][:2]
    got, = full.generate_until([_request("generate_until", (TEXT, {"until": [stop], "max_gen_toks": 12}))])
    assert got == text[:text.find(stop)]


def test_a_budget_bounds_the_cache_and_bad_arguments_are_refused(tiny_checkpoint, monkeypatch):
    lm = SparsegenLM(pretrained=str(tiny_checkpoint), policy="streaming", budget=16, chunk_size=8)
    caches = []

    class Recorded(spec.EvictionCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(spec, "EvictionCache", Recorded)  # (the cache PolicySpec.cache makes)
    ids = [lm.prefix] + lm._encode(TEXT * 3)
    (total, _), = lm.score([(ids, 1)])
    assert total < 0 and len(ids) > 64
    assert max(layer.peak_tokens for layer in caches[0].layers) <= 16 + 8
    with pytest.raises(ValueError, match="unknown model_args"):
        SparsegenLM(pretrained=str(tiny_checkpoint), polcy="h2o")
    with pytest.raises(ValueError, match="unknown policy"):
        SparsegenLM(pretrained=str(tiny_checkpoint), policy="h3o", budget=16)
    with pytest.raises(ValueError, match="not 'auto'"):
        SparsegenLM(pretrained=str(tiny_checkpoint), batch_size="auto")


TEXTS = [TEXT, TEXT[:40], TEXT * 2, TEXT[10:], TEXT[:70] + TEXT, TEXT[:40]]


@pytest.mark.parametrize("budget", [16, 0.5])
def test_batches_score_what_each_request_scores_alone(tiny_checkpoint, budget):
    lm = SparsegenLM(pretrained=str(tiny_checkpoint), policy="h2o", budget=budget, chunk_size=8)
    requests = [_request("loglikelihood", (text[:len(text) // 2], text[len(text) // 2:])) for text in TEXTS]
    rolling = [_request("loglikelihood_rolling", (text,)) for text in TEXTS]
    alone = lm.loglikelihood(requests), lm.loglikelihood_rolling(rolling)
    lm.batch_size = 4
    lengths = [len(lm._encode(text)) + 1 for text in TEXTS]
    batches = lm._batches(lengths)
    assert [len(b) for b in batches] == ([4, 2] if budget == 16 else [1, 1, 1, 1, 2])  # a fraction: one length
    together = lm.loglikelihood(requests), lm.loglikelihood_rolling(rolling)
    assert [greedy for _, greedy in together[0]] == [greedy for _, greedy in alone[0]]
    assert torch.allclose(torch.tensor([total for total, _ in together[0]]),
                          torch.tensor([total for total, _ in alone[0]]), rtol=0, atol=1e-4)
    assert torch.allclose(torch.tensor(together[1]), torch.tensor(alone[1]), rtol=0, atol=1e-4)


def test_a_batch_of_generations_under_the_full_cache_gives_each_prompts_own_answer(full):
    requests = [_request("generate_until", (text, {"until": ["\n\n"], "max_gen_toks": 6})) for text in TEXTS[:4]]
    alone = full.generate_until(requests)
    full.batch_size = 4
    try:
        assert full.generate_until(requests) == alone
    finally:
        full.batch_size = 1


@pytest.mark.heavy
def test_lm_eval_runs_the_local_task_through_sparsegen(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(EXAMPLES.parents[1])  # the task's data path is relative to the project root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "results"
    assert main(["lm-eval", "run", "--model", "sparsegen", "--device", "cpu", "--model_args",
          f"pretrained={tiny_checkpoint},policy=streaming,budget=16,chunk_size=8", "--include_path", str(EXAMPLES),
          "--tasks", "dracula_endings", "--limit", "6", "--batch_size", "4", "--output_path", str(out)]) == 0
    results = json.loads(next(out.rglob("results*.json")).read_text())
    accuracy = results["results"]["dracula_endings"]["acc,none"]
    assert 0 <= accuracy <= 1 and results["n-samples"]["dracula_endings"]["effective"] == 6


def _fresh_python(code: str) -> str:
    """Runs ``code`` in a new interpreter of this venv, away from the project folder (so only the install counts)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=300)
    assert done.returncode == 0, f"{done.stderr[-3000:]}\n(if sparsegen is not found: {REINSTALL})"
    return done.stdout


@pytest.mark.heavy
def test_a_bare_lm_eval_finds_sparsegen_with_nothing_imported_first():
    found = _fresh_python("from lm_eval.api.registry import get_model, model_registry; "
                          "print(get_model('sparsegen').__module__, 'hf' in model_registry)")
    assert found.split() == ["sparsegen.eval.harness", "True"]  # and lm-eval's own models are still there


def test_the_start_up_hook_imports_nothing_heavy_and_is_current():
    loaded = _fresh_python("import sys, json; hook = sys.modules.get('_sparsegen_lm_eval_hook'); "
                           "print(json.dumps([hook and hook.__file__, "
                           "[m for m in sys.modules if m.split('.')[0] in ('torch', 'lm_eval', 'sparsegen')]]))")
    hook_file, heavy = json.loads(loaded)
    assert hook_file and heavy == [], REINSTALL
    assert Path(hook_file).read_text() == (ROOT / "sparsegen" / "eval" / "lm_eval_hook.py").read_text(), REINSTALL


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_lm_evals_default_cuda_device_runs_on_the_cpu_with_a_warning(tiny_checkpoint, caplog):
    lm = SparsegenLM(pretrained=str(tiny_checkpoint), device="cuda:0")  # what lm-eval passes without --device
    assert next(lm.model.parameters()).device.type == "cpu"
    assert "pass --device cpu" in caplog.text
