"""Experiment files (``sparsegen sweep FILE`` with ``[[run]]`` tables): templates, the runs a file makes, ``make``'s
choice of what to run, order, failures, resuming, servers, Ray; and the shipped files, which must name every result
they document as already there."""

import json
from pathlib import Path

import pytest

from sparsegen import experiment
from sparsegen.cli import main
from sparsegen.experiment import Experiment, evaluate, needed, render

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "examples" / "experiments").rglob("*.toml"))
# a run's work: prints "out:TEXT", and writes TEXT to the file after --to; fails when TEXT is "fail"
WRITER = """import sys
from pathlib import Path
if sys.argv[1] == "fail":
    sys.exit(3)
if "--to" in sys.argv:
    out = Path(sys.argv[sys.argv.index("--to") + 1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(sys.argv[1])
print("out:" + sys.argv[1])
"""


def test_templates_compute_splice_and_refuse_code():
    names = {"length": 2048, "pct": 20, "kv": {"tag": "-kv4", "args": ["--kv-bits", "4"]}, "none": [], "k": [1, 2]}
    assert render("{length * pct // 100}", names) == 409 and render("{pct / 100}", names) == 0.2
    assert render("ppl-{pct}pct{kv.tag}", names) == "ppl-20pct-kv4" and render("{kv['tag']}", names) == "-kv4"
    assert render(["a", "{kv.args}", "{none}", "{k[1]}"], names) == ["a", "--kv-bits", "4", 2]
    with pytest.raises(ValueError, match="unknown variable 'lenght'.*known: length"):
        evaluate("lenght * 2", names)
    with pytest.raises(ValueError, match="only variables, numbers"):
        evaluate("__import__('os').system('true')", names)


def _write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "writer.py").write_text(WRITER)
    path = tmp_path / "exp.toml"
    path.write_text(body)
    return path


PIPELINE = """
[experiment]
name = "pipeline"
[experiment.vars]
out = "res"
tags = ["a", "b"]

[[run]]
name = "build-{tag}"
each = {tag = "{tags}"}
script = "writer.py"
command = ["{tag}", "--to", "ckpt/{tag}/model.bin"]
creates = "ckpt/{tag}/model.bin"

[[run]]
name = "measure-{tag}"
each = {tag = "{tags}"}
script = "writer.py"
command = ["{tag}", "ckpt/{tag}", "--to", "{out}/{name}.json"]
creates = "{out}/{name}.json"

[[run]]
name = "copy-a"
copy = ["ckpt/a/model.bin", "{out}/a.bin"]

[[run]]
name = "log"
script = "writer.py"
command = ["x", "ckpt/a,ckpt/b"]
stdout = "{out}/log.txt"
"""


def test_runs_follow_their_inputs_and_make_decides_what_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    plan = Experiment.load(_write(tmp_path, PIPELINE))
    runs = {r.name: r for r in plan.runs}
    assert list(runs) == ["build-a", "build-b", "measure-a", "measure-b", "copy-a", "log"]
    assert runs["measure-a"].needs == {"build-a"} and runs["copy-a"].needs == {"build-a"}
    assert runs["log"].needs == {"build-a", "build-b"}  # a comma-separated argument names both
    todo, goals = needed(plan)
    assert [r.name for r in goals] == ["measure-a", "measure-b", "copy-a", "log"]  # what no run reads: results
    assert len(todo) == 6
    counts = experiment.run(plan, progress=False)
    assert counts == {"runs": 4, "skipped": 0, "done": 6, "failed": 0, "blocked": 0}
    assert (tmp_path / "res" / "measure-b.json").read_text() == "b"
    assert (tmp_path / "res" / "a.bin").read_text() == "a" and (tmp_path / "res" / "log.txt").read_text() == "out:x\n"
    # results there, checkpoints gone (git-ignored, a fresh clone): nothing is rebuilt for results that exist
    for path in (tmp_path / "ckpt").rglob("*.bin"):
        path.unlink()
    assert needed(plan)[0] == []
    (tmp_path / "res" / "measure-b.json").unlink()
    assert [r.name for r in needed(plan)[0]] == ["build-b", "measure-b"]
    assert [r.name for r in needed(plan, ["build-a"])[0]] == ["build-a"]  # --only names goals outright
    capsys.readouterr()
    main(["sweep", str(tmp_path / "exp.toml"), "--dry-run"])
    assert capsys.readouterr().out.splitlines() == ["build-b: python writer.py b --to ckpt/b/model.bin",
                                                    "measure-b: python writer.py b ckpt/b --to res/measure-b.json"]


def test_a_failed_run_blocks_what_needs_it_and_nothing_else(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, PIPELINE)
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", str(path), "--set", "tags=['fail', 'b']"])
    assert exit_.value.code == 1
    out = capsys.readouterr()
    assert "build-fail failed: build-fail: `writer.py fail --to ckpt/fail/model.bin` exited with status 3" in out.err
    assert "measure-fail: not run, it needs build-fail, which failed" in out.err
    assert "copy-a failed: copy-a:" in out.err and "ckpt/a/model.bin does not exist" in out.err  # no build-a now
    assert "6 runs now" not in out.out and "2 failed, 1 not run" in out.out
    assert (tmp_path / "res" / "measure-b.json").read_text() == "b"  # the runs that did not need it went on
    assert (tmp_path / "res" / "log.txt").read_text() == "out:x\n" and not list(tmp_path.glob("res/*.partial"))


def test_bad_experiment_files_name_the_fix(tmp_path):
    cases = {
        '[[run]]\nname = "x"\ncommand = ["ppl"]\n': "names no output: give `creates`",
        '[[run]]\ncommand = ["ppl", "--json", "a.json"]\ncopy = ["a", "b"]\n': "needs a command or a copy",
        '[[run]]\nname = "x"\nbogus = 1\ncommand = ["ppl", "--json", "a"]\n': "unknown keys \\['bogus'\\]",
        '[[run]]\nname = "same"\neach = {i = [1, 2]}\ncommand = ["ppl", "--json", "{i}.json"]\n': "two runs are named",
        '[[run]]\nname = "x-{i}"\neach = {i = 1}\ncommand = ["ppl", "--json", "{i}.json"]\n': "maps variables to lists",
        '[experiment]\nname = "none"\n': "at least one",
        '[experiment.vars]\na = "{b}"\nb = "{a}"\n[[run]]\ncommand = ["ppl", "--json", "{a}"]\n': "name each other",
    }
    for body, message in cases.items():
        path = tmp_path / "bad.toml"
        path.write_text(body)
        with pytest.raises(ValueError, match=message):
            Experiment.load(path)
    path.write_text('[experiment.vars]\nmodel = "x"\n[[run]]\ncommand = ["ppl", "--json", "{model}.json"]\n')
    with pytest.raises(ValueError, match="--set modle: the experiment has no such variable.*model"):
        Experiment.load(path, {"modle": "y"})
    assert Experiment.load(path, {"model": "gemma3-270m"}).runs[0].creates.name == "gemma3-270m.json"
    assert Experiment.load(path, {"model": "1024,8192"}).runs[0].creates.name == "1024,8192.json"  # not a tuple
    path.write_text('[experiment.vars]\nsinks = [1, 2]\n[[run]]\nname = "s{n}"\neach = {n = "{sinks}"}\n'
                    'command = ["ppl", "--json", "{n}.json"]\n'
                    '[[run]]\nname = "other"\ncommand = ["ppl", "--json", "o"]\n')
    assert [r.name for r in Experiment.load(path).runs] == ["s1", "s2", "other"]
    assert [r.name for r in Experiment.load(path, {"sinks": "[]"}).runs] == ["other"]  # an empty list: no such runs
    with pytest.raises(ValueError, match="--only nothing matches no run; runs: s1, s2, other"):
        needed(Experiment.load(path), ["nothing"])


@pytest.mark.heavy
def test_a_run_against_its_own_server(tmp_path, monkeypatch):
    """`server = [...]` starts `sparsegen serve` on a free port for the run and stops it after; {url} is its
    address."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "client.py").write_text(
        "import sys, urllib.request\nprint(urllib.request.urlopen(sys.argv[1] + '/v1/models').read().decode())\n")
    (tmp_path / "exp.toml").write_text('[[run]]\nname = "models"\nserver = ["--model", "reference"]\n'
                                       'script = "client.py"\ncommand = ["{url}"]\nstdout = "out/models.json"\n')
    counts = experiment.run(Experiment.load(tmp_path / "exp.toml"), progress=False)
    assert counts["done"] == 1
    assert json.loads((tmp_path / "out" / "models.json").read_text())["data"][0]["id"] == "reference"
    assert (tmp_path / "out" / "serve-models.log").exists()  # the server's log beside the result


@pytest.mark.heavy
def test_on_ray_the_same_outputs_as_locally(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    outputs = {}
    for where in ("local", "ray"):
        folder = tmp_path / where
        folder.mkdir()
        monkeypatch.chdir(folder)
        plan = Experiment.load(_write(folder, PIPELINE))
        if where == "ray":
            ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
        try:
            counts = experiment.run(plan, ray="auto" if where == "ray" else None, progress=False)
        finally:
            if where == "ray":
                ray.shutdown()
        assert counts["done"] == 6 and counts["failed"] == 0
        outputs[where] = {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("res/*")}
    assert outputs["ray"] == outputs["local"] and len(outputs["local"]) == 4


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT / "examples" / "experiments").as_posix())
def test_the_shipped_experiments_name_every_documented_result_as_there(path, monkeypatch):
    """Loaded from the repository's root (where they run), each file's results that live under docs/ are all
    there: the files reproduce the committed results by name (a renamed output or a missing result fails)."""
    monkeypatch.chdir(ROOT)
    plan = Experiment.load(path)
    todo, goals = needed(plan)
    documented = [r.name for r in todo if ROOT / "docs" in r.creates.parents]
    assert documented == [], f"{path.name}: {documented} are not under docs/results (run them, or fix the names)"
