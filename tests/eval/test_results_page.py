"""docs/results.md's tables are generated from the JSON under docs/results/: the committed page must agree with the
committed JSON, and a number typed by hand is found and rewritten."""

import json
import shutil
from pathlib import Path

import pytest

from sparsegen.cli import main
from sparsegen.eval import results_page

ROOT = Path(__file__).resolve().parents[2]
PAGE, RESULTS = ROOT / "docs" / "results.md", ROOT / "docs" / "results"


def test_the_committed_results_page_agrees_with_the_committed_json():
    text, changed = results_page.regenerate(PAGE, RESULTS)
    assert changed == [], f"run `sparsegen sweep report --doc docs/results.md`: {changed} differ from the JSON"
    assert text == PAGE.read_text()
    assert len(results_page.BLOCK.findall(text)) >= 25  # every table the JSON gives is marked


def _pruning_results(root: Path) -> None:
    folder = root / "tiny" / "pruning"
    folder.mkdir(parents=True)
    for tag, wiki, books in (("dense", 20.0, 25.0), ("wanda_0.5", 40.0, 1234567.0)):
        (folder / f"{tag}_wiki.json").write_text(json.dumps({"ppl": wiki}))
        (folder / f"{tag}_books.json").write_text(json.dumps({"ppl": books}))
    (folder / "wanda_0.5_sparsity.json").write_text(json.dumps({"achieved": 0.5, "seconds": 12.4}))


def test_a_hand_edited_number_is_found_and_rewritten(tmp_path, capsys):
    _pruning_results(tmp_path / "results")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\nprose stays\n<!-- results: tiny/pruning -->\n| stale |\n<!-- /results -->\nend\n")
    text, changed = results_page.regenerate(page, tmp_path / "results")
    assert changed == ["tiny/pruning"]
    assert "| wanda 50% | 40.00 | 1.2e6 | 0.500 | 12 |" in text and text.startswith("# Page\n\nprose stays\n")
    assert text.endswith("<!-- /results -->\nend\n")
    args = ["sweep", "report", "--doc", str(page), "--results", str(tmp_path / "results")]
    with pytest.raises(SystemExit) as exit_:
        main(args + ["--check"])
    assert exit_.value.code == 1 and "tiny/pruning" in capsys.readouterr().err
    assert "| stale |" in page.read_text()  # --check changes nothing
    main(args)
    assert page.read_text() == text
    main(args + ["--check"])
    assert "up to date" in capsys.readouterr().out


def test_a_block_the_results_cannot_give_is_an_error(tmp_path):
    _pruning_results(tmp_path / "results")
    page = tmp_path / "page.md"
    page.write_text("<!-- results: tiny/prunning -->\n| x |\n<!-- /results -->\n")
    with pytest.raises(ValueError, match="tiny/prunning.*known: tiny/pruning"):
        results_page.regenerate(page, tmp_path / "results")


def test_plots_are_drawn_from_the_json(tmp_path):
    shutil.copytree(RESULTS / "smollm2" / "h2o", tmp_path / "smollm2" / "h2o")
    shutil.copytree(RESULTS / "smollm2" / "policies", tmp_path / "smollm2" / "policies",
                    ignore=shutil.ignore_patterns("*.png"))
    results_page.plot(tmp_path)
    assert (tmp_path / "smollm2" / "policies" / "policies.png").stat().st_size > 10_000


def test_ruler_runs_and_sweep_cells_make_one_table(tmp_path):
    """A ``sparsegen ruler`` run and a sweep cell land in one table, full first; the average is RULER's over every
    task, and a run of some tasks only shows none."""
    from sparsegen.eval.ruler import TASKS

    folder = tmp_path / "tiny" / "ruler"
    folder.mkdir(parents=True)
    rows = [{"policy": "full", "budget": None, "protocol": "context", "task": t, "length": 4096, "score": 1.0}
            for t in TASKS] + [{"policy": "h2o", "budget": 819, "protocol": "stream", "task": "vt", "length": 4096,
                                "score": 0.5}]
    (folder / "ruler-a.json").write_text(json.dumps({"budget_arg": 0.2, "samples_per_task": 2, "rows": rows}))
    drafted = [{**rows[0], "score": 0.5, "draft": {"policy": "streaming", "budget": 819,
                                                               "context_share": 0.2}}]  # (lossless: in fact 1.0)
    (folder / "ruler-c.json").write_text(json.dumps({"budget_arg": None, "samples_per_task": 2, "rows": drafted}))
    (folder / "sweep-b.json").write_text(json.dumps({
        "policy": "snapkv", "budget": "0.5", "length": "4096", "options": {"protocol": "context", "samples": 3},
        "metrics": {"tasks": {t: 0.25 for t in TASKS}}}))
    lines = results_page.ruler(folder, "tiny")["tiny/ruler"].splitlines()
    cells = [line.split(" | ") for line in lines[2:]]
    assert [c[:5] for c in cells] == [["| full", "all", "context", "4,096", "2"],
                                      ["| full (draft streaming 20%)", "all", "context", "4,096", "2"],
                                      ["| snapkv", "50%", "context", "4,096", "3"],
                                      ["| h2o", "20%", "stream", "4,096", "2"]]
    assert [c[-1] for c in cells] == ["1.00 |", "- |", "0.25 |", "- |"]
    assert cells[1][5] == "0.50"
