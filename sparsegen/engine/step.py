"""The one way sparsegen runs a model over a cache, top to bottom: ``forward`` (the only call into a model with a
cache: prefill chunks, drafting, verification), ``DecodeStep`` (one new token per row: model, cache update and
eviction inside the cache's layers, optionally compiled, a block of layers at a time or whole), ``next_token``
(sampling) and ``prefill`` (a prompt in chunks). ``generate``, ``chat``/``serve``, ``ppl --stream``, ``fidelity``,
``passkey``, speculative decoding and ``bench`` all decode through these, so what ``bench`` times is what users run."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial

import torch

from sparsegen import native
from sparsegen.engine import graph_calls
from sparsegen.kv.regions import block_step, hooked, run_block
from sparsegen.models.anatomy import decoder_layers
from sparsegen.models.compat import cache_kwargs
from sparsegen.paths import COMPILE_ENV

# graphs the one compiled step may hold (one per model, policy kind and (batch, slots) shape; past it dynamo fails
# loudly, fullgraph); dynamo's default, 8, is less than one bench run of a few policies over a few contexts needs
COMPILED_SHAPES = 128
KNOWN_STATES = 8  # states of one cache whose graphs a DecodeStep keeps to call directly (past it: forgets them)
COMPILE_NOTICE_AFTER = 2.0  # seconds a step through dynamo runs before the wait is shown (a compile, not a lookup)
COMPILE_MODES = ("regional", "whole")
# the fewest decoder layers of a regional step's block: a block's compile grows with its layers, the step's calls
# into the compiled code (each through dynamo's guards) with the blocks (docs/benchmarks.md, "What a compile costs:
# regional compilation")
BLOCK_LAYERS = 5


class CompileTally:
    """Every step of this process that went through dynamo and took more than ``COMPILE_NOTICE_AFTER`` (a compile,
    or a compile's load from the cache folder): how many and their seconds, for ``/metrics`` and ``serve``'s
    warm-up."""

    def __init__(self):
        self.count, self.seconds, self._lock = 0, 0.0, threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.count += 1
            self.seconds += seconds


COMPILES = CompileTally()


def compiles_by_default(model: torch.nn.Module) -> bool:
    """What ``compile=None`` means: the compiled step wherever it is the fast path: weights in low-bit kernels (what
    ``sparsegen.load`` gives a GGUF model by default; compiled, their kernels run without Python between them), or a
    CUDA device (CUDA graphs); eager where neither (a checkpoint folder in fp32 on a CPU, as it always ran)."""
    from sparsegen.quant.restore import PACKED_LINEARS

    if next(model.parameters()).device.type == "cuda":
        return True
    return any(isinstance(module, PACKED_LINEARS) for module in model.modules())


def compile_mode(model: torch.nn.Module, compile: bool | str | None) -> str | None:
    """What a step's ``compile`` means for ``model``: None (eager), ``"regional"`` (a block of decoder layers
    compiled once and run for every block: a compile in seconds) or ``"whole"`` (the whole step one graph: the
    fastest step, a compile of minutes). ``None``: compiled where it is the fast path (``compiles_by_default``);
    ``True``: regional on a CPU, whole on CUDA (one CUDA graph a step), and whole for a model whose decoder layers
    carry hooks of their own (a contextual plan's predictors, which a block would run out of place)."""
    if compile is None:
        compile = compiles_by_default(model)
    if compile is False:
        return None
    if compile is True:
        cuda = next(model.parameters()).device.type == "cuda"
        return "whole" if cuda or hooked(model) else "regional"
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be True, False, None or one of {', '.join(COMPILE_MODES)}; got {compile!r}")
    if compile == "regional" and hooked(model):
        raise ValueError("this model's decoder layers carry hooks (a contextual plan's predictors), which a "
                         "regional step would run out of place: compile='whole' (--compile whole)")
    return compile


def block_size(model: torch.nn.Module) -> int:
    """Decoder layers per block of a regional step: the fewest, at least ``BLOCK_LAYERS``, that repeat the model's
    pattern of layer kinds (Gemma 3's five local layers and a global one) and divide its layers into equal blocks
    (one graph for all), else a pattern's multiple past ``BLOCK_LAYERS`` (the last block then a graph of its own)."""
    count = len(decoder_layers(model))
    kinds = getattr(model.config.get_text_config(), "layer_types", None) or ["full_attention"] * count
    period = next(p for p in range(1, count + 1) if all(kinds[i] == kinds[i % p] for i in range(count)))
    sizes = [size for size in range(period, count + 1, period) if size >= min(BLOCK_LAYERS, count)]
    return next((size for size in sizes if count % size == 0), sizes[0] if sizes else count)


def forward(model: torch.nn.Module, cache, ids: torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor | None = None, last: bool = False, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Feed ``ids`` ``[B, T]`` at ``positions`` ``[B, T]`` into ``cache``: logits ``[B, T, vocab]``, or only the last
    position's ``[B, vocab]`` with ``last``, or the positions ``keep`` ``[K]``'s ``[B, K, vocab]`` (the LM head then
    runs on those alone)."""
    logits = model(input_ids=ids, position_ids=positions, attention_mask=mask, **cache_kwargs(cache),
                   logits_to_keep=keep if keep is not None else 1 if last else 0).logits
    return logits[:, -1] if last else logits


class DecodeStep:
    """One decode step: ``step(cache, token [B], position [B]) -> logits [B, vocab]``. The cache's layers write the
    new keys and values and evict inside the forward, reading nothing from the device (``bench`` counts it), padded
    rows of a server's batch included.

    Compiled (``compile_mode``), the step runs in fixed shapes (``EvictionCache.fixed_shape_step``: each layer attends
    over its budget's slots, or a ``full`` cache's allocation, free ones masked, and writes the token into a free
    slot or the one it evicts), so one compile per (batch, slots) shape serves every step, filling or evicting.
    ``"regional"``: the decoder layers run a block at a time through one ``torch.compile(fullgraph=True)`` of a
    block (``sparsegen.kv.regions``), the rest of the model eager; one block's compile serves every block.
    ``"whole"``: the whole step is one graph (model, cache update, eviction); once dynamo's guards have chosen a
    state's graph, the state's later steps call it without dynamo (``_state``). On CUDA, ``mode="reduce-overhead"``:
    the step is recorded once as a CUDA graph and replayed, one launch a token, with the cache's state marked static
    (it is updated in place). Rows of different lengths (a server's stacked batch, speculation's rows after they
    accepted different counts) take it too: each row writes into its own first free slot or evicts its own lowest.
    Eager where a cache cannot take a fixed step (heads sharing slots, a policy that reads the host, a ``full`` cache
    out of slots), and with ``compile=False``, for debugging."""

    def __init__(self, model: torch.nn.Module, compile: bool | str | None = None, notice: bool = True):
        self.mode = compile_mode(model, compile)
        self.model, self.compiled, self.notice = model, self.mode is not None, notice
        self.graphs = self.mode == "whole" and next(model.parameters()).device.type == "cuda"
        self.compiled_steps = 0  # steps that ran the compiled step
        self.unguarded_steps = 0  # of them, those that evaluated no guard (their state's graph was known)
        # cache: {state: the function of the graph that state takes}
        self._graphs: weakref.WeakKeyDictionary[object, dict[tuple, graph_calls.GraphCall]] = \
            weakref.WeakKeyDictionary()
        # the first compiled step's wall time: the compile (CUDA: + capture), unless this process has compiled the
        # step for these shapes already (every DecodeStep shares the compiled step's graphs)
        self.compile_seconds: float | None = None
        self._run = self.eager
        self._region: int | None = None  # the compiled step's own graphs in dynamo's cache
        self.direct_calls = False  # whether a state's graph, once chosen by dynamo's guards, is called directly
        self._blocks: graph_calls.BlockCalls | None = None  # (regional, where it calls blocks directly)
        self.block_size = block_size(model) if self.mode == "regional" else None
        self._shapes: set[tuple] = set()  # (batch, slots) a regional step has run (the first of one compiles)
        if self.mode == "whole":
            compiled = _compiled_step(self.graphs)
            self._run = partial(compiled, model)
            self.direct_calls = graph_calls.available(compiled)
            self._region = getattr(compiled, "_isolate_recompiles_id", None)
        elif self.mode == "regional":
            compiled = _compiled_block()
            if graph_calls.available(compiled):
                self._blocks = graph_calls.BlockCalls(compiled, run_block)
            self.direct_calls = self._blocks is not None
            self._run = partial(self._regional, self._blocks or compiled)

    def eager(self, cache, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The step uncompiled (what the compiled step traces)."""
        return _step(self.model, cache, token, position)

    def _regional(self, run: Callable, cache, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The step with its decoder layers run a block at a time through ``run`` (``sparsegen.kv.regions``)."""
        try:
            with block_step(cache, self.model, self.block_size, run):
                return _step(self.model, cache, token, position)
        finally:
            if self._blocks is not None:
                self._blocks.end()  # (the cache is not held past its step, even one that failed)

    def __call__(self, cache, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self._fixed(cache, token, position, compiled=True)

    def uncompiled(self, cache, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The same step as ``__call__``, fixed-shape where that one is, run eagerly (``bench`` counts its host
        syncs: dynamo does not run under the counting dispatch mode)."""
        return self._fixed(cache, token, position, compiled=False)

    def _fixed(self, cache, token: torch.Tensor, position: torch.Tensor, compiled: bool) -> torch.Tensor:
        if not self.compiled or not cache.fits_fixed_step():
            return self.eager(cache, token, position)
        run = self._run if compiled else self.eager
        if self.graphs and compiled:
            for tensor in cache.step_state():
                torch._dynamo.mark_static_address(tensor)  # guarded: new buffers (a new batch) record a new graph
        token, position = _unit_stride(token), _unit_stride(position)
        # (a stance the caller set goes through dynamo)
        direct = compiled and self.direct_calls and graph_calls.no_stance()
        state = self._state(cache, token, position) if direct else None
        graphs = self._graphs.setdefault(cache, {}) if direct and self._blocks is None else None
        graph = graphs.get(state) if graphs is not None else None
        unguarded = graph is not None and graph_calls.still_cached(_step, self._region, graph)
        if self._blocks is not None:  # (its blocks' graphs, kept by state: ``BlockCalls``)
            self._blocks.begin(cache, state)
        started = time.perf_counter()
        with cache.fixed_shape_step():
            if graphs is not None and not unguarded:
                arguments = {"model": self.model, "cache": cache, "token": token, "position": position}
                graph = graph_calls.graph_passing_guards(_step, self._region, arguments)
            if graph is not None:
                logits = graph((self.model, cache, token, position), (token, position))
            elif compiled and self.mode == "regional":
                # watched (a notice while it waits) at a shape's first step; a state within a known shape that
                # compiles anew (rolling sinks passing their budget) is told and counted once it is done
                shape = token.shape[0], tuple(layer.fixed_slots for layer in cache.layers)
                unit = f"its blocks of {self.block_size} layers"
                if shape in self._shapes:
                    logits = run(cache, token, position)
                    if (seconds := time.perf_counter() - started) > COMPILE_NOTICE_AFTER:
                        _compiling(token.shape[0], cache, self.notice, unit).record(seconds)
                else:
                    with _compiling(token.shape[0], cache, self.notice, unit):
                        logits = run(cache, token, position)
                    self._shapes.add(shape)
                if self._blocks is not None:
                    unguarded = self._blocks.all_replayed
            elif compiled:
                with _compiling(token.shape[0], cache, self.notice):  # through dynamo: it compiles for this state
                    logits = run(cache, token, position)
            else:
                logits = run(cache, token, position)
        if compiled:
            self.compiled_steps += 1
            self.unguarded_steps += unguarded
            if graph is not None and not unguarded:
                if len(graphs) >= KNOWN_STATES:
                    graphs.clear()
                for known in graphs.values():
                    known.forget()  # (their recorded inputs: buffers this state may have replaced)
                graphs[state] = graph
            if self.compile_seconds is None:
                self.compile_seconds = time.perf_counter() - started
        return logits.clone() if self.graphs and compiled else logits  # (a CUDA graph's output is its next replay's)

    def _state(self, cache, token: torch.Tensor, position: torch.Tensor) -> tuple:
        """All a compiled step's graph may depend on. Dynamo's guards check it every step (a cost that grows with
        the step's input tensors, and stays even when told to skip all but the tensors' checks), so the graph a
        state's guards once chose is called directly when the same state comes again (``graph_calls``). Kept per
        cache (a state names its objects by identity, which a new cache may reuse): the model by identity (a model
        changed in place between steps, not supported, is not seen), the cache's ``step_fingerprint``, the inputs'
        layouts and the autograd modes."""
        inputs = tuple((x.shape, x.dtype, x.device, x.requires_grad, x.is_inference()) for x in (token, position))
        modes = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        return id(self.model), inputs, modes, cache.step_fingerprint()

    def with_chunk(self, cache, token: torch.Tensor, position: torch.Tensor, prefilling, chunk: torch.Tensor,
                   start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step of ``cache``'s rows with ``chunk`` ``[n]`` of a prompt, fed into the one-row cache ``prefilling``
        from position ``start``, in the same forward (``PackedStep``; eager): the rows' logits ``[B, vocab]`` and
        the chunk's last position's ``[vocab]``."""
        from sparsegen.kv.packed import PackedStep

        rows = token.shape[0]
        ids = torch.cat((token, chunk))[None]
        positions = torch.cat((position, torch.arange(start, start + len(chunk), device=chunk.device)))[None]
        keep = torch.arange(rows + 1, device=chunk.device)
        keep[-1] = rows + len(chunk) - 1  # every row's token and the chunk's last
        logits = forward(self.model, PackedStep(cache, prefilling), ids, positions, keep=keep)[0]
        return logits[:rows], logits[rows]

    def graph_breaks(self, cache, token: torch.Tensor, position: torch.Tensor) -> int:
        """Run one step (the fixed-shape one, where ``__call__`` would) under dynamo's capture with a backend that only
        counts graphs, and count the graph breaks it meets: 0 means the step compiles as one graph. (Not
        ``torch._dynamo.explain``: it resets dynamo, so every compiled step would be traced again after it.) A
        regional step's blocks are captured each on its own: 0 means every block compiles as one graph."""
        graphs = []

        def count(graph: torch.fx.GraphModule, example_inputs) -> Callable:
            graphs.append(graph)
            return graph.forward

        if self.mode == "regional" and cache.fits_fixed_step():
            probe_block, breaks = torch.compile(_probe_block, backend=count), []

            def run(layers: tuple, hidden: torch.Tensor, calls: tuple) -> torch.Tensor:
                torch._dynamo.reset_code(_probe_block.__code__)  # (each block traced anew: its own breaks)
                before = len(graphs)
                hidden = probe_block(layers, hidden, calls)
                breaks.append(len(graphs) - before - 1)
                return hidden

            try:
                with cache.fixed_shape_step():
                    self._regional(run, cache, _unit_stride(token), _unit_stride(position))
            finally:
                torch._dynamo.reset_code(_probe_block.__code__)
            return sum(breaks)
        probe = torch.compile(_probe, backend=count)
        try:
            if self.compiled and cache.fits_fixed_step():
                with cache.fixed_shape_step():
                    probe(self.model, cache, _unit_stride(token), _unit_stride(position))
            else:
                probe(self.model, cache, token, position)
        finally:
            torch._dynamo.reset_code(_probe.__code__)
        return len(graphs) - 1


class _compiling:
    """Around a step that goes through dynamo: past ``COMPILE_NOTICE_AFTER`` seconds (a compile, not a lookup) say
    on stderr what is compiling and, at the end, how long it took; counted in ``COMPILES``."""

    def __init__(self, batch: int, cache, notice: bool, unit: str = "one graph"):
        slots = [layer.fixed_slots or 0 for layer in getattr(cache, "layers", ())]
        policy = getattr(getattr(cache, "policy", None), "name", "")
        self.what = f"{policy + ', ' if policy else ''}batch {batch}, {max(slots, default=0):,} slots; {unit}"
        self.notice, self.done = notice, threading.Event()

    def __enter__(self):
        self.started = time.perf_counter()
        if self.notice:
            threading.Thread(target=self._show, daemon=True).start()
        return self

    def _show(self) -> None:
        if not self.done.wait(COMPILE_NOTICE_AFTER):
            print(f"sparsegen: compiling the decode step ({self.what}; once per shape, kept in "
                  f"{os.environ.get(COMPILE_ENV)}; --no-compile skips it) ...", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.record(time.perf_counter() - self.started)

    def record(self, seconds: float) -> None:
        """A step through dynamo that took ``seconds``: past ``COMPILE_NOTICE_AFTER``, a compile, told and counted."""
        if seconds > COMPILE_NOTICE_AFTER:
            COMPILES.add(seconds)
            if self.notice:
                print(f"sparsegen: decode step compiled in {seconds:.1f} s ({self.what})", file=sys.stderr,
                      flush=True)


def _step(model: torch.nn.Module, cache, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    return forward(model, cache, token[:, None], position[:, None], last=True)


def _probe(model: torch.nn.Module, cache, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``_step`` under another name: what ``DecodeStep.graph_breaks`` captures, leaving ``_step``'s graphs alone."""
    return _step(model, cache, token, position)


def _probe_block(layers: tuple, hidden: torch.Tensor, calls: tuple) -> torch.Tensor:
    """``run_block`` under another name, for ``DecodeStep.graph_breaks``."""
    return run_block(layers, hidden, calls)


@functools.cache
def _compiled_step(graphs: bool):
    """``_step`` through ``torch.compile``, one for every ``DecodeStep``: its graphs (guarded by model and cache
    shapes) serve every step and every cache alike (a compile per ``DecodeStep`` would trace the model again).
    Inductor's reordering for locality moved a layer's one cache write (the evicted slot's new
    K/V) above the attention that reads the cache, so the write could not be done in place: each step copied every
    layer's K and V (measured: 4 copies of the cache a step); without it the write is in place.
    The wrapper's ~460 size and stride assertions (of inputs dynamo's guards have checked, and of kernels' outputs)
    re-check what is already known each step: off (CUDA keeps the alignment checks: Triton's kernels assume aligned
    inputs). (``triton.cudagraphs`` is what mode="reduce-overhead" sets; a mode and options cannot both be given.) On
    a CPU the graph's wrapper is C++ (``cpp_wrapper``): the ~700 kernel and op calls of a SmolLM2 step no longer go
    through Python (measured in docs/benchmarks-log.md); CUDA replays a graph instead. That wrapper is built apart
    from the kernels, at -O1 (``cpp_wrapper_build_separate``): gcc optimizing its calls was half a cold compile
    (SmolLM2's whole step: 39 s of 80 in gcc, 16 s so; the step as fast, docs/benchmarks.md)."""
    return _compiled(_step, graphs)


@functools.cache
def _compiled_block():
    """``run_block`` through ``torch.compile``, for every regional step: its graphs (guarded by the layers' kinds
    and the cache's shapes, never by a layer's index) serve every block alike."""
    return _compiled(run_block, False)


def _compiled(function: Callable, graphs: bool):
    """``function`` through ``torch.compile`` with the step's options (``_compiled_step``)."""
    options = {"reorder_for_locality": False, "triton.cudagraphs": graphs, "size_asserts": False,
               "alignment_asserts": graphs, "cpp_wrapper": not graphs}
    import torch._inductor.config as inductor

    native.remember_vector_isas()  # (inductor's probe of the CPU, once a machine rather than once a process)
    if not graphs and hasattr(inductor, "cpp_wrapper_build_separate"):  # (torch 2.13's)
        options["cpp_wrapper_build_separate"] = True
    accepted = inspect.signature(torch.compile).parameters
    # (isolated: its own list of graphs, which graph_calls reads)
    limit = {name: value for name, value in (("recompile_limit", COMPILED_SHAPES), ("isolate_recompiles", True))
             if name in accepted}
    if "recompile_limit" not in accepted:
        # torch before 2.13 has no per-function limit: raise dynamo's global one (cache_size_limit before 2.7)
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), COMPILED_SHAPES))
    return torch.compile(function, fullgraph=True, options=options, **limit)


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B]`` with stride 1: dynamo guards on strides, even of one row, and a column of a prompt's ids has the
    prompt's length as its stride (each new length compiled the step anew)."""
    return x if x.stride() == (1,) else x.clone(memory_format=torch.contiguous_format)
