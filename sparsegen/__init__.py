"""sparsegen: sparse, long-sequence inference for Hugging Face causal LMs.

The public API: load a model (with its run-time weights, contextual plan and prompt), generate through an evicting KV
cache, compress a context once, inspect what each policy keeps, prune, quantize, fit contextual sparsity, tune a soft
prompt.
"""

from sparsegen.paths import use_compile_cache

use_compile_cache()  # (before anything imports torch._dynamo)

from sparsegen.assemble import load  # noqa: E402
from sparsegen.contextual import Contextual, DejaVuConfig, fit_dejavu, fit_teal
from sparsegen.engine.context import CompressedContext
from sparsegen.engine.generate import Generation, compare, compress, generate
from sparsegen.engine.speculative import Speculation
from sparsegen.eval.inspect import inspect
from sparsegen.kv import EvictionCache, Policy, PolicySpec, TokenView, make_policy, patched
from sparsegen.models import ModelLoadError, ModelSpec, model_spec
from sparsegen.models.compat import cache_kwargs
from sparsegen.prompt import PromptPrefix, TuneConfig, tune_prompt
from sparsegen.pruning import PruneConfig, prune_model, save_pruned
from sparsegen.quant import QuantizeConfig, quantize_model

__version__ = "0.1.0"
__all__ = ["CompressedContext", "Contextual", "DejaVuConfig", "EvictionCache", "Generation", "ModelLoadError",
           "ModelSpec", "Policy", "PolicySpec", "PromptPrefix", "PruneConfig", "QuantizeConfig", "Speculation",
           "TokenView", "TuneConfig", "cache_kwargs", "compare", "compress", "fit_dejavu", "fit_teal", "generate",
           "inspect", "load", "make_policy", "model_spec", "patched", "prune_model", "quantize_model", "save_pruned",
           "tune_prompt", "__version__"]
