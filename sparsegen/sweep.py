"""Experiment grids from a file (``sparsegen sweep``): models × policies × budgets × kv-bits × tasks × lengths, each
cell run once and appended to ``results.jsonl`` under the hash of its settings, so a rerun skips what is done and a
crash loses one cell at most. Cells run in a local process pool, or as Ray tasks on a cluster (``ray="auto"`` or an
address): the same function either way, so the same numbers. ``report`` turns the JSONL into a Markdown table,
``plot_sweep`` (``sparsegen sweep report DIR --plot F``) into a figure of each measure against the budget.

A sweep file (TOML)::

    [sweep]
    name = "small"
    models = ["reference"]
    policies = ["full", "streaming", "h2o", {name = "streaming", sinks = 1}]  # a table: a policy with options
    budgets = [64, 128]          # tokens, or fractions of the length; ignored by full
    kv_bits = [0, 4]             # 0: K/V as the model computes them
    tasks = ["ppl", "passkey"]   # ppl: streaming perplexity over the books' test text; passkey: retrieval accuracy;
                                 # fidelity: greedy continuations against the full cache's (ROUGE-L, KL)
    lengths = [1024]             # tokens a cell reads (ppl: per stream; passkey, fidelity: a prompt's length)

    [ppl]
    streams = 2

    [passkey]
    trials = 3                   # default 5 (each task's defaults are its command's, DEFAULTS)
    depths = [0.1, 0.5, 0.9]     # default 0, 0.25, 0.5, 0.75, 1
    chat = false                 # default: in the model's chat template if it has one

    [fidelity]
    prompts = 8                  # cut evenly from text (default books/test/dracula.txt)
    new_tokens = 64

    [ruler]                      # RULER's tasks at each length (``sparsegen ruler``); the cell shows their average
    samples = 2                  # per task (default 20)
    protocol = "context"         # default stream
    tasks = ["niah_single_1"]    # default all eleven
    max_new_tokens = 32          # default RULER's per task

Each task runs what its command runs (``sparsegen ppl --stream``, ``passkey``, ``fidelity``, ``ruler``) with the same
defaults, so a cell's number is the command's: ``examples/sweeps/`` holds the grids of ``docs/results.md``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TASKS = ("ppl", "passkey", "fidelity", "ruler")
# the commands' own; passkey's and ruler's chat: the model's template; ruler's max_new_tokens: RULER's per task
DEFAULTS = {"ppl": {"streams": 2}, "passkey": {"trials": 5, "depths": [0, 0.25, 0.5, 0.75, 1]},
            "fidelity": {"prompts": 8, "new_tokens": 64},
            "ruler": {"samples": 20, "protocol": "stream", "tasks": None, "depths": None, "seed": 0, "chunk_size": 512,
                      "max_new_tokens": None, "haystack": "books/test/great_expectations.txt"}}
PROTOCOL = 2  # part of every cell's key: raised when a task measures differently, so old results are not reused
MEASURE = {"ppl": "ppl", "passkey": "accuracy", "fidelity": "rouge_l", "ruler": "average"}  # a report cell's number
GRID = ("models", "policies", "budgets", "kv_bits", "tasks", "lengths")


@dataclass
class Sweep:
    name: str
    models: list[str]
    policies: list[str]
    budgets: list[float] = field(default_factory=lambda: [None])
    kv_bits: list[int] = field(default_factory=lambda: [0])
    tasks: list[str] = field(default_factory=lambda: ["ppl"])
    lengths: list[int] = field(default_factory=lambda: [1024])
    options: dict = field(default_factory=dict)  # per task: its [table]
    threads: int = 2  # CPU threads a cell uses (and asks Ray for)

    @classmethod
    def load(cls, path: str | Path) -> Sweep:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ValueError(f"cannot read the sweep file {path}: {err}") from None
        head = data.get("sweep")
        if not isinstance(head, dict):
            raise ValueError(f"{path}: a sweep file needs a [sweep] table (see `sparsegen sweep --help`)")
        unknown = set(head) - {"name", "threads", *GRID}
        if unknown:
            raise ValueError(f"{path}: unknown [sweep] keys {sorted(unknown)}; known: name, threads, {', '.join(GRID)}")
        for key in GRID:
            if key in head and (not isinstance(head[key], list) or not head[key]):
                raise ValueError(f"{path}: [sweep] {key} must be a non-empty list")
        threads = head.get("threads", 2)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"{path}: [sweep] threads must be a positive integer, got {threads!r}")
        if "models" not in head or "policies" not in head:
            raise ValueError(f"{path}: [sweep] needs models and policies")
        bad = set(head.get("tasks", ["ppl"])) - set(TASKS)
        if bad:
            raise ValueError(f"{path}: unknown tasks {sorted(bad)}; known: {', '.join(TASKS)}")
        for entry in head["policies"]:
            _check_policy(path, entry)
        return cls(name=head.get("name", Path(path).stem), threads=threads,
                   options={task: {**DEFAULTS[task], **data.get(task, {})} for task in TASKS},
                   **{key: head[key] for key in GRID if key in head})

    def cells(self) -> list[dict]:
        """Every distinct cell (``full`` once per other setting: it has no budget)."""
        seen, cells = set(), []
        for model, entry, budget, bits, task, length in itertools.product(
                self.models, self.policies, self.budgets, self.kv_bits, self.tasks, self.lengths):
            policy, options = (entry, {}) if isinstance(entry, str) else (entry["name"], {
                k: v for k, v in entry.items() if k != "name"})
            cell = {"model": model, "policy": policy, **({"policy_options": options} if options else {}),
                    "budget": None if policy == "full" else budget,
                    "kv_bits": bits or None, "task": task, "length": length, "options": self.options.get(task, {}),
                    "threads": self.threads}
            key = cell_key(cell)
            if key not in seen:
                seen.add(key)
                cells.append({**cell, "key": key})
        return cells


def _check_policy(path, entry) -> None:
    """A ``policies`` entry: a policy's name, or a table of its name and its constructor's options."""
    from sparsegen.kv.policies import policy_class, policy_options

    name = entry if isinstance(entry, str) else entry.get("name") if isinstance(entry, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"{path}: a [sweep] policies entry is a name or a table with a name "
                         f"(e.g. {{name = \"streaming\", sinks = 1}}), got {entry!r}")
    cls = policy_class(name)
    extra = sorted(set(entry) - {"name"} - set(policy_options(cls))) if isinstance(entry, dict) else []
    if extra:
        raise ValueError(f"{path}: policy {name!r} takes no {', '.join(extra)} "
                         f"(its options: {', '.join(policy_options(cls)) or 'none'})")


def policy_label(cell: dict) -> str:
    """A cell's policy as a report shows it: its name, and its options if the sweep file gave any."""
    options = cell.get("policy_options") or {}
    return cell["policy"] + "".join(f" {k}={v}" for k, v in options.items())


def cell_key(cell: dict) -> str:
    """The hash of a cell's settings (the tasks' defaults filled in) and of ``PROTOCOL``."""
    settings = {"protocol": PROTOCOL, **{k: v for k, v in cell.items() if k != "key"}}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def run_cell(cell: dict) -> dict:
    """One cell, in whatever process runs it (a pool worker or a Ray task): its settings and its metrics."""
    import torch

    from sparsegen.data import data_dir, leading_bos
    from sparsegen.kv import PolicySpec
    from sparsegen.models import load

    torch.set_num_threads(cell["threads"])
    t0 = time.perf_counter()
    model, tokenizer = load(cell["model"])
    length = cell["length"]
    policy = PolicySpec(cell["policy"], cell["budget"], cell.get("policy_options", {}), kv_bits=cell["kv_bits"])

    text = data_dir() / "books" / "test"
    if cell["task"] == "ppl":
        from sparsegen.eval.stream import make_streams, stream_nll

        streams = cell["options"]["streams"]
        data = make_streams(text, tokenizer, streams * length, streams, leading_bos(tokenizer))
        summary = stream_nll(model, data, policy, progress=False).summary(length)
        metrics = {"ppl": summary["ppl"], "tokens": summary["tokens"], "kv_tokens_peak": summary["kv_tokens_peak"]}
    elif cell["task"] == "fidelity":
        metrics = _fidelity(model, tokenizer, cell, policy)
    elif cell["task"] == "ruler":
        metrics = _ruler(model, tokenizer, cell, policy)
    else:
        from sparsegen.eval.passkey import passkey_accuracy
        from sparsegen.eval.stream import read_tokens

        options = cell["options"]
        filler = read_tokens(text / "great_expectations.txt", tokenizer, 4 * length)
        chat = _chat(options, tokenizer)
        result = passkey_accuracy(model, tokenizer, filler, [length], options["depths"], policy, options["trials"],
                                  progress=False, chat=chat)
        metrics = {"accuracy": result["accuracy"]}
    return {**cell, "status": "done", "metrics": metrics, "seconds": round(time.perf_counter() - t0, 2),
            "host": os.uname().nodename}


def _fidelity(model, tokenizer, cell: dict, policy) -> dict:
    """``sparsegen fidelity``'s measure: ``prompts`` prompts of ``length`` tokens, ``new_tokens`` greedy tokens."""
    from sparsegen.data import data_dir, leading_bos
    from sparsegen.eval.fidelity import cut_prompts, fidelity
    from sparsegen.eval.stream import read_tokens

    options = cell["options"]
    count, length = options["prompts"], cell["length"]
    tokens = read_tokens(options.get("text", data_dir() / "books" / "test" / "dracula.txt"), tokenizer,
                         max(200_000, count * length))
    prompts = cut_prompts(tokens, count, length, leading_bos(tokenizer))
    result = fidelity(model, tokenizer, prompts, policy, options["new_tokens"], progress=False)
    return {key: result[key] for key in ("rouge_l", "tokens_to_divergence", "kl")}


def _chat(options: dict, tokenizer) -> bool:
    """A task's ``chat`` option; by default the model's chat template if it has one (as `sparsegen passkey` and
    `sparsegen ruler` ask)."""
    return options.get("chat", bool(getattr(tokenizer, "chat_template", None)))


def _ruler(model, tokenizer, cell: dict, policy) -> dict:
    """``sparsegen ruler``'s measure for one policy and length: each task's score and their average."""
    from sparsegen.data import data_dir
    from sparsegen.eval import ruler

    options = cell["options"]
    haystack = Path(options["haystack"])
    haystack = haystack if haystack.is_absolute() else data_dir() / haystack
    report = ruler.run(model, tokenizer, haystack.read_text(encoding="utf-8", errors="replace"),
                       {cell["policy"]: policy}, [cell["length"]], options["tasks"], options["samples"],
                       (options["protocol"],), _chat(options, tokenizer), options["depths"], options["seed"],
                       options["chunk_size"], max_new_tokens=options["max_new_tokens"], progress=False)
    scores = {row["task"]: row["score"] for row in report["rows"]}
    return {"average": sum(scores.values()) / len(scores), "tasks": scores,
            "kv_tokens_peak": max(row["kv_tokens_peak"] for row in report["rows"])}


def _failed(cell: dict, err: BaseException) -> dict:
    return {**cell, "status": "failed", "error": "".join(traceback.format_exception_only(type(err), err)).strip()}


def done_keys(results: Path) -> set[str]:
    if not results.exists():
        return set()
    return {row["key"] for row in map(json.loads, results.read_text().splitlines())
            if row.get("status") == "done"}


def run(sweep: Sweep, out: Path, workers: int = 1, ray: str | None = None, retries: int = 1,
        progress: bool = True) -> dict:
    """Every cell not yet done in ``out/results.jsonl``; returns counts (done now, skipped, failed)."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    finished = done_keys(results)
    todo = [cell for cell in sweep.cells() if cell["key"] not in finished]
    counts = {"cells": len(sweep.cells()), "skipped": len(sweep.cells()) - len(todo), "done": 0, "failed": 0}
    bar = tqdm(total=len(todo), desc=f"sweep {sweep.name}", unit="cell", disable=not progress)
    with open(results, "a") as sink:
        def record(row: dict) -> None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            counts[row["status"]] += 1
            bar.update(1)
            if row["status"] == "failed":
                tqdm.write(f"cell {row['key']} ({policy_label(row)} {row['task']} {row['length']}) failed: "
                           f"{row['error']}")

        if ray is not None:
            for row in _run_ray(todo, ray, retries):
                record(row)
        else:
            # (spawned, not forked: a worker forked from this process, which has threads (tqdm's monitor, torch's),
            # can start holding a lock one of them held, and hang; CI saw a cell's worker stuck loading its tokenizer)
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = {pool.submit(run_cell, cell): cell for cell in todo}
                for future in as_completed(futures):
                    try:
                        record(future.result())
                    except Exception as err:  # noqa: BLE001  a failed cell is recorded, never dropped
                        record(_failed(futures[future], err))
    bar.close()
    return counts


def connect_ray(address: str):
    """Ray, joined to the cluster at ``address``; ``auto`` joins a running cluster or starts a local one."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'sparsegen[ray]'") from None
    if not ray.is_initialized():
        if address == "auto":
            try:
                ray.init(address="auto", log_to_driver=False)
            except ConnectionError:
                ray.init(log_to_driver=False)  # no cluster running: a local one on this machine
        else:
            ray.init(address=address, log_to_driver=False)
    return ray


def _run_ray(cells: list[dict], address: str, retries: int):
    """Each cell a Ray task asking for its threads as CPUs; ``auto`` joins a running cluster or starts a local one."""
    ray = connect_ray(address)
    remote = ray.remote(run_cell).options(num_cpus=min(cells[0]["threads"], ray.cluster_resources().get("CPU", 1))
                                          if cells else 1, max_retries=retries, retry_exceptions=True)
    pending = {remote.remote(cell): cell for cell in cells}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        cell = pending.pop(ready[0])
        try:
            yield ray.get(ready[0])
        except Exception as err:  # noqa: BLE001
            yield _failed(cell, err)


def finished(results: Path) -> dict[str, dict]:
    """The last finished result of each cell, by its key."""
    rows = {}
    for row in map(json.loads, results.read_text().splitlines()):
        if row.get("status") == "done":
            rows[row["key"]] = row
    if not rows:
        raise ValueError(f"{results} holds no finished cell")
    return rows


def report(results: Path) -> str:
    """A Markdown table: a row per model × policy × budget × kv-bits, a column per task × length (the last result
    of each cell)."""
    rows = finished(results)
    columns = sorted({(r["task"], r["length"]) for r in rows.values()})
    table: dict[tuple, dict] = {}
    for r in rows.values():
        label = (r["model"], policy_label(r), "-" if r["budget"] is None else r["budget"], r["kv_bits"] or "-")
        metric = r["metrics"][MEASURE[r["task"]]]
        table.setdefault(label, {})[(r["task"], r["length"])] = metric
    named = {"fidelity": "fidelity ROUGE-L", "ruler": "RULER average"}
    head = "| model | policy | budget | kv bits | " + " | ".join(f"{named.get(t, t)} @ {n}" for t, n in columns) + " |"
    lines = [head, "|" + "---|" * (4 + len(columns))]
    for label in sorted(table, key=lambda x: (x[0], x[1], x[2] if x[2] != "-" else -1, x[3] if x[3] != "-" else 0)):
        cells = [table[label].get(c) for c in columns]
        lines.append("| " + " | ".join(map(str, label)) + " | "
                     + " | ".join("" if v is None else f"{v:.0%}" if c[0] == "passkey" else f"{v:.3f}"
                                  for v, c in zip(cells, columns)) + " |")
    return "\n".join(lines)
