import copy
import json
import weakref
from pathlib import Path

import torch

from sparsegen.kv.policies.kvzip import KVzip
from sparsegen.kv.policy import TokenView, register_policy

FORMAT = "sparsegen.kv_scorer/1"


def token_features(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[..., slot, features]``: what a held token carries that its position does not change: each rotary pair's
    magnitude of its key (RoPE turns a pair, never stretches it; keys are held rotated at their position), its value,
    and 1."""
    k = keys.float()
    half = k.shape[-1] // 2
    pairs = (k[..., :half].square() + k[..., half:2 * half].square()).sqrt()
    return torch.cat((pairs, values.float(), torch.ones_like(pairs[..., :1])), dim=-1)


def load_scorer(path: str | Path) -> tuple[torch.Tensor, dict]:
    """A fitted scorer's weights ``[layers, kv_heads, features]`` and metadata, checked whole."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no KV scorer at {str(path)!r}: fit one with `sparsegen fit-scorer --model M --out "
                                f"{path}`")
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("sparsegen", "{}"))
        weights = f.get_tensor("weights") if "weights" in f.keys() else None
    if meta.get("format") != FORMAT or weights is None or weights.dim() != 3:
        raise ValueError(f"{str(path)!r} is not a sparsegen KV scorer ({FORMAT}): fit one with `sparsegen fit-scorer`")
    return weights.float(), meta


@register_policy
class KVzap(KVzip):
    """A learned stand-in for KVzip's scores (in the spirit of KVzap, Jegou et al., 2025): per layer and KV head, a
    linear model of what each held token carries (``token_features``) predicts the log of the score KVzip's
    reconstruction would give it, fit on calibration text by ``sparsegen fit-scorer``. No second pass over the
    context: the prefill and every decode step score held tokens from their keys and values alone. The ``recent``
    newest tokens and the ``sinks`` are kept as KVzip keeps them."""

    name = "kvzap"
    needs_attention = False
    attention_statistic = "sum"
    reconstructs = False
    needs_keys = True
    needs_values = True

    def __init__(self, budget: int | None, scorer: str | None = None, recent: int | None = None, sinks: int = 0):
        super().__init__(budget, recent=recent, sinks=sinks)
        if scorer is None:
            raise ValueError("kvzap scores with a fitted scorer: give scorer=PATH (--scorer PATH), a file "
                             "`sparsegen fit-scorer` wrote")
        self.scorer = str(scorer)
        self.weights, self.meta = load_scorer(scorer)
        self.layer: torch.Tensor | None = None  # [kv_heads, features]: this layer's (``for_layer``)
        self._checked: weakref.WeakSet = weakref.WeakSet()

    def check_model(self, model: torch.nn.Module) -> None:
        from sparsegen.models.anatomy import model_fingerprint

        if model not in self._checked and model_fingerprint(model) != self.meta.get("fingerprint"):
            raise ValueError(f"the KV scorer {self.scorer!r} was fit on another model ({self.meta.get('model')}, "
                             f"fingerprint {self.meta.get('fingerprint')}): fit one for this model and weights with "
                             "`sparsegen fit-scorer`")
        self._checked.add(model)

    def for_layer(self, index: int, layers: int) -> "KVzap":
        if layers != self.weights.shape[0]:
            raise ValueError(f"the KV scorer {self.scorer!r} has {self.weights.shape[0]} layers, the model {layers}")
        own = copy.copy(self)
        own.layer = self.weights[index]
        return own

    def priority(self, view: TokenView) -> torch.Tensor:
        weights = self.layer.to(view.keys.device)
        features = token_features(view.keys, view.values)
        if view.head is None:
            scores = torch.einsum("bhtf,hf->bht", features, weights)
        else:  # (a layer's heads pooled in one row of slots: each slot scored by its own head's weights)
            scores = (features * weights[view.head]).sum(-1)
        return self.protected(view, scores)

    def describe(self):
        return {**super().describe(), "scorer": self.scorer}
