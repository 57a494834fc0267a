"""The one way sparsegen runs a model over a cache, top to bottom: ``forward`` (the only call into a model with a
cache: prefill chunks, drafting, verification), ``DecodeStep`` (one new token per row: model, cache update and
eviction inside the cache's layers, optionally compiled whole), ``next_token`` (sampling) and ``prefill`` (a prompt
in chunks). ``generate``, ``chat``/``serve``, ``ppl --stream``, ``fidelity``, ``passkey``, speculative decoding
and ``bench`` all decode through these, so what ``bench`` times is what users run."""

from __future__ import annotations

import dis
import functools
import inspect
import math
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from functools import partial

import torch
from tqdm.auto import tqdm

from sparsegen.models.compat import cache_kwargs
from sparsegen.paths import COMPILE_ENV

# graphs the one compiled step may hold (one per model, policy kind and (batch, slots) shape; past it dynamo fails
# loudly, fullgraph); dynamo's default, 8, is less than one bench run of a few policies over a few contexts needs
COMPILED_SHAPES = 128
KNOWN_STATES = 8  # states of one cache whose graphs a DecodeStep keeps to call directly (past it: forgets them)
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM does): logits / T overflow long before T = 0
COMPILE_NOTICE_AFTER = 2.0  # seconds a step through dynamo runs before the wait is shown (a compile, not a lookup)


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
    ``sparsegen.load`` gives a GGUF model by default; a compiled step decodes them 2-3x faster than eager), or a
    CUDA device (CUDA graphs); eager where neither (a checkpoint folder in fp32 on a CPU, as it always ran)."""
    from sparsegen.quant.fast import PACKED_LINEARS

    if next(model.parameters()).device.type == "cuda":
        return True
    return any(isinstance(module, PACKED_LINEARS) for module in model.modules())




def check_sampling(temperature: float, top_p: float, seed: int = 0) -> None:
    """Refuse sampling settings that cannot be honoured, before any work (NaN compares false with every bound)."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution a token is sampled from (fp32, over the last dimension): softmax at ``temperature``, cut
    to the smallest set of tokens whose mass reaches ``top_p``. Unnormalised after the cut (multinomial does not
    care; speculative sampling compares ratios, so normalise before comparing distributions of two caches)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
    return probs


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None):
    if temperature < GREEDY_BELOW:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=generator).squeeze(-1)


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

    ``compile=True``: ``torch.compile(fullgraph=True)`` of the whole step (one graph: model, cache update,
    eviction), run in fixed shapes (``EvictionCache.fixed_shape_step``: each layer attends over its budget's slots,
    or a ``full`` cache's allocation, free ones masked, and writes the token into a free slot or the one it evicts),
    so one compile per (batch, slots) shape serves every step, filling or evicting; once dynamo's guards have chosen
    a state's graph, the state's later steps call it without dynamo (``_state``). On CUDA,
    ``mode="reduce-overhead"``: the step is recorded once as a CUDA graph and replayed, one launch a token, with the
    cache's state marked static (it is updated in place). Rows of different lengths (a server's stacked batch,
    speculation's rows after they accepted different counts) take it too: each row writes into its own first free
    slot or evicts its own lowest. Eager where a cache cannot take a fixed step (heads sharing slots, a policy that
    reads the host, a ``full`` cache out of slots), and with ``compile=False``, for debugging."""

    def __init__(self, model: torch.nn.Module, compile: bool | None = None, notice: bool = True):
        compile = compiles_by_default(model) if compile is None else compile
        self.model, self.compiled, self.notice = model, compile, notice
        self.graphs = compile and next(model.parameters()).device.type == "cuda"
        self.compiled_steps = 0  # steps that ran the compiled step
        self.unguarded_steps = 0  # of them, those that evaluated no guard (their state's graph was known)
        # cache: {state: the function of the graph that state takes}
        self._graphs: weakref.WeakKeyDictionary[object, dict[tuple, _GraphCall]] = weakref.WeakKeyDictionary()
        # the first compiled step's wall time: the compile (CUDA: + capture), unless this process has compiled the
        # step for these shapes already (every DecodeStep shares the compiled step's graphs)
        self.compile_seconds: float | None = None
        self._run = self.eager
        self._region: int | None = None  # the compiled step's own graphs in dynamo's cache (None: not listed)
        if compile:
            compiled = _compiled_step(self.graphs)
            self._run = partial(compiled, model)
            self._region = getattr(compiled, "_isolate_recompiles_id", None)

    def eager(self, cache, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The step uncompiled (what the compiled step traces)."""
        return _step(self.model, cache, token, position)

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
        direct = compiled and self._region is not None and torch._dynamo.eval_frame._stance == _DEFAULT_STANCE
        graphs = self._graphs.setdefault(cache, {}) if direct else {}
        state = self._state(cache, token, position) if direct else None
        graph = graphs.get(state)
        unguarded = graph is not None and _still_cached(self._region, graph)
        started = time.perf_counter()
        with cache.fixed_shape_step():
            if direct and not unguarded:
                graph = _graph_passing_guards(self._region, self.model, cache, token, position)
            if graph is not None:
                logits = graph(self.model, cache, token, position)
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
        """All a compiled step's graph may depend on. Dynamo's guards check it every step (2 ms of a 15 ms step of
        SmolLM2 on this CPU; 0.8 ms even when told to skip all but the tensors' checks), so the graph a state's
        guards once chose is called directly when the same state comes again (``_graph_passing_guards``). Kept per
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
        ``torch._dynamo.explain``: it resets dynamo, so every compiled step would be traced again after it.)"""
        graphs = []

        def count(graph: torch.fx.GraphModule, example_inputs) -> Callable:
            graphs.append(graph)
            return graph.forward

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

    def __init__(self, batch: int, cache, notice: bool):
        slots = [layer.fixed_slots or 0 for layer in getattr(cache, "layers", ())]
        policy = getattr(getattr(cache, "policy", None), "name", "")
        self.what = f"{policy + ', ' if policy else ''}batch {batch}, {max(slots, default=0):,} slots"
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
        seconds = time.perf_counter() - self.started
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


@functools.cache
def _compiled_step(graphs: bool):
    """``_step`` through ``torch.compile``, one for every ``DecodeStep``: its graphs (guarded by model and cache
    shapes) serve every step and every cache alike (a compile per ``DecodeStep`` traced the model again: a minute for
    SmolLM2 on this CPU). Inductor's reordering for locality moved a layer's one cache write (the evicted slot's new
    K/V) above the attention that reads the cache, so the write could not be done in place: each step copied every
    layer's K and V (measured: 4 copies of the cache a step); without it the write is in place.
    The wrapper's ~460 size and stride assertions (of inputs dynamo's guards have checked, and of kernels' outputs)
    cost 1.4 ms of a 13.4 ms SmolLM2 step on this CPU (full at 512, one process): off (CUDA keeps the alignment
    checks: Triton's kernels assume aligned inputs). (``triton.cudagraphs`` is what mode="reduce-overhead"
    sets; a mode and options cannot both be given.) On a CPU the graph's wrapper is C++ (``cpp_wrapper``): the ~700
    kernel and op calls of a SmolLM2 step no longer go through Python, 6.5-7.4% of a w4a8 step (one process, both
    wrappers, interleaved; docs/benchmarks.md); CUDA replays a graph instead."""
    options = {"reorder_for_locality": False, "triton.cudagraphs": graphs, "size_asserts": False,
               "alignment_asserts": graphs, "cpp_wrapper": not graphs}
    accepted = inspect.signature(torch.compile).parameters
    # (isolated: its own list of graphs, which _graph_passing_guards reads)
    limit = {name: value for name, value in (("recompile_limit", COMPILED_SHAPES), ("isolate_recompiles", True))
             if name in accepted}
    if "recompile_limit" not in accepted:
        # torch before 2.13 has no per-function limit: raise dynamo's global one (cache_size_limit before 2.7)
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), COMPILED_SHAPES))
    return torch.compile(_step, fullgraph=True, options=options, **limit)


_DEFAULT_STANCE = torch._dynamo.eval_frame.DynamoStance()


def _graphs_of(region: int) -> list:
    """Dynamo's cached graphs of ``_step`` compiled by the ``torch.compile`` call that owns ``region``
    (``isolate_recompiles``), in the order dynamo tries them."""
    return torch._C._dynamo.eval_frame._get_cache_entries_for_region(_step.__code__, region)


def _graph_passing_guards(region: int, model: torch.nn.Module, cache, token: torch.Tensor,
                          position: torch.Tensor) -> Callable | None:
    """The graph dynamo would run ``_step`` through on these arguments, as a function that runs it without dynamo:
    the code of the first of the compiled step's graphs whose guards pass (dynamo's guard managers; its own choice),
    or None (none passes: dynamo compiles one). What dynamo adds to a steady step on this CPU is mostly its guards:
    0.8 ms of a 5.2 ms SmolLM2 step even under ``skip_guard_eval_unsafe``, which still checks every input tensor that
    is not a parameter (the cache's slots, the packed weights)."""
    arguments = {"model": model, "cache": cache, "token": token, "position": position}
    for entry in _graphs_of(region):
        if entry.guard_manager.check(arguments):
            return _GraphCall(types.FunctionType(entry.code, _step.__globals__, _step.__name__))
    return None


def _still_cached(region: int, graph: _GraphCall) -> bool:
    """Whether dynamo still holds ``graph``'s code (``torch._dynamo.reset`` drops every graph)."""
    return any(entry.code is graph.code for entry in _graphs_of(region))


class _GraphCall:
    """A state's compiled graph, called on its own inputs. Dynamo's code for a graph gathers its inputs by attribute
    before the call (SmolLM2: 308 tensors in 4,397 bytecodes) and, after it, sets back what the step assigned in
    Python (each layer's ``pending``, ``used``, ``incoming``, the cache's ``step``): 0.39 ms of a 5 ms step. The
    first call runs that code and records the inputs, where the token and position went, the output returned and
    the assignments; later calls of the same state (the same buffers and settings, ``DecodeStep._state``) pass the
    recorded inputs with this step's token and position, and make the same assignments. Code that does anything
    else (a store or a call beside dynamo's own helpers for assignments and for an input's sizes and strides, an
    assigned value other than a number, string or None) keeps running as it is."""

    _STORES = frozenset({"STORE_ATTR", "STORE_SUBSCR", "STORE_GLOBAL", "DELETE_ATTR", "DELETE_SUBSCR"})

    def __init__(self, function: Callable):
        self.function, self.code = function, function.__code__
        self.recorded: tuple | None = None  # (graph, inputs, token's and position's index, output's, assignments)
        self.replayable = True

    def __call__(self, model: torch.nn.Module, cache, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        if self.recorded is not None:
            graph, inputs, token_at, position_at, output_at, assignments = self.recorded
            inputs = list(inputs)
            inputs[token_at], inputs[position_at] = token, position
            outputs = graph(*inputs)
            for owner, values in assignments:
                _assign(owner(), values)
            return outputs[output_at]
        if not self.replayable:
            return self.function(model, cache, token, position)
        return self._record(model, cache, token, position)

    def forget(self) -> None:
        """Let go of the recorded inputs (another state's buffers took their place)."""
        self.recorded = None

    def _record(self, model: torch.nn.Module, cache, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        if sys.getprofile() is not None:  # (a profiler runs: recording would take its hook; run the code as it is)
            return self.function(model, cache, token, position)
        graphs = [name for name in self.code.co_names if name.startswith("__compiled_fn")]
        if len(graphs) != 1 or any(i.opname in self._STORES for i in dis.get_instructions(self.code)):
            self.replayable = False
            return self.function(model, cache, token, position)
        graph = self.function.__globals__[graphs[0]]
        calls, assignments, unknown = [], [], []

        def recorded_graph(*inputs):
            outputs = graph(*inputs)
            calls.append((inputs, outputs))
            return outputs

        utils = torch._dynamo.utils

        class Helpers:  # (dynamo's utils module as the code sees it, its assignments recorded)
            record_pregraph_bytecode_enter = staticmethod(utils.record_pregraph_bytecode_enter)
            record_pregraph_bytecode_exit = staticmethod(utils.record_pregraph_bytecode_exit)
            # (a graph compiled for dynamic sizes, as a second batch size makes it, reads them from its inputs: fixed
            # for a state, whose inputs' layouts are; recorded with the inputs)
            call_size = staticmethod(utils.call_size)
            call_stride = staticmethod(utils.call_stride)
            call_storage_offset = staticmethod(utils.call_storage_offset)

            def __getattr__(self, name: str):  # (any other helper: the code does more than replay can)
                return getattr(utils, name)

            @staticmethod
            def object_setattr_ignore_descriptor(owner, name, value):
                assignments.append((owner, name, value))
                utils.object_setattr_ignore_descriptor(owner, name, value)

        allowed = {recorded_graph.__code__, *(getattr(helper.__func__, "__code__", None)
                                              for helper in vars(Helpers).values() if isinstance(helper, staticmethod))}

        def watch(frame, event, argument):  # (every call the code itself makes)
            if event == "call" and frame.f_back is not None and frame.f_back.f_code is self.code \
                    and frame.f_code not in allowed:
                unknown.append(frame.f_code.co_name)
            elif event == "c_call" and frame.f_code is self.code:
                unknown.append(getattr(argument, "__name__", "?"))

        namespace = {**self.function.__globals__, graphs[0]: recorded_graph,
                     "__import_torch_dot__dynamo_dot_utils": Helpers()}
        sys.setprofile(watch)
        try:
            result = types.FunctionType(self.code, namespace, self.function.__name__)(model, cache, token, position)
        finally:
            sys.setprofile(None)
        if unknown or len(calls) != 1 or any(type(value) not in _CONSTANTS for _, _, value in assignments):
            self.replayable = False
            return result
        inputs, outputs = calls[0]
        token_at = [i for i, x in enumerate(inputs) if x is token]
        position_at = [i for i, x in enumerate(inputs) if x is position]
        output_at = [i for i, x in enumerate(outputs) if x is result]
        if len(token_at) != 1 or len(position_at) != 1 or len(output_at) != 1:
            self.replayable = False
            return result
        owners: dict[int, tuple[object, dict]] = {}  # (each owner's assignments, the last of a name kept)
        for owner, name, value in assignments:
            owners.setdefault(id(owner), (owner, {}))[1][name] = value
        self.recorded = (graph, tuple(inputs), token_at[0], position_at[0], output_at[0],
                         [(_weak(owner), values) for owner, values in owners.values()])
        return result


_CONSTANTS = (int, float, bool, str, type(None))  # values an assignment replays (a tensor or a container of them
# from the graph's outputs would be the recording step's)


def _assign(owner: object, values: dict) -> None:
    """Set ``values`` in ``owner``'s instance dictionary, as dynamo's ``object_setattr_ignore_descriptor`` does one
    at a time (one update an owner: 153 assignments a SmolLM2 step)."""
    try:
        object.__getattribute__(owner, "__dict__").update(values)
    except AttributeError:  # (a threading.local: its dictionary is the calling thread's)
        for name, value in values.items():
            torch._dynamo.utils.object_setattr_ignore_descriptor(owner, name, value)


def _weak(owner: object) -> Callable[[], object]:
    """``owner`` when called: by a weak reference where it takes one (a recorded assignment's cache or layer: a strong
    one would keep the cache, a weak key of ``DecodeStep._graphs``, alive)."""
    try:
        return weakref.ref(owner)
    except TypeError:
        return lambda: owner


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B]`` with stride 1: dynamo guards on strides, even of one row, and a column of a prompt's ids has the
    prompt's length as its stride (each new length compiled the step anew)."""
    return x if x.stride() == (1,) else x.clone(memory_format=torch.contiguous_format)


def prefill(model: torch.nn.Module, cache, ids: torch.Tensor, mask: torch.Tensor, chunk_size: int,
            progress: bool | None = None, first_chunk: int | None = None, start: int = 0,
            after_chunk: Callable[[], None] | None = None) -> torch.Tensor:
    """Feed left-padded ``ids`` into ``cache`` a chunk at a time (evicting between chunks); the last position's
    logits ``[B, vocab]``. ``first_chunk``: the first chunk's length instead (kvpress's protocol: a whole context in
    one pass, compressed once, then the question in chunks). ``start``: the first token's position (a cache that
    already holds a context). ``after_chunk``: called after each chunk (it may raise to stop a long prefill)."""
    length = ids.shape[1]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0) + start
    padded = not bool(mask.all())
    show = progress if progress is not None else length > 8 * chunk_size
    starts = [0] + list(range(first_chunk, length, chunk_size)) if first_chunk else range(0, length, chunk_size)
    ends = list(starts[1:]) + [length]
    for start, end in tqdm(list(zip(starts, ends)), desc="prefill", unit="chunk", disable=not show, leave=False):
        logits = forward(model, cache, ids[:, start:end], position_ids[:, start:end],
                         mask[:, :end] if padded else None, last=True)
        if after_chunk is not None:
            after_chunk()
    return logits
