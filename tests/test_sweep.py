"""``sparsegen sweep``: a grid from a TOML file, run once per cell, resumable, the same on Ray as in the local pool."""

import json

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


def test_cells_are_the_grid_with_full_once(grid):
    cells = sweep.Sweep.load(grid).cells()
    assert sorted((c["policy"], c["budget"]) for c in cells) == [("full", None), ("streaming", 32), ("streaming", 64)]
    assert len({c["key"] for c in cells}) == 3


def test_a_sweep_runs_resumes_and_reports(grid, tmp_path, capsys):
    out = tmp_path / "local"
    assert main(["sweep", str(grid), "--out", str(out)]) in (0, None)
    first = _metrics(out)
    assert len(first) == 3 and all(m["ppl"] > 1 for m in first.values())
    assert main(["sweep", str(grid), "--out", str(out)]) in (0, None)  # nothing left to run
    assert "3 already done, 0 run now" in capsys.readouterr().out
    assert len((out / "results.jsonl").read_text().splitlines()) == 3
    main(["sweep", "report", str(out)])
    table = capsys.readouterr().out
    assert "| reference | streaming | 32 | - |" in table and "ppl @ 96" in table


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
    with pytest.raises(ValueError, match="unknown tasks.*known: ppl, passkey"):
        sweep.Sweep.load(path)
    path.write_text('[sweep]\nmodels = []\npolicies = ["h2o"]\n')
    with pytest.raises(ValueError, match="models must be a non-empty list"):
        sweep.Sweep.load(path)
    path.write_text('[sweep]\nmodel = ["reference"]\n')
    with pytest.raises(ValueError, match="unknown \\[sweep\\] keys"):
        sweep.Sweep.load(path)


def test_a_failing_cell_is_recorded_not_dropped(tmp_path):
    path = tmp_path / "fail.toml"
    path.write_text('[sweep]\nmodels = ["no-such-model-here"]\npolicies = ["full"]\nlengths = [32]\n')
    counts = sweep.run(sweep.Sweep.load(path), tmp_path / "out", progress=False)
    assert counts["failed"] == 1
    row = json.loads((tmp_path / "out" / "results.jsonl").read_text())
    assert row["status"] == "failed" and row["error"]
