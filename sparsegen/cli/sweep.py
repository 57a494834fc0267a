"""``sweep``: a grid of experiments from a TOML file, resumable, locally or on Ray; ``sweep report DIR`` prints its
table; ``sweep report --doc PAGE`` regenerates a results page's tables from the JSON results."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparsegen.cli.common import positive_int


def cmd_sweep(args: argparse.Namespace) -> None:
    from sparsegen import sweep

    if args.file == "report" and args.doc:
        return _report_page(args)
    if args.check or args.plots:
        raise ValueError("--check and --plots go with `sparsegen sweep report --doc PAGE`")
    if args.file == "report":
        folder = args.folder or args.out
        if folder is None:
            raise ValueError("give the sweep's folder: sparsegen sweep report DIR")
        results = Path(folder) / "results.jsonl"
        if not results.exists():
            raise ValueError(f"{results} does not exist: run the sweep with --out {folder} first")
        print(sweep.report(results))
        if args.plot:
            from sparsegen.eval.plots import plot_sweep

            plot_sweep(list(sweep.finished(results).values()), args.plot, sweep.MEASURE, sweep.policy_label)
            print(f"plot written to {args.plot}")
        return
    if args.plot:
        raise ValueError("--plot goes with `sparsegen sweep report DIR`")
    if args.folder is not None:
        raise ValueError(f"unexpected {args.folder!r}: run `sparsegen sweep FILE --out DIR`")
    from sparsegen import experiment

    if experiment.is_experiment(args.file):
        return _run_experiment(args)
    if args.set or args.only or args.dry_run:
        raise ValueError("--set, --only and --dry-run go with experiment files ([experiment] and [[run]] tables)")
    plan = sweep.Sweep.load(args.file)
    out = Path(args.out or f"runs/sweep-{plan.name}")
    counts = sweep.run(plan, out, workers=args.workers, ray=args.ray, retries=args.retries)
    print(f"sweep {plan.name}: {counts['cells']} cells, {counts['skipped']} already done, {counts['done']} run now, "
          f"{counts['failed']} failed; results in {out / 'results.jsonl'} (`sparsegen sweep report {out}`)")
    if counts["failed"]:
        sys.exit(1)


def _run_experiment(args: argparse.Namespace) -> None:
    from sparsegen import experiment

    if args.out is not None:
        raise ValueError("an experiment's runs name their own outputs: drop --out (or --set the variable they use)")
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: write NAME=VALUE")
        overrides[key] = value
    plan = experiment.Experiment.load(args.file, overrides)
    counts = experiment.run(plan, only=args.only, workers=args.workers, ray=args.ray, dry_run=args.dry_run)
    if args.dry_run:
        return
    print(f"experiment {plan.name}: {counts['runs']} runs, {counts['skipped']} already done, {counts['done']} run "
          f"now, {counts['failed']} failed, {counts['blocked']} not run (they need a failed run)")
    if counts["failed"] or counts["blocked"]:
        sys.exit(1)


def _report_page(args: argparse.Namespace) -> None:
    """Rewrite (or, with --check, compare) the page's marked tables from the JSON under --results."""
    from sparsegen.eval import results_page

    page, root = Path(args.doc), Path(args.results)
    if not page.exists() or not root.is_dir():
        raise ValueError(f"need the page {page} and the results folder {root} (run from the repository's root)")
    text, changed = results_page.regenerate(page, root)
    if args.check:
        if changed:
            print(f"{page} disagrees with {root} in: {', '.join(changed)}; run `sparsegen sweep report --doc {page}`",
                  file=sys.stderr)
            sys.exit(1)
        print(f"{page} is up to date with {root}")
        return
    page.write_text(text)
    if args.plots:
        results_page.plot(root)
    print(f"{page}: {len(changed)} table(s) rewritten" + (f" ({', '.join(changed)})" if changed else ""))


def add_parsers(sub) -> None:
    p = sub.add_parser("sweep", help="run a grid of experiments from a TOML file (models x policies x budgets x "
                                     "kv-bits x tasks x lengths), or an experiment file of commands "
                                     "(examples/experiments/), resumable, locally or on Ray; `sweep report DIR` "
                                     "prints a grid's table, `sweep report --doc PAGE` regenerates a results page")
    p.add_argument("file", help="the sweep or experiment file (e.g. examples/sweep-small.toml, "
                                "examples/experiments/streamingllm.toml), or 'report'")
    p.add_argument("folder", nargs="?", default=None, help="with 'report': the sweep's --out folder")
    p.add_argument("--out", default=None, help="folder for results.jsonl (default: runs/sweep-NAME)")
    p.add_argument("--workers", type=positive_int, default=1,
                   help="cells at a time in the local process pool (default 1: a cell uses [sweep] threads CPUs)")
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="run each cell as a Ray task: 'auto' joins a running cluster or starts a local one")
    p.add_argument("--retries", type=int, default=1, help="Ray retries of a failed cell (default 1)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="with 'report': also draw each measure against the budget, a line per policy")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="an experiment file's variable (e.g. --set model=gemma3-270m); repeatable")
    p.add_argument("--only", action="append", default=[], metavar="GLOB",
                   help="an experiment file's runs whose names match (e.g. --only 'ppl-*'); repeatable")
    p.add_argument("--dry-run", action="store_true",
                   help="an experiment file: print the commands still to run, run nothing")
    p.add_argument("--doc", default=None, metavar="PAGE",
                   help="with 'report': rewrite the tables PAGE marks (docs/results.md) from the JSON under --results")
    p.add_argument("--results", default="docs/results", metavar="DIR",
                   help="with 'report --doc': the results folder, one subfolder per model (default docs/results)")
    p.add_argument("--check", action="store_true",
                   help="with 'report --doc': change nothing; exit 1 if a marked table differs from the JSON")
    p.add_argument("--plots", action="store_true", help="with 'report --doc': redraw the page's figures too")
    p.set_defaults(func=cmd_sweep)
