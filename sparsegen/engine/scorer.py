"""Fitting ``kvzap``'s learned scorer: KVzip's reconstruction scores (``sparsegen.engine.reconstruct``) on calibration
windows, and per layer and KV head a ridge regression of their log on each token's features
(``sparsegen.kv.policies.kvzap.token_features``), solved in closed form from accumulated moments."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import torch
from tqdm.auto import tqdm

from sparsegen.engine.prefill import prefill
from sparsegen.kv.cache import DEFAULT_CHUNK, EvictionCache
from sparsegen.kv.policies.kvzap import FORMAT, token_features
from sparsegen.kv.policies.kvzip import KVzip
from sparsegen.models.anatomy import model_fingerprint

FLOOR = 1e-6  # scores below this are alike (the log of a probability no query gave)
KEEP = 0.3  # the share of tokens the fit's agreement is measured at


def reconstruction_samples(model: torch.nn.Module, ids: torch.Tensor, chunk_size: int = DEFAULT_CHUNK):
    """Per scored layer of one window ``[1, n]``: ``(layer index, features [heads, n, F], log scores [heads, n])``."""
    cache = EvictionCache(model, KVzip(None), chunk_size=chunk_size)
    prefill(model, cache, ids, torch.ones_like(ids), chunk_size, progress=False)
    for i, layer in enumerate(cache.layers):
        if layer.attention is not None:  # (not a sliding-window layer: it keeps its window)
            keys, values = layer.held(layer.used)
            yield i, token_features(keys, values)[0], layer.attention[0, :, :layer.used].clamp(min=FLOOR).log()


def agreement(predicted: torch.Tensor, target: torch.Tensor, keep: float = KEEP) -> float:
    """The share of the tokens KVzip's scores keep at ``keep`` of them that the prediction keeps too, per head."""
    k = max(1, round(keep * target.shape[-1]))
    ours, theirs = predicted.topk(k, dim=-1).indices, target.topk(k, dim=-1).indices
    hits = torch.zeros_like(target, dtype=torch.bool).scatter_(-1, theirs, True).gather(-1, ours)
    return float(hits.float().mean())


@torch.inference_mode()
def fit_scorer(model: torch.nn.Module, windows: torch.Tensor, held_out: torch.Tensor, ridge: float = 1e-2,
               chunk_size: int = DEFAULT_CHUNK, progress: bool = True) -> tuple[torch.Tensor, dict]:
    """Weights ``[layers, kv_heads, F]`` fit on ``windows`` ``[N, n]`` and the fit's report: per layer, the share of
    KVzip's kept tokens (at 30%) the prediction keeps on ``held_out`` windows, per head and with every layer's and
    head's scores ranked together (``kvzap-global``)."""
    layers = model.config.get_text_config().num_hidden_layers
    gram: dict[int, torch.Tensor] = {}
    moment: dict[int, torch.Tensor] = {}
    for row in tqdm(windows, desc="fit-scorer: KVzip's scores", unit="window", disable=not progress):
        for i, x, y in reconstruction_samples(model, row[None], chunk_size):
            gram[i] = gram.get(i, 0) + x.double().transpose(-1, -2) @ x.double()
            moment[i] = moment.get(i, 0) + x.double().transpose(-1, -2) @ y.double()[..., None]
    if not gram:
        raise ValueError("the model has no layer a KV policy scores (every layer a sliding window)")
    heads, features = next(iter(gram.values())).shape[:2]
    weights = torch.zeros(layers, heads, features)
    for i in gram:
        scale = gram[i].diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]  # (a ridge relative to the features')
        eye = torch.eye(features, dtype=torch.float64)
        eye[-1, -1] = 0  # (the constant feature unpenalized: a penalized intercept leans on the others for the mean)
        weights[i] = torch.linalg.solve(gram[i] + ridge * scale * eye, moment[i])[..., 0].float()
    agree: dict[int, list[float]] = {}
    across: list[float] = []  # (the model's top 30% ranked together, as ``kvzap-global`` keeps)
    for row in held_out:
        predicted, target = [], []
        for i, x, y in reconstruction_samples(model, row[None], chunk_size):
            predicted.append(torch.einsum("htf,hf->ht", x, weights[i]))
            target.append(y)
            agree.setdefault(i, []).append(agreement(predicted[-1], y))
        across.append(agreement(torch.cat(predicted).flatten(), torch.cat(target).flatten()))
    per_layer = {i: round(sum(v) / len(v), 4) for i, v in sorted(agree.items())}
    report = {"windows": len(windows), "held_out": len(held_out), "tokens": windows.shape[1], "ridge": ridge,
              "kept_agreement_by_layer": per_layer,
              "kept_agreement": round(sum(per_layer.values()) / max(len(per_layer), 1), 4),
              "kept_agreement_across_layers": round(sum(across) / max(len(across), 1), 4)}
    return weights, report


def save_scorer(path: str | Path, model: torch.nn.Module, weights: torch.Tensor, report: dict, name: str = "") -> Path:
    """Write the scorer as ``kvzap`` reads it: safetensors, fingerprinted to ``model``, atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"save a KV scorer as NAME.safetensors, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "model": name, "fingerprint": model_fingerprint(model), **report}
    partial = path.with_suffix(f".{uuid.uuid4().hex[:8]}.partial")
    save_file({"weights": weights.contiguous()}, str(partial), metadata={"sparsegen": json.dumps(meta)})
    partial.replace(path)
    return path
