"""The package's layering: ``models`` is the base every kind of sparsity builds on, ``kv`` stands beside it, and no
module imports, even lazily inside a function, a module that imports it back."""

import ast
from pathlib import Path

import sparsegen

PACKAGE = Path(sparsegen.__file__).parent
UPPER = ("pruning", "quant", "prompt", "contextual", "eval", "bench", "serve", "cli", "engine")


def _imports() -> dict[str, set[str]]:
    """Every sparsegen module -> the sparsegen modules it imports (at the top or inside functions)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("sparsegen",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "sparsegen":  # (from sparsegen import native)
                found |= {f"sparsegen.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sparsegen"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name.startswith("sparsegen")}
        graph[name] = found
    return graph


def test_models_and_kv_import_no_kind_of_sparsity_or_anything_above():
    wrong = {(module, target) for module, targets in _imports().items()
             if module.startswith(("sparsegen.models", "sparsegen.kv")) for target in targets
             if target.split(".")[1] in UPPER}
    assert not wrong, wrong


def test_the_engine_imports_no_front_end_and_only_it_stacks_or_rolls_back_rows():
    """``engine`` (step, generation, speculation, scheduler) sits under ``serve``, ``bench``, ``eval`` and ``cli``; a
    cache's row operations (``kv.rows``, ``kv.rollback``) are the engine's, called by nothing above it."""
    graph = _imports()
    up = {(m, t) for m, targets in graph.items() if m.startswith("sparsegen.engine") for t in targets
          if t.split(".")[1] in ("serve", "bench", "eval", "cli", "sweep", "experiment")}
    rows = {m for m, targets in graph.items() if targets & {"sparsegen.kv.rows", "sparsegen.kv.rollback"}}
    assert not up, up
    assert {m.split(".")[1] for m in rows} == {"engine"}, rows


def test_no_import_cycles():
    graph = _imports()
    modules = {m: {t for t in targets if t in graph and t != m and not m.startswith(t + ".")}
               for m, targets in graph.items()}  # a module importing its own package's __init__ is not a cycle
    visiting, done, cycles = set(), set(), []

    def visit(module, path):
        visiting.add(module)
        for target in modules[module]:
            if target in visiting:
                cycles.append(path[path.index(target):] + [target] if target in path else [module, target])
            elif target not in done:
                visit(target, path + [target])
        visiting.discard(module)
        done.add(module)

    for module in sorted(modules):
        if module not in done:
            visit(module, [module])
    assert not cycles, cycles


def test_one_decode_step():
    """Only ``sparsegen.engine.step`` hands a cache to a model: generation, chat/serve, streaming perplexity, fidelity,
    pass-key, speculative decoding and bench all run ``forward``/``DecodeStep`` (issue 36)."""
    callers = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "cache_kwargs"}
    assert callers == {"engine/step.py"}, callers


def _dynamic_imports() -> dict[str, set[str]]:
    """Every sparsegen module -> the sparsegen modules it names for a later import by string (``"module:function"``
    constants, ``importlib.import_module("sparsegen...")``): imports the static graph above does not see."""
    import re

    named = re.compile(r"^(sparsegen(?:\.\w+)+)(?::\w+)?$")
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("sparsegen",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {match[1] for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.Constant) and isinstance(node.value, str)
                       and (match := named.match(node.value)) and ":" in node.value
                       or isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
                       and node.args and isinstance(node.args[0], ast.Constant)
                       and (match := named.match(str(node.args[0].value)))}
    return {module: targets for module, targets in graph.items() if targets}


def test_imports_by_string_resolve_and_reach_up_only_through_the_checkpoint_rebuild_registry():
    """A base module may name a higher layer's function in a string only where a checkpoint's own metadata decides
    what runs (``models.rebuild.REBUILDERS``: a pruned or quantized checkpoint's rebuild, imported when a checkpoint
    records it, never at import); any other string import of a higher layer from ``models`` or ``kv`` is the hidden
    rewiring this guard is for. Every named function exists."""
    import importlib

    from sparsegen.models.rebuild import REBUILDERS

    dynamic = _dynamic_imports()
    assert "sparsegen.models.rebuild" in dynamic  # the scan sees the registry (a scan that finds nothing cannot fail)
    declared = {spec.partition(":")[0] for r in REBUILDERS.values() for spec in (r.rebuild, r.claims) if spec}
    wrong = {(module, target) for module, targets in dynamic.items()
             if module.startswith(("sparsegen.models", "sparsegen.kv")) for target in targets
             if target.split(".")[1] in UPPER and not (module == "sparsegen.models.rebuild" and target in declared)}
    assert not wrong, wrong
    for rebuilder in REBUILDERS.values():
        for spec in (rebuilder.rebuild, rebuilder.claims):
            if spec:
                module, _, function = spec.partition(":")
                assert callable(getattr(importlib.import_module(module), function)), spec
