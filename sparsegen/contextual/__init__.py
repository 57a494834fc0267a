"""Contextual sparsity: per-input MLP neurons and attention heads that matter (Deja Vu, TEAL)."""

from sparsegen.contextual.dejavu import DejaVuConfig, fit_dejavu
from sparsegen.contextual.runtime import Contextual, attach, detach
from sparsegen.contextual.teal import fit_teal

__all__ = ["Contextual", "DejaVuConfig", "attach", "detach", "fit_dejavu", "fit_teal"]
