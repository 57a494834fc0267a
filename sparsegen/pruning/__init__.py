"""Weight pruning: magnitude, Wanda and SparseGPT, unstructured or N:M, calibrated layer by layer."""

from sparsegen.pruning.prune import METHODS, PruneConfig, prune_model, save_pruned

__all__ = ["METHODS", "PruneConfig", "prune_model", "save_pruned"]
