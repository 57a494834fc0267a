"""Weight pruning: magnitude, Wanda and SparseGPT, unstructured or N:M, calibrated layer by layer."""

from sparsegen.pruning.prune import METHODS, PruneConfig, calibration_ids, prune_model, save_pruned

__all__ = ["METHODS", "PruneConfig", "calibration_ids", "prune_model", "save_pruned"]
