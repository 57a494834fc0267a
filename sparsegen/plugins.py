"""Extensions from outside the package: a Python file or an importable module that registers a policy
(``sparsegen.kv.register_policy``), a pruning method or a model family when it is imported. ``sparsegen --plugin
FILE.py COMMAND ...`` imports it before the command runs; installed packages use entry points instead."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType


def from_entry_points(group: str, name: str):
    """What an installed package offers as ``name`` in the entry point ``group`` (None if none does)."""
    for point in entry_points(group=group):
        if point.name == name:
            return point.load()
    return None


def load_plugin(spec: str) -> ModuleType:
    """Import ``spec``: a path to a ``.py`` file, or a module name."""
    if spec.endswith(".py"):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"no plugin file {spec!r}")
        name = f"sparsegen_plugin_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up by name
        module_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as err:
        raise ValueError(f"--plugin {spec!r}: no such module or .py file ({err})") from None
