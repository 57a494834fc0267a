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
from collections.abc import Callable

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


def graph_passing_guards(step: Callable, region: int, arguments: dict) -> GraphCall | None:
    """The graph dynamo would run ``step`` through on these arguments, as a function that runs it without dynamo:
    the code of the first of the compiled step's graphs whose guards pass (dynamo's guard managers; its own choice),
    or None (none passes: dynamo compiles one). What dynamo adds to a steady step is mostly its guards, even under
    ``skip_guard_eval_unsafe``, which still checks every input tensor that is not a parameter (the cache's slots, the
    packed weights)."""
    for entry in _graphs_of(step, region):
        if entry.guard_manager.check(arguments):
            if entry.code is None:  # (an entry with no code of its own, as dynamo leaves some: it runs it itself)
                return None
            return GraphCall(types.FunctionType(entry.code, step.__globals__, step.__name__))
    return None


def still_cached(step: Callable, region: int, graph: GraphCall) -> bool:
    """Whether dynamo still holds ``graph``'s code (``torch._dynamo.reset`` drops every graph)."""
    return any(entry.code is graph.code for entry in _graphs_of(step, region))


class GraphCall:
    """A state's compiled graph, called on its own inputs. Dynamo's code for a graph gathers its inputs by attribute
    before the call (SmolLM2: 308 tensors in 4,397 bytecodes) and, after it, sets back what the step assigned in
    Python (each layer's ``pending``, ``used``, ``incoming``, the cache's ``step``), interpreted every step. The
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
