"""The ``sparsegen`` command line: a thin layer over the library, one module per group of commands (``run``,
``evaluate``, ``tasks``, ``bench``, ``sweep``, ``weights``, ``contextual``, ``serve``, ``bench_serve``, and what they
share in ``common``); each parses, calls the library, and prints."""

from __future__ import annotations

import argparse
import contextlib
import sys

from sparsegen.cli import bench, bench_serve, contextual, evaluate, run, serve, sweep, tasks, weights
from sparsegen.cli.common import Parser
from sparsegen.cli.tasks import cmd_lm_eval

# commands that run outside ``reusing_freed_memory``: bench's per-row memory peaks must not hold what an earlier row
# freed, and a server hands memory back between requests
MEASURED_OR_SERVING = ("bench", "bench-serve", "serve")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="sparsegen", description="Sparse, long-sequence inference for Hugging Face causal LMs.",
                    epilog="sparsegen --plugin FILE.py|MODULE COMMAND ...: import a file or module that registers a "
                           "policy, pruning method or model family first")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (run, evaluate, tasks, bench, sweep, weights, contextual, serve, bench_serve):
        group.add_parsers(sub)
    return parser


def _load_plugins(argv: list[str]) -> list[str]:
    """Import every leading ``--plugin FILE.py|MODULE`` (what it registers then shows in the commands' choices); the
    rest of ``argv``."""
    from sparsegen.plugins import load_plugin

    while argv and (argv[0] == "--plugin" or argv[0].startswith("--plugin=")):
        if "=" in argv[0]:
            spec, argv = argv[0].split("=", 1)[1], argv[1:]
        else:
            spec, argv = (argv[1] if len(argv) > 1 else ""), argv[2:]
        if not spec:
            raise ValueError("--plugin takes a .py file or a module name")
        load_plugin(spec)
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        argv = _load_plugins(argv)
    except (OSError, ValueError, ImportError) as err:
        print(f"sparsegen: error: {err}", file=sys.stderr)
        return 2
    try:
        if argv[:1] == ["lm-eval"]:  # lm-eval parses its own arguments
            args = argparse.Namespace(command="lm-eval", func=cmd_lm_eval, lm_eval_args=argv[1:])
        else:
            args = build_parser().parse_args(argv)
    except SystemExit as exit:  # --help, or a usage mistake (already reported in one line)
        return exit.code
    from sparsegen.allocator import reusing_freed_memory
    from sparsegen.models import ModelLoadError

    memory = contextlib.nullcontext() if args.command in MEASURED_OR_SERVING else reusing_freed_memory()
    try:
        with memory:
            args.func(args)
    except (ModelLoadError, OSError, ValueError) as err:  # what a user can cause; anything else is a bug: traceback
        message = str(err) if not isinstance(err, OSError) or not err.filename else \
            f"{err.filename}: {err.strerror or err}"
        print(f"sparsegen {args.command}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
