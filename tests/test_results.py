"""Documented numbers, recomputed (``pytest -m results``; deselected by default: real models, about a minute each).

Each test reads a results page's own table and reruns the command the page names on the real model; it fails when
a documented number drifts past the noise the page allows (the kept sets are deterministic: exact, but for rounding
at a percent's edge)."""

import re
from importlib.util import find_spec
from pathlib import Path

import pytest

import sparsegen
from sparsegen.eval.inspect import inspect
from sparsegen.models.gguf import PACKAGED

ROOT = Path(__file__).parents[1]
QUESTION = "\n\nWhat is the pass key? The pass key is"

pytestmark = pytest.mark.results


def _table(page: Path) -> dict[str, list[str]]:
    """The rows of the Markdown table on ``page``, by their first cell."""
    rows = {}
    for line in page.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and not set(cells[0]) <= set("-") and cells[0] != "policy":
            rows[cells[0]] = cells
    return rows


@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_the_inspector_pages_numbers(model):
    if not all(find_spec(module) for module, _ in PACKAGED[model].parts):
        pytest.skip(f"{model} is not installed")
    page = ROOT / "docs" / "results" / model / "inspect" / "passkey.md"
    documented = _table(page)
    loaded, tokenizer = sparsegen.load(model)
    text = (ROOT / "docs" / "results" / "smollm2" / "inspect" / "passkey-prompt.txt").read_text()
    data = inspect(loaded, tokenizer, text, list(documented), budget=256, question=QUESTION, answer="71432")
    pairs = data["layers"] * data["heads"]
    for name, cells in documented.items():
        row = data["policies"][name]
        assert row["kv_tokens"] == int(cells[1].replace(",", "")), name
        some = 100 * sum(1 for c in row["count"] if c) / data["prompt_tokens"]
        assert abs(some - int(cells[2].rstrip("%"))) <= 0.5 + 1e-9, (name, some)
        held = 100 * row["answer_kept"]
        assert abs(held - int(re.match(r"(\d+)%", cells[3]).group(1))) <= 0.5 + 1e-9, (name, held)
        assert f"of {pairs} heads" in cells[3]
        assert repr(row["reply"]) == cells[4], name


def _sweep_cell(name: str, policy: str, budget, kv_bits: int | None = None, **options) -> dict:
    """The metrics of one cell of ``examples/sweeps/NAME.toml``, run here."""
    from sparsegen import sweep

    if not all(find_spec(module) for module, _ in PACKAGED["smollm2"].parts):
        pytest.skip("smollm2 is not installed")
    cells = sweep.Sweep.load(ROOT / "examples" / "sweeps" / f"{name}.toml").cells()
    return sweep.run_cell(next(c for c in cells if (c["policy"], c.get("policy_options", {}), c["budget"], c["kv_bits"])
                               == (policy, options, budget, kv_bits)))["metrics"]


def test_the_h2o_sweep_files_reproduce_the_documented_perplexity_and_fidelity():
    """docs/results.md §2 at 20%: the H2O cells of its sweep files (`examples/sweeps/smollm2-h2o-*.toml`, what
    `examples/experiments/h2o.toml` runs) give the documented `ppl-h2o-20pct.json` and `fidelity-20pct.json`
    (deterministic kept sets: equal but for float rounding in the KL)."""
    import json

    folder = ROOT / "docs" / "results" / "smollm2" / "h2o"
    documented = json.loads((folder / "ppl-h2o-20pct.json").read_text())
    metrics = _sweep_cell("smollm2-h2o-ppl", "h2o", 409)
    assert metrics["tokens"] == documented["tokens"]
    assert metrics["ppl"] == pytest.approx(documented["ppl"], rel=1e-6)
    documented = json.loads((folder / "fidelity-20pct.json").read_text())["policies"][0]
    metrics = _sweep_cell("smollm2-h2o-fidelity", "h2o", 0.2)
    assert documented["policy"] == "h2o"
    assert metrics["rouge_l"] == documented["rouge_l"]
    assert metrics["tokens_to_divergence"] == documented["tokens_to_divergence"]
    assert metrics["kl"] == pytest.approx(documented["kl"], rel=1e-4)



@pytest.mark.parametrize("policy, options, budget, documented", [("streaming", {}, 256, "streaming-256"),
                                                                 ("streaming", {"sinks": 1}, 256, "sinks1-256")])
def test_the_streamingllm_sweep_file_reproduces_the_documented_perplexity(policy, options, budget, documented):
    """docs/results.md §1: cells of `examples/sweeps/smollm2-streamingllm.toml` (the grid of
    `examples/experiments/streamingllm.toml`; a sink-sweep cell among them) give the documented PPL over 39,998
    tokens (about 2 minutes each)."""
    import json

    metrics = _sweep_cell("smollm2-streamingllm", policy, budget, **options)
    expected = json.loads((ROOT / "docs" / "results" / "smollm2" / "streaming" / f"{documented}.json").read_text())
    assert metrics["tokens"] == expected["tokens"] and metrics["kv_tokens_peak"] == expected["kv_tokens_peak"]
    assert metrics["ppl"] == pytest.approx(expected["ppl"], rel=1e-6)


def test_the_policy_library_sweep_files_reproduce_the_documented_pass_key_and_fidelity():
    """docs/results.md §3: a pass-key cell with 4-bit K/V and a fidelity cell of `examples/sweeps/smollm2-policies-*`
    (what `examples/experiments/policies.toml` runs) give the documented accuracy and ROUGE-L (deterministic; KL to
    rounding)."""
    import json

    folder = ROOT / "docs" / "results" / "smollm2" / "policies"
    documented = json.loads((folder / "passkey-h2o-20pct-kv4.json").read_text())["policies"]["h2o"]
    assert _sweep_cell("smollm2-policies-passkey", "h2o", 409, 4)["accuracy"] == documented["accuracy"] == 0.3
    documented = json.loads((folder / "fidelity-snapkv-20pct.json").read_text())["policies"][0]
    metrics = _sweep_cell("smollm2-policies-fidelity", "snapkv", 0.2)
    assert metrics["rouge_l"] == documented["rouge_l"]
    assert metrics["tokens_to_divergence"] == documented["tokens_to_divergence"]
    assert metrics["kl"] == pytest.approx(documented["kl"], rel=1e-4)
