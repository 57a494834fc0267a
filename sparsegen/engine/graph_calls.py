"""A compiled step's graph called without dynamo, once dynamo's own guards have chosen it for a cache's state: what
``DecodeStep`` runs a steady decode through. It reads dynamo's private cache entries and re-runs dynamo's generated
bytecode, so it is kept here, alone, behind ``available()``: where this PyTorch lacks what it reads, every step goes
through ``torch.compile``'s public path (the same graphs, dynamo's guards each step). The A/B that keeps it is in
docs/benchmarks.md ("The compiled step's direct calls")."""

from __future__ import annotations

import dis
import sys
import types
import weakref
from collections.abc import Callable, Sequence

import torch

_DEFAULT_STANCE = torch._dynamo.eval_frame.DynamoStance()


def available(compiled: Callable) -> bool:
    """Whether the graphs of the step ``torch.compile`` returned can be called directly: this PyTorch lists a
    compiled function's own graphs (``isolate_recompiles``) and checks guards from Python."""
    return (getattr(compiled, "_isolate_recompiles_id", None) is not None
            and hasattr(torch._C._dynamo.eval_frame, "_get_cache_entries_for_region"))


def no_stance() -> bool:
    """No caller has set a stance (``torch.compiler.set_stance``): that must go through dynamo."""
    return torch._dynamo.eval_frame._stance == _DEFAULT_STANCE


def _graphs_of(step: Callable, region: int) -> list:
    """Dynamo's cached graphs of ``step`` compiled by the ``torch.compile`` call that owns ``region``
    (``isolate_recompiles``), in the order dynamo tries them."""
    return torch._C._dynamo.eval_frame._get_cache_entries_for_region(step.__code__, region)


def graph_passing_guards(step: Callable, region: int, arguments: dict, confirm: bool = False) -> GraphCall | None:
    """The graph dynamo would run ``step`` through on these arguments, as a function that runs it without dynamo:
    the code of the first of the compiled step's graphs whose guards pass (dynamo's guard managers; its own choice),
    or None (none passes: dynamo compiles one). What dynamo adds to a steady step is mostly its guards, even under
    ``skip_guard_eval_unsafe``, which still checks every input tensor that is not a parameter (the cache's slots, the
    packed weights). ``confirm``: the ``GraphCall``'s."""
    for entry in _graphs_of(step, region):
        if entry.guard_manager.check(arguments):
            if entry.code is None:  # (an entry with no code of its own, as dynamo leaves some: it runs it itself)
                return None
            return GraphCall(types.FunctionType(entry.code, step.__globals__, step.__name__), confirm)
    return None


def still_cached(step: Callable, region: int, graph: GraphCall) -> bool:
    """Whether dynamo still holds ``graph``'s code (``torch._dynamo.reset`` drops every graph)."""
    return any(entry.code is graph.code for entry in _graphs_of(step, region))


class GraphCall:
    """A state's compiled graph, called on its own inputs. Dynamo's code for a graph gathers its inputs by attribute
    before the call (SmolLM2: 308 tensors in 4,397 bytecodes) and, after it, sets back what the step assigned in
    Python (each layer's ``pending``, ``used``, ``incoming``, the cache's ``step``), interpreted every step. The
    first call runs that code and records the inputs, where the call's ``fresh`` tensors went (those made anew for
    each call: the step's token and position; a block's hidden states, the layers' arguments and the step's own
    tensors), the output returned and the assignments; later calls of the same state (the same buffers and settings,
    ``DecodeStep._state``) pass the recorded inputs with this call's fresh tensors, and make the same assignments.
    ``confirm``: the second call records again and replay starts only if it recorded the same inputs, every one not
    fresh the same object (so a tensor made anew each call outside ``fresh`` is never replayed stale). Code that
    does anything else (a store or a call beside dynamo's own helpers for assignments and for an input's sizes and
    strides, an assigned value other than a number, string or None) keeps running as it is."""

    _STORES = frozenset({"STORE_ATTR", "STORE_SUBSCR", "STORE_GLOBAL", "DELETE_ATTR", "DELETE_SUBSCR"})

    def __init__(self, function: Callable, confirm: bool = False):
        self.function, self.code, self.confirm = function, function.__code__, confirm
        # (graph, inputs, (input's index, fresh tensor's index) pairs, output's index, assignments)
        self.recorded: tuple | None = None
        self.first: tuple | None = None  # (``confirm``) the first recording, until the second matches it
        self.replayable = True

    def __call__(self, args: tuple, fresh: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.recorded is not None:
            graph, inputs, fresh_at, output_at, assignments = self.recorded
            inputs = list(inputs)
            for at, which in fresh_at:
                inputs[at] = fresh[which]
            outputs = graph(*inputs)
            for owner, values in assignments:
                _assign(owner(), values)
            return outputs[output_at]
        if not self.replayable:
            return self.function(*args)
        return self._record(args, fresh)

    def forget(self) -> None:
        """Let go of the recorded inputs (another state's buffers took their place)."""
        self.recorded = self.first = None

    def _record(self, args: tuple, fresh: Sequence[torch.Tensor]) -> torch.Tensor:
        if sys.getprofile() is not None:  # (a profiler runs: recording would take its hook; run the code as it is)
            return self.function(*args)
        graphs = [name for name in self.code.co_names if name.startswith("__compiled_fn")]
        if len(graphs) != 1 or any(i.opname in self._STORES for i in dis.get_instructions(self.code)):
            self.replayable = False
            return self.function(*args)
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
            result = types.FunctionType(self.code, namespace, self.function.__name__)(*args)
        finally:
            sys.setprofile(None)
        if unknown or len(calls) != 1 or any(type(value) not in _CONSTANTS for _, _, value in assignments):
            self.replayable = False
            return result
        inputs, outputs = calls[0]
        which = {id(x): i for i, x in enumerate(fresh)}
        fresh_at = tuple((at, which[id(x)]) for at, x in enumerate(inputs) if id(x) in which)
        output_at = [i for i, x in enumerate(outputs) if x is result]
        if len(output_at) != 1:
            self.replayable = False
            return result
        owners: dict[int, tuple[object, dict]] = {}  # (each owner's assignments, the last of a name kept)
        for owner, name, value in assignments:
            owners.setdefault(id(owner), (owner, {}))[1][name] = value
        recording = (graph, tuple(inputs), fresh_at, output_at[0], list(owners.values()))
        if self.confirm and self.first is None:
            self.first = recording
            return result
        if self.confirm and not _same_recording(self.first, recording):
            self.replayable, self.first = False, None
            return result
        graph, inputs, fresh_at, output_at, owners = recording
        self.recorded = (graph, inputs, fresh_at, output_at, [(_weak(owner), values) for owner, values in owners])
        self.first = None
        return result


def _same_recording(first: tuple, second: tuple) -> bool:
    """Whether two calls' recordings are alike: the same graph and output, the fresh tensors in the same places,
    every other input the same tensor or number (a graph compiled for dynamic sizes takes them as numbers, read from
    its inputs' shapes: fixed for a state), the same owners given the same values."""
    (graph, inputs, fresh_at, output_at, owners), (graph2, inputs2, fresh_at2, output_at2, owners2) = first, second
    fresh = {at for at, _ in fresh_at}
    return (graph is graph2 and fresh_at == fresh_at2 and output_at == output_at2 and len(inputs) == len(inputs2)
            and all(x is y or (type(x) is int and x == y) for at, (x, y) in enumerate(zip(inputs, inputs2))
                    if at not in fresh)
            and len(owners) == len(owners2)
            and all(a is b and values == values2 for (a, values), (b, values2) in zip(owners, owners2)))


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


class BlockCalls:
    """A regional step's blocks (``sparsegen.kv.regions``) called without dynamo once its guards have chosen each
    block's graph for a cache's state: what dynamo adds to a block call is its guards over the block's ~90 inputs
    (~170 µs a call, six calls a SmolLM2 step). The step calls ``begin`` with its cache's state before its blocks
    and ``end`` after them. A block's fresh tensors are its hidden states, the tensors in its layers' arguments
    (rotary tables, masks, positions) and the cache's ``step``'s; its recordings are confirmed (``GraphCall``'s
    ``confirm``)."""

    def __init__(self, compiled: Callable, function: Callable):
        self.compiled, self.function = compiled, function
        self.region = compiled._isolate_recompiles_id
        self.calls = self.replayed = 0  # the current step's block calls, and those that ran a recorded graph
        self._cache = None  # the current step's cache (None: every block through dynamo)
        self._current: dict[int, GraphCall] = {}  # its state's graphs, by the block's first layer
        # cache: (its last state, that state's graphs): one state's (a new state's forget the last's buffers)
        self._graphs: weakref.WeakKeyDictionary[object, tuple[tuple, dict[int, GraphCall]]] = \
            weakref.WeakKeyDictionary()

    def begin(self, cache, state: tuple | None) -> None:
        """Before a step's blocks: ``cache``'s state (``DecodeStep._state``; compared once a step, not hashed once a
        block: it has a thousand entries), or None (every block through dynamo)."""
        self.calls = self.replayed = 0
        self._cache = cache if state is not None else None
        if state is not None:
            known = self._graphs.get(cache)
            if known is None or known[0] != state:
                known = self._graphs[cache] = state, {}
            self._current = known[1]

    def end(self) -> None:
        """After a step's blocks (``all_replayed`` stays readable)."""
        self._cache, self._current = None, {}

    @property
    def all_replayed(self) -> bool:
        """Whether every block of the last step ran its recorded graph (the step evaluated no guard)."""
        return 0 < self.replayed == self.calls

    def __call__(self, layers: tuple, hidden: torch.Tensor, calls: tuple) -> torch.Tensor:
        self.calls += 1
        cache = self._cache
        if cache is None:
            return self.compiled(layers, hidden, calls)
        graph = self._current.get(id(layers[0]))
        if graph is None or not still_cached(self.function, self.region, graph):
            arguments = {"layers": layers, "hidden": hidden, "calls": calls}
            graph = graph_passing_guards(self.function, self.region, arguments, confirm=True)
            if graph is None:
                return self.compiled(layers, hidden, calls)  # (none passes: dynamo compiles one)
            self._current[id(layers[0])] = graph
        self.replayed += graph.recorded is not None
        return graph((layers, hidden, calls), _tensors((hidden, calls, vars(cache.step)), []))


def _tensors(value, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor in ``value``'s tuples, lists and dictionaries, in order, appended to ``found``."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    return found
