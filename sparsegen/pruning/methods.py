"""Pruning methods by name: each is a class that scores a linear's weights (higher = keep) from what it needs of the
layer's inputs, or prunes the weight itself (SparseGPT's update). A method of your own registers itself with
``register_pruning_method`` in a file of its own (``examples/custom_pruning.py``; ``sparsegen --plugin FILE prune
...``), or from an installed package through the ``sparsegen.pruning_methods`` entry point group."""

from __future__ import annotations

from typing import ClassVar

import torch

from sparsegen.models.calibration import Statistics
from sparsegen.plugins import from_entry_points
from sparsegen.pruning.masks import magnitude_scores, n_m_mask, unstructured_mask, wanda_scores
from sparsegen.pruning.sparsegpt import sparsegpt_prune

ENTRY_POINTS = "sparsegen.pruning_methods"


class PruningMethod:
    """A rule for which weights of a linear become zero."""

    name: ClassVar[str]
    # what it needs of each linear's calibration inputs: None (nothing: no data needed), "norms" (each input's sum of
    # squares, ``Statistics.sq_sum``) or "hessian" (``Statistics.hessian()``)
    statistic: ClassVar[str | None] = None
    per_row: ClassVar[bool] = False  # compare scores within each output row unless told otherwise (Wanda's finding)
    structured: ClassVar[bool] = True  # can score whole MLP neurons and KV groups (by weight size x input norms)

    def scores(self, weight: torch.Tensor, stats: Statistics | None) -> torch.Tensor:
        """A score per weight, higher = keep."""
        raise NotImplementedError

    def prune(self, weight: torch.Tensor, stats: Statistics | None, sparsity: float,
              nm: tuple[int, int] | None, per_row: bool) -> torch.Tensor:
        """``weight`` with the pruned entries zero: the lowest scores, per N:M group or to ``sparsity``."""
        scores = self.scores(weight, stats)
        mask = n_m_mask(scores, *nm) if nm is not None else unstructured_mask(scores, sparsity, per_row)
        return weight.masked_fill(mask, 0)


PRUNING_METHODS: dict[str, type[PruningMethod]] = {}


def register_pruning_method(cls: type[PruningMethod]) -> type[PruningMethod]:
    """Class decorator: make a pruning method available by its ``name`` (``PruneConfig``, ``sparsegen prune
    --method``)."""
    if not (isinstance(cls, type) and issubclass(cls, PruningMethod)) \
            or not isinstance(getattr(cls, "name", None), str):
        raise TypeError("register_pruning_method takes a PruningMethod subclass with a name")
    if cls.statistic not in (None, "norms", "hessian"):
        raise ValueError(f"{cls.__name__}.statistic must be None, 'norms' or 'hessian', got {cls.statistic!r}")
    PRUNING_METHODS[cls.name] = cls
    return cls


def pruning_method(name: str) -> PruningMethod:
    """The registered method called ``name`` (looking in installed packages' entry points if it is not yet)."""
    if name not in PRUNING_METHODS and (found := from_entry_points(ENTRY_POINTS, name)) is not None:
        register_pruning_method(found)
    if name not in PRUNING_METHODS:
        raise ValueError(f"unknown pruning method {name!r}; choose one of {', '.join(PRUNING_METHODS)}")
    return PRUNING_METHODS[name]()


@register_pruning_method
class Magnitude(PruningMethod):
    """The smallest weights go (the classic baseline; no data)."""

    name = "magnitude"

    def scores(self, weight, stats):
        return magnitude_scores(weight)


@register_pruning_method
class Wanda(PruningMethod):
    """Weight size times the norm of its input (Sun et al., "A Simple and Effective Pruning Approach for Large Language
    Models", 2023), compared within each output row."""

    name = "wanda"
    statistic = "norms"
    per_row = True

    def scores(self, weight, stats):
        return wanda_scores(weight, stats.sq_sum)


@register_pruning_method
class SparseGPT(PruningMethod):
    """Prune column by column and let the kept weights absorb the error through the inputs' inverse Hessian
    (``sparsegen.pruning.sparsegpt``); single weights only."""

    name = "sparsegpt"
    statistic = "hessian"
    structured = False

    def prune(self, weight, stats, sparsity, nm, per_row):
        return sparsegpt_prune(weight, stats.hessian(), sparsity, nm)[0]
