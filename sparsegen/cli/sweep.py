"""``sweep``: a grid of experiments from a TOML file, resumable, locally or on Ray; ``sweep report DIR``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparsegen.cli.common import positive_int


def cmd_sweep(args: argparse.Namespace) -> None:
    from sparsegen import sweep

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
    plan = sweep.Sweep.load(args.file)
    out = Path(args.out or f"runs/sweep-{plan.name}")
    counts = sweep.run(plan, out, workers=args.workers, ray=args.ray, retries=args.retries)
    print(f"sweep {plan.name}: {counts['cells']} cells, {counts['skipped']} already done, {counts['done']} run now, "
          f"{counts['failed']} failed; results in {out / 'results.jsonl'} (`sparsegen sweep report {out}`)")
    if counts["failed"]:
        sys.exit(1)


def add_parsers(sub) -> None:
    p = sub.add_parser("sweep", help="run a grid of experiments from a TOML file (models x policies x budgets x "
                                     "kv-bits x tasks x lengths), resumable, locally or on Ray; `sweep report DIR` "
                                     "prints its table")
    p.add_argument("file", help="the sweep file (e.g. examples/sweep-small.toml), or 'report'")
    p.add_argument("folder", nargs="?", default=None, help="with 'report': the sweep's --out folder")
    p.add_argument("--out", default=None, help="folder for results.jsonl (default: runs/sweep-NAME)")
    p.add_argument("--workers", type=positive_int, default=1,
                   help="cells at a time in the local process pool (default 1: a cell uses [sweep] threads CPUs)")
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="run each cell as a Ray task: 'auto' joins a running cluster or starts a local one")
    p.add_argument("--retries", type=int, default=1, help="Ray retries of a failed cell (default 1)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="with 'report': also draw each measure against the budget, a line per policy")
    p.set_defaults(func=cmd_sweep)
