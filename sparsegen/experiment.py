"""Experiments as files of commands (``sparsegen sweep FILE`` on a file with an ``[experiment]`` table): the runs
behind ``docs/results.md`` — pruning a model, then measuring it; fitting a plan; serving and loading a server — each
a ``sparsegen`` command line with ``{variables}``, run once: a run whose output exists is skipped, so an
interrupted experiment resumes where it stopped. Where a grid of one measurement is enough, a ``[sweep]`` file
(``sparsegen/sweep.py``) is the shorter form; this is the general one.

An experiment file (TOML)::

    [experiment]
    name = "pruning"
    [experiment.vars]               # {name} anywhere below; `--set name=value` overrides; {data} is the shared data
    model = "smollm2"               # folder, {python} this interpreter
    out = "docs/results/{model}/pruning"

    [[run]]
    name = "{method}-{pct}"         # unique per run: `--only GLOB` picks runs by name
    each = {method = ["wanda", "sparsegpt"], pct = [50, 20]}   # one run per combination
    command = ["prune", "--model", "{model}", "--sparsity", "{pct / 100}", "--out", "runs/{model}/{method}-{pct}"]
    creates = "runs/{model}/{method}-{pct}/config.json"        # default: the path after --json

    [[run]]
    name = "ppl-{method}-{pct}"
    each = {method = ["wanda", "sparsegpt"], pct = [50, 20]}
    command = ["ppl", "--model", "runs/{model}/{method}-{pct}", "--json", "{out}/{name}.json"]

A ``{…}`` holds a variable or arithmetic on variables (``{length * pct // 100}``, ``{kv.tag}`` for a table's key);
an argument that is exactly ``{x}`` with ``x`` a list becomes its items (``[]`` drops it). Other run keys:
``copy = [SRC, DST]`` (a file copied instead of a command), ``script = "scripts/x.py"`` (the command's arguments
go to that script, run with this Python, instead of to ``sparsegen``), ``stdout = PATH`` (the command's output
written there), ``server = [serve arguments]`` (a ``sparsegen serve`` started for the run and stopped after it;
``{url}`` is its address).

A run waits for the earlier runs whose outputs it names (an argument equal to one, or a folder holding one); runs
that need nothing of each other may run at the same time (``--workers N``, or Ray tasks with ``--ray``). What runs
is decided as ``make`` does: the results (runs no other run reads, or those ``--only`` names) that are missing, and
the missing outputs they read — a result already there is not rerun, nor is the checkpoint it was measured on.
"""

from __future__ import annotations

import ast
import fnmatch
import itertools
import operator
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RUN_KEYS = {"name", "each", "command", "creates", "copy", "script", "stdout", "server"}
PLACEHOLDER = re.compile(r"\{([^{}]+)\}")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg}


@dataclass
class Run:
    name: str
    argv: list[str]  # the whole command line, or [] for a copy
    creates: Path
    copy: tuple[Path, Path] | None = None
    stdout: Path | None = None
    server: list[str] | None = None
    needs: set[str] = field(default_factory=set)  # names of earlier runs whose outputs this one reads
    folder: str = field(default_factory=os.getcwd)  # where its relative paths start (a Ray worker's cwd is not)


def evaluate(expression: str, variables: dict):
    """A ``{…}``'s value: a variable, a table's key (``kv.tag`` or ``kv["tag"]``), a list's item or slice, a number,
    or arithmetic on them; nothing else (no calls), so a file cannot run code."""
    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in variables:
                raise ValueError(f"unknown variable {node.id!r} in {{{expression}}}; known: {', '.join(variables)}")
            return variables[node.id]
        if isinstance(node, ast.Attribute):
            return value(node.value)[node.attr]
        if isinstance(node, ast.Subscript):
            return value(node.value)[value(node.slice)]
        if isinstance(node, ast.Slice):  # (a list's first items: {recompute[:1]})
            return slice(*(None if part is None else value(part) for part in (node.lower, node.upper, node.step)))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"{{{expression}}}: only variables, numbers and + - * / // % are allowed")

    try:
        return value(ast.parse(expression.strip(), mode="eval"))
    except SyntaxError:
        raise ValueError(f"{{{expression}}} is not an expression") from None
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(f"{{{expression}}}: {err!r}") from None


def render(template, variables: dict):
    """A string with its ``{…}`` filled in; a string that is exactly one ``{…}`` keeps its value's type (a list stays
    a list, for arguments that are several or none)."""
    if isinstance(template, list):  # a list's items, a list item that is a list spliced in
        items = [render(item, variables) for item in template]
        return [x for item, raw in zip(items, template)
                for x in (item if isinstance(item, list) and not isinstance(raw, list) else [item])]
    if isinstance(template, dict):
        return {key: render(value, variables) for key, value in template.items()}
    if not isinstance(template, str):
        return template
    whole = PLACEHOLDER.fullmatch(template)
    if whole:
        return evaluate(whole[1], variables)
    return PLACEHOLDER.sub(lambda m: str(evaluate(m[1], variables)), template)


def resolve(raw: dict, overrides: dict[str, str]) -> dict:
    """The experiment's variables with those that name others filled in (in any order), overrides first."""
    from sparsegen.data import data_dir

    unknown = set(overrides) - set(raw)
    if unknown:
        raise ValueError(f"--set {', '.join(sorted(unknown))}: the experiment has no such variable "
                         f"(its variables: {', '.join(raw) or 'none'})")
    pending = {**raw, **{k: _literal(v) for k, v in overrides.items()}}
    done = {"data": str(data_dir()), "python": sys.executable}
    while pending:
        progress = False
        for key, template in list(pending.items()):
            try:
                done[key] = render(template, done)
            except ValueError as err:
                if "unknown variable" not in str(err):
                    raise
                continue
            del pending[key]
            progress = True
        if not progress:
            raise ValueError(f"variables {', '.join(pending)} name each other or an unknown variable")
    return done


def _literal(text: str):
    """A ``--set`` value: a number, list or table where it reads as one (``--set 'pcts=[50, 20]'``), else the string
    (``--set lengths=1024,8192`` stays the text it is, not a tuple)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, (int, float, list, dict)) and not isinstance(value, bool) else text


@dataclass
class Experiment:
    name: str
    runs: list[Run]

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, str] | None = None) -> Experiment:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ValueError(f"cannot read the experiment file {path}: {err}") from None
        head = data.get("experiment", {})
        variables = resolve(head.get("vars", {}), overrides or {})
        runs: list[Run] = []
        for number, entry in enumerate(data.get("run", []), 1):
            unknown = set(entry) - RUN_KEYS
            if unknown:
                raise ValueError(f"{path}: run {number} has unknown keys {sorted(unknown)}; known: "
                                 f"{', '.join(sorted(RUN_KEYS))}")
            if ("command" in entry) == ("copy" in entry):
                raise ValueError(f"{path}: run {number} needs a command or a copy (one of them)")
            for scope in _combinations(render(entry.get("each", {}), variables), path, number):
                runs.append(_run(entry, {**variables, **scope}, path, number))
        if not runs:
            raise ValueError(f"{path}: an experiment needs at least one [[run]]")
        seen: dict[str, Run] = {}
        for run in runs:
            if run.name in seen:
                raise ValueError(f"{path}: two runs are named {run.name!r}; give `name` the `each` variables")
            run.needs = {earlier.name for earlier in seen.values() if _reads(run, earlier.creates)}
            seen[run.name] = run
        return cls(name=head.get("name", Path(path).stem), runs=runs)


def _combinations(each: dict, path, number: int) -> list[dict]:
    if not isinstance(each, dict) or any(not isinstance(v, list) for v in each.values()):
        raise ValueError(f"{path}: run {number}'s `each` maps variables to lists (an empty one: no such runs)")
    return [dict(zip(each, values)) for values in itertools.product(*each.values())]


def _run(entry: dict, variables: dict, path, number: int) -> Run:
    name = str(render(entry.get("name", f"run{number}"), variables))
    variables = {**variables, "name": name, **({"url": "{url}"} if "server" in entry else {})}  # url: once it runs

    def args(template: list) -> list[str]:
        return [str(item) for item in render(template, variables)]

    def here(template: str) -> Path:  # a path from the folder the experiment runs in
        return Path.cwd() / str(render(template, variables))

    if "copy" in entry:
        source, target = (here(p) for p in entry["copy"])
        return Run(name, [], target, copy=(source, target))
    program = [str(render(entry["script"], variables))] if "script" in entry else ["-m", "sparsegen"]
    argv = [sys.executable, *program, *args(entry["command"])]
    stdout = here(entry["stdout"]) if "stdout" in entry else None
    if "creates" in entry:
        creates = here(entry["creates"])
    elif "--json" in argv[:-1]:
        creates = here(argv[argv.index("--json") + 1])
    elif stdout is not None:
        creates = stdout
    else:
        raise ValueError(f"{path}: run {name!r} names no output: give `creates` (the file that marks it done)")
    return Run(name, argv, creates, stdout=stdout, server=args(entry["server"]) if "server" in entry else None)


def _reads(run: Run, output: Path) -> bool:
    """Whether ``run`` names ``output`` or a folder holding it (an argument, or an item of a comma-separated one)."""
    named = [Path(run.folder) / part for arg in run.argv[1:] + (run.server or []) for part in arg.split(",")
             if "/" in part] + ([run.copy[0]] if run.copy else [])
    return any(output == p or p in output.parents for p in named)


def shown(run: Run) -> str:
    """A run as its command line (or its copy) reads."""
    if run.copy:
        return f"copy {run.copy[0]} {run.copy[1]}"
    words = ["sparsegen", *run.argv[3:]] if run.argv[1:3] == ["-m", "sparsegen"] else ["python", *run.argv[1:]]
    return shlex.join(words) + (f" > {os.path.relpath(run.stdout, run.folder)}" if run.stdout else "") + (
        f"   (with sparsegen serve {shlex.join(run.server)})" if run.server is not None else "")


def execute(run: Run) -> None:
    """One run, in this process or a Ray worker; the output appears only when the run succeeded."""
    run.creates.parent.mkdir(parents=True, exist_ok=True)
    if run.copy:
        source, target = run.copy
        if not source.exists():
            raise RuntimeError(f"{run.name}: {source} does not exist")
        shutil.copyfile(source, target)
        return
    from sparsegen.bench.spawn import stop_server

    server, argv = None, run.argv
    try:
        if run.server is not None:
            server, url = _start_server(run)
            argv = [a.replace("{url}", url) for a in argv]
        if run.stdout is None:
            code = subprocess.call(argv, cwd=run.folder)
        else:
            partial = run.stdout.with_name(run.stdout.name + ".partial")
            with open(partial, "w") as sink:
                code = subprocess.call(argv, stdout=sink, cwd=run.folder)
            if code == 0:
                partial.replace(run.stdout)
        if code != 0:
            raise RuntimeError(f"{run.name}: `{' '.join(argv[1:])}` exited with status {code}")
        if not run.creates.exists():
            raise RuntimeError(f"{run.name}: finished but did not write {run.creates}")
    finally:
        if server is not None:
            stop_server(server, 60)


def _start_server(run: Run) -> tuple[subprocess.Popen, str]:
    """``sparsegen serve`` with the run's arguments on a free port, once it answers /health; its log beside the
    run's output."""
    from sparsegen.bench.spawn import free_port, stop_server, wait_healthy

    port, log = free_port(), run.creates.with_name(f"serve-{run.name}.log")
    with open(log, "w") as out:  # (the server writes to its own copy of the handle)
        server = subprocess.Popen([sys.executable, "-m", "sparsegen", "serve", *run.server, "--port", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT, cwd=run.folder)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, log)
    except BaseException:
        stop_server(server)
        raise
    return server, url


def needed(experiment: Experiment, only: list[str] | None = None) -> tuple[list[Run], list[Run]]:
    """What to run, as ``make`` decides: the goals (the runs ``only`` names, by default those no other run reads:
    the results) whose output is missing, and before each the missing outputs it reads, and theirs. A run whose
    output exists is never rerun, and neither is what it read (a pruned checkpoint is not rebuilt for a result that
    is already there)."""
    runs = {r.name: r for r in experiment.runs}
    if only:
        goals = [r for r in experiment.runs if any(fnmatch.fnmatch(r.name, g) for g in only)]
        if not goals:
            raise ValueError(f"--only {' '.join(only)} matches no run; runs: {', '.join(runs)}")
    else:
        read = set().union(*(r.needs for r in experiment.runs))
        goals = [r for r in experiment.runs if r.name not in read]
    todo: set[str] = set()

    def want(run: Run) -> None:
        if run.name not in todo and not run.creates.exists():
            todo.add(run.name)
            for name in run.needs:
                want(runs[name])

    for goal in goals:
        want(goal)
    return [r for r in experiment.runs if r.name in todo], goals


def run(experiment: Experiment, only: list[str] | None = None, workers: int = 1, ray: str | None = None,
        dry_run: bool = False, progress: bool = True) -> dict:
    """Every chosen run whose output is missing, each after the runs it needs; returns counts (done now, skipped
    because done before, failed, not run because a run they need failed)."""
    todo, goals = needed(experiment, only)
    counts = {"runs": len(goals), "skipped": sum(r.creates.exists() for r in goals), "done": 0, "failed": 0,
              "blocked": 0}
    if dry_run:
        for r in todo:
            print(f"{r.name}: {shown(r)}")
        return counts
    names = {r.name for r in todo}
    waiting = {r.name: r for r in todo}
    failed: set[str] = set()
    bar = tqdm(total=len(todo), desc=f"experiment {experiment.name}", unit="run", disable=not progress)
    submit, wait = _local(workers) if ray is None else _ray(ray)
    limit = workers if ray is None else len(todo)  # Ray queues what the cluster cannot start yet
    running: dict = {}
    while waiting or running:
        for name, r in list(waiting.items()):
            needs = r.needs & names
            if needs & failed:
                del waiting[name]
                failed.add(name)
                counts["blocked"] += 1
                bar.update(1)
                tqdm.write(f"{name}: not run, it needs {', '.join(sorted(needs & failed))}, which failed",
                           file=sys.stderr)
            elif not needs & (set(waiting) | set(running.values())) and len(running) < limit:
                del waiting[name]
                tqdm.write(f"{name}: {shown(r)}", file=sys.stderr)
                running[submit(r)] = name
        if not running:
            continue
        handle, error = wait(list(running))
        name = running.pop(handle)
        if error is None:
            counts["done"] += 1
        else:
            failed.add(name)
            counts["failed"] += 1
            tqdm.write(f"{name} failed: {error}", file=sys.stderr)
        bar.update(1)
    bar.close()
    return counts


def _local(workers: int):
    """Runs in threads (each a subprocess, so threads are enough)."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
    from concurrent.futures import wait as wait_futures

    pool = ThreadPoolExecutor(workers)

    def wait(handles):
        done, _ = wait_futures(handles, return_when=FIRST_COMPLETED)
        future = next(iter(done))
        error = future.exception()
        return future, None if error is None else str(error)

    return (lambda r: pool.submit(execute, r)), wait


def _ray(address: str):
    """Each run a Ray task (on the node that has the files: the cluster shares one working folder)."""
    from sparsegen.sweep import connect_ray

    ray = connect_ray(address)
    remote = ray.remote(execute).options(num_cpus=1)

    def wait(handles):
        ready, _ = ray.wait(handles, num_returns=1)
        try:
            ray.get(ready[0])
            return ready[0], None
        except Exception as err:  # noqa: BLE001  a failed run is reported, never dropped
            return ready[0], str(err).strip().splitlines()[-1]

    return (lambda r: remote.remote(r)), wait


def is_experiment(path: str | Path) -> bool:
    """Whether a file is an experiment (``[experiment]`` or ``[[run]]``) rather than a ``[sweep]`` grid."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    return "experiment" in data or "run" in data
