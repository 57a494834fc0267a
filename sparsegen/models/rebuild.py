"""Checkpoints whose layers a kind of sparsity reshaped (structured pruning shrinks matrices, quantization swaps
linears for packed ones) record how in a ``config.json`` key. Each key names the function that rebuilds that shape on
a freshly built model, as ``"module:function"``: loading imports it when, and only when, a checkpoint records the key,
so a checkpoint loads the same whatever was imported before (``import sparsegen.models`` alone is enough), and this
base layer needs no knowledge of any kind of sparsity."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import PretrainedConfig


@dataclass(frozen=True)
class Rebuilder:
    order: int  # lower runs first (sizes before the layers that hold them are swapped)
    rebuild: str  # "module:function": function(model, config.<key>) reshapes a fresh model as recorded
    claims: str | None = None  # "module:function": whether a value of a shared key is one ``rebuild`` reads

    def call(self, name: str, *args) -> Any:
        module, _, function = getattr(self, name).partition(":")
        return getattr(importlib.import_module(module), function)(*args)


REBUILDERS: dict[str, Rebuilder] = {
    "sparsegen_structure": Rebuilder(0, "sparsegen.pruning.structured:rebuild"),
    # compressed-tensors' key: transformers reads other formats under it itself
    "quantization_config": Rebuilder(1, "sparsegen.quant.quantize:rebuild", "sparsegen.quant.quantize:ours"),
}


def register_rebuilder(key: str, rebuilder: Rebuilder) -> None:
    """A new reshaping ``key`` (an extension's own checkpoints)."""
    REBUILDERS[key] = rebuilder


def recorded(config: PretrainedConfig) -> list[str]:
    """The reshaping keys ``config`` records, in the order they are rebuilt."""
    values = {key: getattr(config, key, None) for key in config.to_dict()}
    unknown = [key for key, value in values.items() if key.startswith("sparsegen_") and value and key not in REBUILDERS]
    if unknown:
        raise ValueError(f"config.json records {', '.join(unknown)}, which this version of sparsegen cannot "
                         f"rebuild; upgrade sparsegen")
    keys = [key for key, rebuilder in REBUILDERS.items() if values.get(key)
            and (rebuilder.claims is None or rebuilder.call("claims", values[key]))]
    return sorted(keys, key=lambda key: REBUILDERS[key].order)


def rebuild(model: nn.Module, config: PretrainedConfig, only: str | None = None) -> None:
    """Reshape a freshly built ``model`` as ``config`` records (before its weights are loaded); ``only``: just
    that key's reshaping (e.g. sizes without quantization, to count parameters)."""
    for key in recorded(config):
        if only is None or key == only:
            REBUILDERS[key].call("rebuild", model, getattr(config, key))
