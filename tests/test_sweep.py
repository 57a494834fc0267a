"""``sparsegen sweep``: a grid from a TOML file, run once per cell, resumable, the same on Ray as in the local pool."""

import json
from pathlib import Path

import pytest

from sparsegen import sweep
from sparsegen.cli import main

GRID = """
[sweep]
name = "t"
models = ["reference"]
policies = ["full", "streaming"]
budgets = [32, 64]
tasks = ["ppl"]
lengths = [96]
threads = 1

[ppl]
streams = 1
"""


@pytest.fixture
def grid(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text(GRID)
    return path


def _metrics(folder) -> dict:
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    return {row["key"]: row["metrics"] for row in rows if row["status"] == "done"}


def test_cells_are_the_grid_with_full_once(grid, monkeypatch):
    cells = sweep.Sweep.load(grid).cells()
    assert sorted((c["policy"], c["budget"]) for c in cells) == [("full", None), ("streaming", 32), ("streaming", 64)]
    assert len({c["key"] for c in cells}) == 3
    assert cells[0]["options"] == {"streams": 1}  # the file's over the default
    monkeypatch.setattr(sweep, "PROTOCOL", sweep.PROTOCOL + 1)  # a task that measures differently: new keys
    assert not {c["key"] for c in cells} & {c["key"] for c in sweep.Sweep.load(grid).cells()}


@pytest.mark.heavy
def test_a_sweep_runs_resumes_and_reports(grid, tmp_path, capsys):
    out = tmp_path / "local"
    assert main(["sweep", str(grid), "--out", str(out)]) in (0, None)
    first = _metrics(out)
    assert len(first) == 3 and all(m["ppl"] > 1 for m in first.values())
    assert main(["sweep", str(grid), "--out", str(out)]) in (0, None)  # nothing left to run
    assert "3 already done, 0 run now" in capsys.readouterr().out
    assert len((out / "results.jsonl").read_text().splitlines()) == 3
    main(["sweep", "report", str(out), "--plot", str(tmp_path / "sweep.png")])
    table = capsys.readouterr().out
    assert "| reference | streaming | 32 | - |" in table and "ppl @ 96" in table
    assert (tmp_path / "sweep.png").stat().st_size > 0 and "plot written to" in table
    assert main(["sweep", str(grid), "--out", str(out), "--plot", str(tmp_path / "x.png")]) == 2  # not a run's


@pytest.mark.heavy
def test_on_ray_the_same_results_as_the_local_pool(grid, tmp_path):
    ray = pytest.importorskip("ray")
    local, remote = tmp_path / "local", tmp_path / "ray"
    sweep.run(sweep.Sweep.load(grid), local, progress=False)
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    try:
        counts = sweep.run(sweep.Sweep.load(grid), remote, ray="auto", progress=False)
    finally:
        ray.shutdown()
    assert counts == {"cells": 3, "skipped": 0, "done": 3, "failed": 0}
    assert _metrics(remote) == _metrics(local)


def test_bad_sweep_files_name_the_fix(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[sweep]\nmodels = ["reference"]\npolicies = ["h2o"]\ntasks = ["mmlu"]\n')
    with pytest.raises(ValueError, match="unknown tasks.*known: ppl, passkey, fidelity"):
        sweep.Sweep.load(path)
    path.write_text('[sweep]\nmodels = []\npolicies = ["h2o"]\n')
    with pytest.raises(ValueError, match="models must be a non-empty list"):
        sweep.Sweep.load(path)
    path.write_text('[sweep]\nmodel = ["reference"]\n')
    with pytest.raises(ValueError, match="unknown \\[sweep\\] keys"):
        sweep.Sweep.load(path)


@pytest.mark.heavy
def test_a_policy_with_options_is_its_own_cell_and_row(tmp_path, capsys):
    """A ``policies`` entry may be a table of a policy's name and options (StreamingLLM's sink sweep): its cells give
    what `sparsegen ppl --policy streaming --sinks N` gives, report under their own label, and the plain entries'
    keys are unchanged (a results file stays valid)."""
    path = tmp_path / "sinks.toml"
    path.write_text(GRID.replace('policies = ["full", "streaming"]', 'policies = ["streaming", {name = "streaming", '
                                 'sinks = 1}]').replace("[32, 64]", "[32]"))
    cells = sweep.Sweep.load(path).cells()
    assert [c.get("policy_options") for c in cells] == [None, {"sinks": 1}]
    path_plain = tmp_path / "plain.toml"
    path_plain.write_text(GRID.replace('"full", ', "").replace("[32, 64]", "[32]"))
    assert cells[0]["key"] == sweep.Sweep.load(path_plain).cells()[0]["key"] != cells[1]["key"]
    out = tmp_path / "out"
    assert sweep.run(sweep.Sweep.load(path), out, progress=False)["done"] == 2
    ppl = {sweep.policy_label(row): row["metrics"]["ppl"] for row in sweep.finished(out / "results.jsonl").values()}
    from sparsegen.data import data_dir

    books = data_dir() / "books" / "test"
    assert main(["ppl", "--model", "reference", "--stream", "--text", str(books), "--streams", "1", "--max-tokens",
                 "96", "--policy", "streaming", "--sinks", "1", "--budget", "32", "--json",
                 str(tmp_path / "ppl.json")]) in (0, None)
    assert json.loads((tmp_path / "ppl.json").read_text())["ppl"] == ppl["streaming sinks=1"] != ppl["streaming"]
    assert "| reference | streaming sinks=1 | 32 | - |" in sweep.report(out / "results.jsonl")
    path.write_text(GRID.replace('policies = ["full", "streaming"]', 'policies = [{name = "streaming", sink = 1}]'))
    with pytest.raises(ValueError, match="policy 'streaming' takes no sink \\(its options: .*sinks"):
        sweep.Sweep.load(path)
    path.write_text(GRID.replace('policies = ["full", "streaming"]', 'policies = [{sinks = 1}]'))
    with pytest.raises(ValueError, match="a name or a table with a name"):
        sweep.Sweep.load(path)


@pytest.mark.heavy
def test_a_failing_cell_is_recorded_not_dropped(tmp_path):
    path = tmp_path / "fail.toml"
    path.write_text('[sweep]\nmodels = ["no-such-model-here"]\npolicies = ["full"]\nlengths = [32]\n')
    counts = sweep.run(sweep.Sweep.load(path), tmp_path / "out", progress=False)
    assert counts["failed"] == 1
    row = json.loads((tmp_path / "out" / "results.jsonl").read_text())
    assert row["status"] == "failed" and row["error"]


@pytest.mark.heavy
def test_a_cell_gives_the_number_its_command_gives(tmp_path, monkeypatch):
    """A sweep cell runs its command's measure with the command's defaults: the same PPL as `sparsegen ppl --stream`,
    the same fidelity as `sparsegen fidelity` and the same accuracy as `sparsegen passkey` (so a sweep file can stand
    for a results script). The reference model's tokenizer starts every text with BOS; one that does not (SmolLM2's)
    must get no BOS in either."""
    import sparsegen.data

    monkeypatch.setattr(sparsegen.data, "leading_bos", lambda tokenizer: None)
    path = tmp_path / "grid.toml"
    path.write_text('[sweep]\nmodels = ["reference"]\npolicies = ["h2o"]\nbudgets = [0.25]\n'
                    'tasks = ["ppl", "fidelity", "passkey"]\nlengths = [128]\nthreads = 1\n[ppl]\nstreams = 2\n'
                    '[fidelity]\nprompts = 2\nnew_tokens = 8\n[passkey]\ntrials = 1\n')
    rows = {cell["task"]: sweep.run_cell(cell)["metrics"] for cell in sweep.Sweep.load(path).cells()}
    from sparsegen.data import data_dir

    books = data_dir() / "books" / "test"
    assert main(["ppl", "--model", "reference", "--stream", "--text", str(books), "--streams", "2", "--max-tokens",
                 "256", "--policy", "h2o", "--budget", "0.25", "--json", str(tmp_path / "ppl.json")]) in (0, None)
    assert json.loads((tmp_path / "ppl.json").read_text())["ppl"] == rows["ppl"]["ppl"]
    assert main(["fidelity", "--model", "reference", "--policy", "h2o", "--budget", "0.25", "--prompts", "2",
                 "--prompt-tokens", "128", "--new-tokens", "8", "--json", str(tmp_path / "f.json")]) in (0, None)
    command = json.loads((tmp_path / "f.json").read_text())["policies"][0]
    assert {key: command[key] for key in ("rouge_l", "tokens_to_divergence", "kl")} == rows["fidelity"]
    assert main(["passkey", "--model", "reference", "--policy", "h2o", "--budget", "32", "--lengths", "128",
                 "--trials", "1", "--json", str(tmp_path / "p.json")]) in (0, None)
    assert json.loads((tmp_path / "p.json").read_text())["policies"]["h2o"]["accuracy"] == rows["passkey"]["accuracy"]


@pytest.mark.heavy
def test_a_ruler_cell_gives_what_sparsegen_ruler_gives(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text('[sweep]\nmodels = ["reference"]\npolicies = ["h2o"]\nbudgets = [0.25]\ntasks = ["ruler"]\n'
                    'lengths = [600]\nthreads = 1\n[ruler]\nsamples = 2\ntasks = ["niah_single_1", "vt"]\n'
                    'protocol = "context"\nmax_new_tokens = 8\n')
    metrics = sweep.run_cell(sweep.Sweep.load(path).cells()[0])["metrics"]
    assert main(["ruler", "--model", "reference", "--policies", "h2o", "--budget", "0.25", "--length", "600",
                 "--samples", "2", "--tasks", "niah_single_1,vt", "--protocol", "context", "--max-new-tokens", "8",
                 "--json", str(tmp_path / "r.json")]) in (0, None)
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert metrics["tasks"] == {row["task"]: row["score"] for row in rows}
    assert metrics["average"] == sum(row["score"] for row in rows) / 2
    assert metrics["kv_tokens_peak"] == max(row["kv_tokens_peak"] for row in rows) <= 0.25 * 600 + 512


EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.mark.parametrize("path", sorted([*EXAMPLES.glob("sweep*.toml"), *EXAMPLES.glob("sweeps/*.toml")]),
                         ids=lambda p: p.name)
def test_the_shipped_sweep_files_load(path):
    cells = sweep.Sweep.load(path).cells()
    assert cells and all(cell["task"] in sweep.TASKS for cell in cells)
