"""sparsegen: sparse, long-sequence inference for Hugging Face causal LMs."""

from sparsegen.generation import Generation, generate
from sparsegen.models import ModelLoadError, ModelSpec, load, model_spec

__version__ = "0.1.0"
__all__ = ["Generation", "ModelLoadError", "ModelSpec", "generate", "load", "model_spec", "__version__"]
