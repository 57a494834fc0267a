"""The shared layer every kind of sparsity builds on: loading models and reading their shape."""

from sparsegen.models.families import FAMILIES, Family, register_family
from sparsegen.models.loading import ModelLoadError, load, load_config
from sparsegen.models.spec import ModelSpec, model_spec

__all__ = ["FAMILIES", "Family", "ModelLoadError", "ModelSpec", "load", "load_config", "model_spec", "register_family"]
