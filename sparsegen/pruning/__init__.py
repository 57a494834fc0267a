"""Weight pruning: magnitude, Wanda and SparseGPT, unstructured or N:M, calibrated layer by layer."""

from sparsegen.pruning.methods import PruningMethod, register_pruning_method
from sparsegen.pruning.prune import METHODS, PruneConfig, prune_model, save_pruned

__all__ = ["METHODS", "PruneConfig", "PruningMethod", "prune_model", "register_pruning_method", "save_pruned"]
