"""Calibration, layer by layer, as Wanda, SparseGPT and GPTQ do it: windows of real text run through the decoder one
layer at a time, each layer seeing the outputs of the layers before it as the caller left them (already
compressed), with only one layer's activations held at once."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from tqdm.auto import tqdm

from sparsegen.models.anatomy import decoder_layers, linears, weights_of


def calibration_ids(token_arrays: list[np.ndarray], nsamples: int, seqlen: int, seed: int,
                    bos_id: int | None) -> torch.Tensor:
    """``[nsamples, seqlen]`` windows at random offsets of random files (weighted by length), BOS first if given."""
    body = seqlen - 1 if bos_id is not None else seqlen
    arrays = [a for a in token_arrays if len(a) > body]
    if not arrays:
        raise ValueError(f"no calibration text is longer than {body} tokens; lower --seqlen")
    rng = np.random.default_rng(seed)
    lengths = np.array([len(a) - body for a in arrays], dtype=np.float64)
    rows = []
    for choice in rng.choice(len(arrays), size=nsamples, p=lengths / lengths.sum()):
        offset = rng.integers(0, len(arrays[choice]) - body)
        rows.append(arrays[choice][offset:offset + body].astype(np.int64))
    ids = torch.from_numpy(np.stack(rows))
    if bos_id is not None:
        ids = torch.cat([torch.full((nsamples, 1), bos_id), ids], dim=1)
    return ids


class _Stop(Exception):
    pass


def first_layer_inputs(model, ids: torch.Tensor, batch_size: int) -> list[tuple[torch.Tensor, list[dict]]]:
    """Per mini-batch: the hidden states the first decoder layer receives and the keyword arguments (masks, RoPE)
    each layer receives. Layers of different kinds (Gemma 3's sliding-window and global layers) get different
    ones, so the forward runs until the first layer of every kind has shown its own."""
    layers = decoder_layers(model)
    types = getattr(model.config.get_text_config(), "layer_types", None)
    kinds = list(types) if types and len(types) == len(layers) else [None] * len(layers)
    first = {kind: kinds.index(kind) for kind in kinds}
    last = max(first.values())
    captured, seen = [], {}

    def grab(index, module, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs.pop("hidden_states", None)
        if index == 0:
            captured.append(hidden)
        seen[kinds[index]] = kwargs
        if index == last:
            raise _Stop

    device = next(model.parameters()).device
    handles = [layers[i].register_forward_pre_hook(partial(grab, i), with_kwargs=True) for i in first.values()]
    inputs = []
    try:
        for start in range(0, len(ids), batch_size):
            try:
                model(input_ids=ids[start:start + batch_size].to(device), use_cache=False)
            except _Stop:
                pass
            inputs.append((captured[-1], [seen[kind] for kind in kinds]))
    finally:
        for handle in handles:
            handle.remove()
    return inputs


def run_layer(layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


class Statistics:
    """What one linear layer's inputs say: per-column sums of squares (``norms``, Wanda) or ``X^T X``
    (``hessian``, SparseGPT and GPTQ)."""

    def __init__(self, linear: torch.nn.Linear, kind: str):
        cols = linear.in_features
        device = linear.weight.device
        self.tokens = 0
        self.sq_sum = torch.zeros(cols, dtype=torch.float64, device=device) if kind == "norms" else None
        self.xtx = torch.zeros(cols, cols, dtype=torch.float32, device=device) if kind == "hessian" else None

    def __call__(self, module, args, output) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        self.tokens += len(x)
        if self.sq_sum is not None:
            self.sq_sum += x.pow(2).sum(0).double()
        if self.xtx is not None:
            self.xtx += x.T @ x

    def hessian(self) -> torch.Tensor:
        return 2 * self.xtx / self.tokens


def calibrated_layers(model: torch.nn.Module, ids: torch.Tensor | None, statistic: str | None, batch_size: int,
                      desc: str, progress: bool = True):
    """Walk the decoder layers in order, yielding ``(index, layer, linears, stats)``.

    With a ``statistic`` ("norms" or "hessian") ``stats`` holds, per linear, what its inputs said when the
    calibration tokens ran through the layers before it *as the caller left them*: once the caller has
    compressed a layer (in place, or by swapping its linears), that layer's outputs feed the next.
    """
    if weights_of(model) != "fp32":
        raise ValueError(f"{desc} changes the model's float linears, but they are stored as {weights_of(model)}: "
                         "load it with weights='fp32' (sparsegen.load(..., weights='fp32'))")
    layers = decoder_layers(model)
    inputs = first_layer_inputs(model, ids, batch_size) if statistic else []
    for index, layer in enumerate(tqdm(layers, desc=desc, unit="layer", disable=not progress)):
        found = linears(layer)
        stats = {}
        if statistic:
            stats = {name: Statistics(linear, statistic) for name, linear in found.items()}
            handles = [linear.register_forward_hook(stats[name]) for name, linear in found.items()]
            for hidden, kwargs in inputs:
                run_layer(layer, hidden, kwargs[index])
            for handle in handles:
                handle.remove()
        yield index, layer, found, stats
        if statistic:
            inputs = [(run_layer(layer, hidden, kwargs[index]), kwargs) for hidden, kwargs in inputs]
