"""Running a decode step's decoder layers a block at a time through one compiled function (regional compilation):
what lets a compiled step cost one block's compile instead of the whole model's.

A graph traced through a layer that reads its own index (``cache.layers[module.layer_idx]``, ``cache.update(...,
layer_idx)``) is specialized to that index: every layer would compile anew. Inside a block each layer sees the cache
through a ``LayerView`` that answers every index with the layer's own state, so the graph of one block serves every
block of the same layer kinds.

``route(model)`` (``prepare`` installs it) gives each decoder layer an instance ``forward`` that runs the layer's own
unless the call's cache is running a block step (``BlockStep``, set on the cache by the decode step for one call):
then the calls of a block's layers are gathered (the first ones hand their input on unchanged) and, at the block's
last layer, the whole block runs through the compiled function, from the input of its first. The model's own loop
over its layers, with each layer's own arguments (Gemma 3's local and global RoPE and masks), stays as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch

from sparsegen.models.anatomy import decoder_layers

CACHE_KWARG = "sparsegen_cache"  # how the decoder hook hands the cache to every layer's attention, through the call
RunBlock = Callable[[tuple, torch.Tensor, tuple], torch.Tensor]  # (layers, hidden, calls) -> hidden


class LayerView:
    """The cache as one decoder layer sees it inside a block: every layer index names this layer; everything else
    is the cache's own."""

    def __init__(self, cache, layer):
        self._cache, self._layer = cache, layer

    def __getattr__(self, name: str):
        return getattr(self._cache, name)

    def layer_for(self, index: int):
        return self._layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self._layer.update(key_states, value_states, *args, **kwargs)


class BlockStep:
    """One fixed-shape call's decoder layers in blocks of ``size`` (the last may be shorter), each run by
    ``run_block``."""

    def __init__(self, cache, model: torch.nn.Module, size: int, run_block: RunBlock):
        layers = tuple(decoder_layers(model))
        views = tuple(LayerView(cache, layer) for layer in cache.layers)
        self.cache, self.size, self.run_block = cache, size, run_block
        self.blocks = [(layers[start:start + size], views[start:start + size]) for start in range(0, len(layers), size)]
        self.calls: list[tuple[tuple, dict]] = []  # (each layer's arguments, the cache in them its view)

    def forward(self, index: int, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        layers, views = self.blocks[index // self.size]
        if len(self.calls) != index % self.size:
            raise RuntimeError(f"decoder layer {index} ran out of order: a block step needs the model to run its "
                               "layers in order, each on the previous one's output")
        view = views[index % self.size]
        self.calls.append((args, {name: view if value is self.cache else value for name, value in kwargs.items()}))
        if len(self.calls) < len(layers):
            return hidden  # (the block runs at its last layer, from this input on)
        calls, self.calls = tuple(self.calls), []
        # (no memo in a block: what one block memoized would be the next one's to compute (one graph for all), and a
        # memo filled inside a graph is a dictionary dynamo's code fills after it, which a direct call could not
        # replay; the graph computes what the layers share once anyway, as its common subexpressions)
        self.cache.step.memo = None
        return self.run_block(layers, hidden, calls)


@contextmanager
def block_step(cache, model: torch.nn.Module, size: int, run_block: RunBlock) -> Iterator[BlockStep]:
    """For the call inside: ``cache``'s decoder layers run in blocks of ``size`` through ``run_block``. (The block
    step is kept with the cache: its views stay the same objects, step after step.)"""
    step = vars(cache).get("_blocks")
    if step is None or step.size != size or step.run_block is not run_block:
        step = cache._blocks = BlockStep(cache, model, size, run_block)
    cache.block_step = step
    try:
        yield step
    finally:
        cache.block_step, step.calls = None, []


def run_block(layers: tuple, hidden: torch.Tensor, calls: tuple) -> torch.Tensor:
    """A block's layers one after another, each on its own arguments (what the compiled block traces)."""
    for layer, (args, kwargs) in zip(layers, calls):
        hidden = _own_forward(layer)(layer, hidden, *args, **kwargs)
    return hidden


def route(model: torch.nn.Module) -> None:
    """Give each decoder layer the forward that defers to a block step (idempotent)."""
    for index, layer in enumerate(decoder_layers(model)):
        if not isinstance(vars(layer).get("forward"), partial):
            layer.forward = partial(_routed_forward, layer, index)


def unroute(model: torch.nn.Module) -> None:
    for layer in decoder_layers(model):
        if isinstance(vars(layer).get("forward"), partial):
            del layer.forward


def hooked(model: torch.nn.Module) -> bool:
    """Whether a decoder layer has hooks of its own (Deja Vu's predictors): they run where the layer is called, which
    a block step moves, so such a model's step compiles whole."""
    return any(layer._forward_pre_hooks or layer._forward_hooks for layer in decoder_layers(model))


def _routed_forward(layer: torch.nn.Module, index: int, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    blocks = getattr(kwargs.get(CACHE_KWARG), "block_step", None)
    if blocks is None:
        return _own_forward(layer)(layer, hidden, *args, **kwargs)
    return blocks.forward(index, hidden, args, kwargs)


def _own_forward(layer: torch.nn.Module) -> Callable:
    return type(layer).forward
