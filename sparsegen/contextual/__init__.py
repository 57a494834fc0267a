"""Contextual sparsity: per-input MLP neurons and attention heads that matter (Deja Vu, TEAL)."""
