"""Lets a bare ``lm_eval --model sparsegen`` (and ``get_model("sparsegen")``) find sparsegen's model.

lm-eval 0.4.13 has no plugin list for models: it knows its own table, ``lm_eval.models.MODEL_MAPPING``, and what
was imported before it is asked. So the install ships this module beside a ``sparsegen-lm-eval.pth`` file (see
``setup.py``), which Python runs at start-up: it waits for ``lm_eval.models`` to load and then adds ``sparsegen`` to
lm-eval's registry as a lazy entry, exactly as lm-eval lists its own. (It waits for the table, not the registry:
lm-eval loads its table only while the registry is empty, so an entry added first would hide lm-eval's own models.)
Start-up stays cheap: nothing is imported until lm-eval itself loads, and sparsegen and torch only when the model is
asked for.
"""

from __future__ import annotations

import sys
from types import ModuleType

WATCHED = "lm_eval.models"
MODEL = ("sparsegen", "sparsegen.eval.harness:SparsegenLM")


class _RegisterAfterLoading:
    """Runs lm-eval's own loader for its models table, then registers sparsegen beside them."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def create_module(self, spec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        from lm_eval.api.registry import model_registry

        name, target = MODEL
        if name not in model_registry:
            model_registry.register(name, target=target)


class LmEvalFinder:
    """A meta-path finder that answers only for ``lm_eval.models``: it asks the other finders for the module and
    wraps the loader they give."""

    @classmethod
    def find_spec(cls, name: str, path=None, target=None):
        if name != WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is cls or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfterLoading(spec.loader)
                return spec
        return None


def install() -> None:
    """Called by the ``.pth`` file; a second call (a venv seen twice on the path) changes nothing."""
    if LmEvalFinder not in sys.meta_path:
        sys.meta_path.insert(0, LmEvalFinder)
