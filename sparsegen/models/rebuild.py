"""Checkpoints whose layers a kind of sparsity reshaped (structured pruning shrinks matrices, quantization swaps
linears for packed ones) record how in a ``config.json`` key. The package that writes a key registers here how to
rebuild that shape on a freshly built model, so loading needs no knowledge of any kind of sparsity."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from transformers import PretrainedConfig

Rebuild = Callable[[nn.Module, Any], None]
_REBUILDERS: dict[str, tuple[int, Rebuild, Callable[[Any], bool]]] = {}


def register_rebuilder(key: str, rebuild: Rebuild, order: int, claims: Callable[[Any], bool] = bool) -> None:
    """``rebuild(model, config.<key>)`` reshapes a fresh model as recorded, for the values ``claims`` accepts (a
    shared key such as ``quantization_config`` may hold formats that transformers loads itself); lower ``order``
    runs first."""
    _REBUILDERS[key] = (order, rebuild, claims)


def recorded(config: PretrainedConfig) -> list[str]:
    """The reshaping keys ``config`` records, in the order they are rebuilt."""
    values = {key: getattr(config, key, None) for key in config.to_dict()}
    unknown = [key for key, value in values.items() if key.startswith("sparsegen_") and value and key not in _REBUILDERS]
    if unknown:
        raise ValueError(f"config.json records {', '.join(unknown)}, which this version of sparsegen cannot "
                         f"rebuild; upgrade sparsegen")
    keys = [key for key, (_, _, claims) in _REBUILDERS.items() if values.get(key) and claims(values[key])]
    return sorted(keys, key=lambda key: _REBUILDERS[key][0])


def rebuild(model: nn.Module, config: PretrainedConfig, only: str | None = None) -> None:
    """Reshape a freshly built ``model`` as ``config`` records (before its weights are loaded); ``only``: just
    that key's reshaping (e.g. sizes without quantization, to count parameters)."""
    for key in recorded(config):
        if only is None or key == only:
            _REBUILDERS[key][1](model, getattr(config, key))
