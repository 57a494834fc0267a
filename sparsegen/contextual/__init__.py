"""Contextual sparsity: per-input MLP neurons and attention heads that matter (Deja Vu, TEAL)."""

from sparsegen.contextual.runtime import Contextual, attach, detach

__all__ = ["Contextual", "attach", "detach"]
