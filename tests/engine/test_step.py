"""The decode step: which caches take a fixed-shape step, that it leaves the same logits, kept tokens and counts as
the eager step (the reference: slots held so far plus the new one, then eviction), filling and evicting, that it is
one graph compiled once for all of them, updates the cache's state in place and hands back its own logits (what CUDA
graphs need; replaying on a GPU: tests/test_cuda.py)."""

import re
import sys
import time
from functools import partial

import pytest
import torch

from sparsegen.engine import graph_calls
from sparsegen.engine.prefill import prefill
from sparsegen.engine.step import DecodeStep, _step
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.kv.quantized import KVQuantization
from sparsegen.quant.restore import quantize_weights
from tests.kv.families import VOCAB, named_policies, tiny_model

BUDGET, PROMPT, STEPS = 10, 6, 8  # the budget fills at the 4th step: steps before and after
FIXED = sorted(name for name, cls in named_policies().items() if not cls.shares_slots and not cls.reads_host)


def _prefilled(name: str, family: str = "llama", budget: int | None = BUDGET, prompt: int = PROMPT,
               shorter: int = 0, **cache_options):
    """Two rows of ``prompt`` tokens, the second left-padded by ``shorter`` (rows of different lengths)."""
    model = tiny_model(family)
    cache = EvictionCache(model, make_policy(name, budget), chunk_size=8, **cache_options)
    ids = torch.randint(3, VOCAB, (2, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :shorter] = 0
    with torch.inference_mode():
        token = prefill(model, cache, ids, mask, 8).argmax(-1)
        position = mask.sum(-1)  # (an inference tensor, as the steps' next positions are)
    return model, cache, token, position


def _sizes(name: str) -> tuple[int | None, dict]:
    """The budget, and the room an unbounded ``full`` cache is told of (its fixed step's slots: the sequence's
    length)."""
    return (None, {"expected_length": PROMPT + STEPS + 1}) if name == "full" else (BUDGET, {})


def _graph_states(cache) -> int:
    """The states a compiled step goes through over the test's steps: rolling sinks pass their budget (and take the
    sinks' frame from then on: ``EvictionLayer.may_evict``)."""
    return 2 if cache.layers[0].sinks else 1


def _fixed_as_compiled(model) -> DecodeStep:
    """A DecodeStep that takes the fixed-shape path as ``compile=True`` does, with the eager step as its "graph"."""
    step = DecodeStep(model)
    step.compiled, step._run = True, lambda *args: step.eager(*args)
    return step


def _through_dynamo(model) -> DecodeStep:
    """A DecodeStep whose fixed step goes through dynamo (guards, graphs, recompiles) with the eager backend."""
    step = _fixed_as_compiled(model)
    compiled = torch.compile(_step, fullgraph=True, backend="eager", isolate_recompiles=True)
    step._run, step._region = partial(compiled, model), compiled._isolate_recompiles_id
    step.direct_calls = graph_calls.available(compiled)
    return step


def _decode(step: DecodeStep, model, cache, token, position, steps: int = STEPS) -> torch.Tensor:
    logits = []
    with torch.inference_mode():
        for _ in range(steps):
            out = step(cache, token, position)
            logits.append(out)
            token, position = out.argmax(-1), position + 1
    return torch.stack(logits)


def _kept(layer) -> torch.Tensor:
    return torch.where(layer.valid[..., :layer.used], layer.index[..., :layer.used], -1).sort(-1).values


@pytest.mark.parametrize("name, family", [(name, "llama") for name in FIXED] + [("h2o", "gemma3"),
                                                                                ("streaming", "gemma3"),
                                                                                ("streaming", "gpt_neox")])
def test_a_fixed_step_gives_the_eager_steps_logits_kept_tokens_and_counts(name, family):
    budget, room = _sizes(name)
    _assert_fixed_steps_match_eager(name, family, budget, **room)


@pytest.mark.parametrize("shorter", [0, 3])
@pytest.mark.parametrize("name, family", [(name, "llama") for name in FIXED] + [("h2o", "gemma3")])
def test_a_fixed_step_over_quantized_kv_gives_the_eager_steps_logits(name, family, shorter):
    """4-bit K/V with a residual of 3 full-precision tokens (so the ring wraps within the test's steps), rows of one
    length and of two."""
    budget, room = _sizes(name)
    _assert_fixed_steps_match_eager(name, family, budget, shorter, kv_bits=KVQuantization(4, residual=3), **room)


@pytest.mark.parametrize("name", [name for name in FIXED if name != "full"])
def test_a_sequence_announced_shorter_than_the_budget_attends_over_its_length(name):
    """A 1,024-token budget on a 576-token generation: the step reads the 64 slots allocated, not 100 (so a bounded
    cache is never slower than ``full`` at a short context), and still gives the eager step's logits."""
    fixed = _assert_fixed_steps_match_eager(name, "llama", 100, expected_length=PROMPT + STEPS + 1)
    assert [layer.fixed_slots for layer in fixed.layers] == [min(63, layer.slot_budget) for layer in fixed.layers]
    assert fixed.layers[0].fixed_slots == 63  # (pyramid: later layers' budgets are smaller)


@pytest.mark.parametrize("name, family", [(name, "llama") for name in FIXED] + [("h2o", "gemma3"),
                                                                                ("streaming", "gpt_neox")])
def test_rows_of_different_lengths_take_the_fixed_step(name, family):
    """A left-padded batch (a server's stacked rows; speculation's rows after they accepted different counts): each
    row writes into its own first free slot, or evicts its own lowest, as the eager step over the padded rows does.
    An unbounded cache keeps the padding's holes (it never compacts): its rows' tokens go into them."""
    budget, room = _sizes(name)
    _assert_fixed_steps_match_eager(name, family, budget, shorter=3, **room)


@pytest.mark.parametrize("shorter", [0, 3])
@pytest.mark.parametrize("name", ["h2o", "streaming", "full"])
def test_a_fixed_step_writes_its_tokens_keys_and_values_once(name, shorter):
    """The new token's K/V wait beside the slots until the step puts them where they go (a free slot or the evicted
    one), padded rows too: never stored in the spare slot and moved (compiled, that move copied every layer's
    cache: a padded batch-8 step of SmolLM2 took 1.5x an unpadded one)."""
    budget, room = _sizes(name)
    model, cache, token, position = _prefilled(name, budget=budget, shorter=shorter, **room)
    step = _fixed_as_compiled(model)
    for _ in range(BUDGET - PROMPT + 2):  # filling, then evicting
        spare = [(layer.keys[:, :, layer.fixed_slots].clone(), layer.values[:, :, layer.fixed_slots].clone())
                 for layer in cache.layers]
        token = _decode(step, model, cache, token, position, steps=1)[0].argmax(-1)
        position = position + 1
        for layer, (keys, values) in zip(cache.layers, spare):
            assert torch.equal(layer.keys[:, :, layer.fixed_slots], keys)
            assert torch.equal(layer.values[:, :, layer.fixed_slots], values)


def _assert_fixed_steps_match_eager(name, family, budget, shorter: int = 0, **room) -> EvictionCache:
    model, reference, token, position = _prefilled(name, family, budget, shorter=shorter, **room)
    _, fixed, _, _ = _prefilled(name, family, budget, shorter=shorter, **room)
    assert fixed.padded == bool(shorter)
    step = _fixed_as_compiled(model)
    expected = _decode(DecodeStep(model), model, reference, token, position)
    torch.testing.assert_close(_decode(step, model, fixed, token, position), expected, rtol=1e-5, atol=1e-5)
    assert step.compiled_steps == STEPS  # every step fixed: filling, then evicting
    assert fixed.length == reference.length == PROMPT + STEPS and torch.equal(fixed.seen, reference.seen)
    for ours, theirs in zip(fixed.layers, reference.layers):
        assert (ours.used, ours.peak_tokens) == (theirs.used, theirs.peak_tokens)
        assert torch.equal(_kept(ours), _kept(theirs))
    return fixed


def test_which_caches_take_a_fixed_step():
    def fits(name, budget=BUDGET, prompt=PROMPT, **options):
        return _prefilled(name, budget=budget, prompt=prompt, **options)[1].fits_fixed_step()

    assert fits("streaming") and fits("h2o") and fits("full", None, expected_length=PROMPT + 2)
    assert not fits("full", None, prompt=63)  # 64 slots: none free beside the spare (it grows, eagerly)
    assert not fits("adakv") and not fits("lagkv") and fits("streaming", kv_bits=4)
    assert fits("h2o", shorter=2) and fits("full", None, shorter=2, expected_length=PROMPT + 2)  # padded rows too


def test_a_bounded_cache_gets_its_spare_slot_before_its_first_fixed_step():
    _, cache, _, _ = _prefilled("streaming", budget=100)  # 6 tokens: 64 slots allocated
    assert cache.layers[0].keys.shape[2] == 64 and cache.fits_fixed_step() and cache.layers[0].keys.shape[2] > 100


def test_decoding_lets_go_of_the_prefill_room_and_a_chunk_grows_it_back():
    """Fixed steps keep a bounded layer's budget, the spare slot and the rollback (the room a prefill chunk needed
    is let go, once: one shape for every step after); a chunk after them grows the slots back; every logit is the
    eager steps' (which never let go)."""
    runs = []
    for fixed in (True, False):
        model, cache, token, position = _prefilled("h2o", prompt=14, rollback=2)
        assert cache.layers[0].keys.shape[2] == BUDGET + 8  # the budget and a chunk
        step = _fixed_as_compiled(model) if fixed else DecodeStep(model)
        logits = [_decode(step, model, cache, token, position, steps=3)]
        if fixed:
            assert all(layer.keys.shape[2] == BUDGET + 1 + 2 for layer in cache.layers)
        ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            logits.append(prefill(model, cache, ids, torch.ones_like(ids), 8, start=int(position[0]) + 3)[None])
            assert cache.layers[0].keys.shape[2] >= BUDGET + 6
            logits.append(_decode(step, model, cache, logits[-1][0].argmax(-1), position + 9, steps=3))
        runs.append((torch.cat(logits), [_kept(layer) for layer in cache.layers]))
    (ours, kept), (eager, eager_kept) = runs
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(kept, eager_kept))


def test_a_step_updates_the_tokens_seen_in_place():
    model, cache, token, position = _prefilled("h2o")
    seen = cache.seen
    with torch.inference_mode():
        DecodeStep(model)(cache, token, position)
    assert cache.seen is seen and seen.tolist() == [7, 7]


@pytest.mark.parametrize("graphs", [False, True])
def test_a_compiled_step_returns_its_own_logits(graphs):
    model, cache, token, position = _prefilled("streaming")
    step, outputs = _fixed_as_compiled(model), []
    step.graphs = graphs  # as with compile=True on CPU / CUDA; the "graph" is the eager step

    def graph(*args):
        assert cache.fixed_step
        outputs.append(step.eager(*args))
        return outputs[-1]

    step._run = graph
    token = _decode(step, model, cache, token, position, STEPS - 1)[-1].argmax(-1)
    with torch.inference_mode():
        logits = step(cache, token, position + STEPS - 1)
    assert len(outputs) == STEPS and cache.length == PROMPT + STEPS  # counted once a step, around the graph
    assert (logits is not outputs[-1]) == graphs and torch.equal(logits, outputs[-1])  # a graph's output is cloned


@pytest.mark.parametrize("name", ["streaming", "h2o", "full"])
def test_a_compiled_step_compiles_once(name):
    """The step's graph reads no Python number that changes from step to step (the cache's length and the layers'
    held counts are kept outside it): one compile serves every step, filling and evicting (``full``: filling)."""
    torch._dynamo.reset()
    model, cache, token, position = _prefilled(name, budget=None if name == "full" else BUDGET,
                                               expected_length=PROMPT + STEPS + 1)
    step = _fixed_as_compiled(model)
    step._run = torch.compile(step.eager, fullgraph=True, backend="eager")
    torch._dynamo.utils.counters.clear()
    _decode(step, model, cache, token, position)
    assert step.compiled_steps == STEPS and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert cache.length == PROMPT + STEPS


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_another_announced_length_takes_the_same_compiled_step(name):
    """Every ``generate`` announces its own length (prompt + new tokens): a bounded cache's step over the same slots
    is the same graph (it compiled anew for every length, a minute each for SmolLM2 here, when the step read the
    length itself)."""
    torch._dynamo.reset()
    model = tiny_model("llama")
    step = _through_dynamo(model)
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    torch._dynamo.utils.counters.clear()
    for length in (PROMPT + STEPS + 20, PROMPT + STEPS + 30):
        cache = EvictionCache(model, make_policy(name, BUDGET), chunk_size=8, expected_length=length)
        with torch.inference_mode():
            token, position = prefill(model, cache, ids, torch.ones_like(ids), 8).argmax(-1), torch.full((2,), PROMPT)
        _decode(step, model, cache, token, position)
    assert step.compiled_steps == 2 * STEPS and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_the_compiled_step_writes_the_cache_in_place(name):
    """Inductor's code for a step allocates nothing the size of a layer's K/V: the step's one write per buffer (the
    new token into the slot it takes) is done in place, not by copying the cache (it was, four times a step, before
    the write was made single and inductor's reordering for locality turned off). Nor, where no attention is summed,
    anything the size of a slot buffer (index, valid): their writes by slot number are done in place too (written
    as slices, each was copied whole twice a step)."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    torch._dynamo.reset()
    model, cache, token, position = _prefilled(name, prompt=12)  # a prompt over the budget of 10: evicting
    step = DecodeStep(model, compile=True)
    with torch.inference_mode(), fresh_cache():
        _, code = run_and_get_code(step, cache, token, position)
    keys, allocated = cache.layers[0].keys, _allocated_shapes("".join(code))
    assert step.compiled_steps == 1 and allocated  # (the test sees allocations)
    assert tuple(keys.shape) not in allocated
    assert (tuple(keys.shape[:3]) in allocated) == (name == "h2o")  # (h2o: its sums' new values)


def _allocated_shapes(code: str) -> set[tuple[int, ...]]:
    """The shapes of the buffers inductor's code allocates, from its Python wrapper (``empty_strided_cpu((2, 8),
    ...)``) or its C++ one (``aoti_torch_empty_strided(2, int_array_6, ...)``, ``int_array_6[] = {2L, 8L}``)."""
    arrays = {name: tuple(int(v) for v in re.findall(r"-?\d+", values))
              for name, values in re.findall(r"int64_t (int_array_\d+)\[\] = \{([^}]*)\}", code)}
    shapes = {tuple(int(v) for v in re.findall(r"\d+", dims))
              for dims in re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", code)}
    return shapes | {arrays[name] for name in re.findall(r"aoti_torch_empty_strided\(\d+, (int_array_\d+)", code)}


def test_every_decode_step_shares_the_compiled_graphs_and_counting_breaks_keeps_them():
    """A new ``DecodeStep`` (a new bench row, a new generate call) finds the step already compiled for its shapes, and
    counting graph breaks (``torch._dynamo.explain`` resets dynamo) does not throw the graphs away."""
    first, second = (DecodeStep(tiny_model("llama"), compile="whole") for _ in range(2))
    assert first._run.func is second._run.func
    first, second = (DecodeStep(tiny_model("llama"), compile="regional") for _ in range(2))
    assert first._run.args[0].compiled is second._run.args[0].compiled  # (the compiled block, called directly)
    torch._dynamo.reset()
    model, cache, token, position = _prefilled("h2o")
    step = _through_dynamo(model)
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        token, position = _decode(step, model, cache, token, position, 2)[-1].argmax(-1), position + 2
        assert step.graph_breaks(cache, token, position) == 0  # (captured once more, by a counting backend)
        _decode(step, model, cache, token, position + 1, 2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the step's graph, and the count's


@pytest.mark.parametrize("name", FIXED)
def test_a_caches_fingerprint_holds_from_step_to_step_and_changes_with_its_state(name):
    """What tells a state that passed dynamo's guards: every fixed-step policy's cache has the same fingerprint
    after every step (the counts kept outside the graph are left out), so its steps skip the guards; a changed
    number, another buffer, a new shape change it. Rolling sinks change it once, at the step that may first evict
    (from then on the sinks take a frame of their own: ``EvictionLayer.may_evict``)."""
    budget, room = _sizes(name)
    model, cache, token, position = _prefilled(name, budget=budget, **room)
    step, prints = _fixed_as_compiled(model), []
    for _ in range(STEPS):
        token, position = _decode(step, model, cache, token, position, steps=1)[0].argmax(-1), position + 1
        prints.append(cache.step_fingerprint())
    changes = [i for i in range(1, STEPS) if prints[i] != prints[i - 1]]
    assert changes == ([BUDGET - PROMPT] if cache.layers[0].sinks else []) and cache.layers[0].used > 0
    layer, steady = cache.layers[-1], prints[-1]
    layer.pinned += 1
    assert cache.step_fingerprint() != steady
    layer.pinned -= 1
    keys = layer.keys
    layer.keys = keys.clone()
    assert cache.step_fingerprint() != steady
    layer.keys = keys[:, :, :-1]
    assert cache.step_fingerprint() != steady
    layer.keys = keys
    assert cache.step_fingerprint() == steady


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["streaming", "h2o", "full"])
def test_a_steady_step_runs_its_graph_without_dynamo_and_gives_the_eager_logits(name):
    """The first step compiles (through dynamo), the second finds its graph by dynamo's guards, and every later step
    calls that graph directly: dynamo is not entered again (rolling sinks: but once more, for the state that may
    evict)."""
    torch._dynamo.reset()
    budget, room = _sizes(name)
    model, reference, token, position = _prefilled(name, budget=budget, **room)
    _, cache, _, _ = _prefilled(name, budget=budget, **room)
    step = _through_dynamo(model)
    through_dynamo, run = [], step._run
    step._run = lambda *args: through_dynamo.append(1) or run(*args)
    expected = _decode(DecodeStep(model), model, reference, token, position)
    torch.testing.assert_close(_decode(step, model, cache, token, position), expected, rtol=1e-5, atol=1e-5)
    states = _graph_states(cache)
    assert step.compiled_steps == STEPS and step.unguarded_steps == STEPS - 2 * states
    assert len(through_dynamo) == states
    with torch.compiler.set_stance("force_eager"):  # a stance the caller chose is kept: through dynamo
        _decode(step, model, cache, expected[-1].argmax(-1), position + STEPS, steps=1)
    assert step.unguarded_steps == STEPS - 2 * states and len(through_dynamo) == states + 1
    torch._dynamo.reset()  # dynamo's graphs dropped: the step compiles again rather than run a dropped graph
    _decode(step, model, cache, expected[-1].argmax(-1), position + STEPS + 1, steps=1)
    assert step.unguarded_steps == STEPS - 2 * states and len(through_dynamo) == states + 2


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_without_direct_calls_every_step_goes_through_dynamo_to_the_same_logits(name):
    """Where this PyTorch lacks what ``graph_calls`` reads, the step keeps to ``torch.compile``'s public path: every
    step through dynamo (its guards each time), none called directly, the same logits."""
    assert graph_calls.available(torch.compile(_step, isolate_recompiles=True))  # (this PyTorch: the fast path)
    assert not graph_calls.available(lambda *args: None)
    torch._dynamo.reset()
    budget, room = _sizes(name)
    model, reference, token, position = _prefilled(name, budget=budget, **room)
    _, cache, _, _ = _prefilled(name, budget=budget, **room)
    step = _through_dynamo(model)
    step.direct_calls = False
    through_dynamo, run = [], step._run
    step._run = lambda *args: through_dynamo.append(1) or run(*args)
    expected = _decode(DecodeStep(model), model, reference, token, position)
    torch.testing.assert_close(_decode(step, model, cache, token, position), expected, rtol=1e-5, atol=1e-5)
    assert step.compiled_steps == len(through_dynamo) == STEPS and step.unguarded_steps == 0


def _python_state(cache) -> list[dict]:
    """The cache's and its layers' attributes, tensors by value."""
    return [{name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in vars(obj).items()}
            for obj in (cache, *cache.layers)]


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["streaming", "h2o", "full"])
def test_a_steady_step_calls_its_graph_on_recorded_inputs_and_makes_the_recorded_assignments(name, monkeypatch):
    """The step that finds a state's graph by its guards runs dynamo's code for that graph once and records it: the
    graph's inputs, where the token and position go, the assignments after the graph. The state's later steps call
    the graph on those inputs and make those assignments: the logits, the cache's buffers and every Python attribute
    of the cache and its layers are what running dynamo's code each step gives."""
    results = []
    for replay in (True, False):
        if not replay:
            monkeypatch.setattr(graph_calls.GraphCall, "_record", lambda self, args, fresh: self.function(*args))
        torch._dynamo.reset()
        budget, room = _sizes(name)
        model, cache, token, position = _prefilled(name, budget=budget, **room)
        step = _through_dynamo(model)
        logits = _decode(step, model, cache, token, position)
        calls = list(step._graphs[cache].values())  # (rolling sinks: the state before the budget passed, then after)
        assert len(calls) == _graph_states(cache) and (calls[-1].recorded is not None) == replay
        results.append((logits, _python_state(cache)))
    (logits, state), (expected, expected_state) = results
    assert torch.equal(logits, expected)
    for ours, theirs in zip(state, expected_state):
        assert ours.keys() == theirs.keys()
        for attribute, value in ours.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, theirs[attribute]), attribute
            elif isinstance(value, (int, float, str, type(None))):
                assert value == theirs[attribute], attribute
            else:  # (each run's own policy, model, weak reference to its cache)
                assert type(value) is type(theirs[attribute]), attribute


@pytest.mark.heavy
def test_a_step_under_a_profiler_runs_dynamos_code_and_leaves_the_profiler_its_hook():
    """Recording a state's graph takes the interpreter's profile hook for a step; under a profiler (``cProfile``) the
    step runs dynamo's code as it is, records nothing, and the profiler keeps profiling."""
    import cProfile

    torch._dynamo.reset()
    model, cache, token, position = _prefilled("h2o")
    step = _through_dynamo(model)
    profiler = cProfile.Profile()
    with profiler:
        _decode(step, model, cache, token, position, steps=3)
        assert sys.getprofile() is not None
    (call,) = step._graphs[cache].values()
    assert call.recorded is None and call.replayable
    _decode(step, model, cache, token, position + 3, steps=2)
    assert call.recorded is not None


def test_a_graph_for_dynamic_sizes_is_called_on_recorded_inputs_too():
    """A second batch size (past 1, which dynamo specializes) makes dynamo compile a graph for dynamic sizes, whose
    code reads them from its inputs (``call_size``): fixed for a state, so that graph is recorded and called directly
    too, with the eager logits."""
    torch._dynamo.reset()
    model, cache, token, position = _prefilled("h2o")
    step = _through_dynamo(model)
    _decode(step, model, cache, token, position, steps=3)
    ids = torch.randint(3, VOCAB, (3, PROMPT), generator=torch.Generator().manual_seed(1))
    caches = [EvictionCache(model, make_policy("h2o", BUDGET), chunk_size=8) for _ in range(2)]
    with torch.inference_mode():
        for single in caches:
            token = prefill(model, single, ids, torch.ones_like(ids), 8).argmax(-1)
        position = torch.full((3,), PROMPT)
    expected = _decode(DecodeStep(model), model, caches[0], token, position)
    torch.testing.assert_close(_decode(step, model, caches[1], token, position), expected, rtol=1e-5, atol=1e-5)
    (call,) = step._graphs[caches[1]].values()
    assert "call_size" in call.code.co_names and call.recorded is not None
    assert step.unguarded_steps == 1 + STEPS - 2


def test_a_recorded_step_lets_go_of_another_states_inputs():
    """A cache whose buffers were replaced (a prompt chunk grew them) takes a new state: the old state's recorded
    inputs, which hold the old buffers, are let go."""
    torch._dynamo.reset()
    model, cache, token, position = _prefilled("h2o")
    step = _through_dynamo(model)
    _decode(step, model, cache, token, position, steps=3)
    (first,) = step._graphs[cache].values()
    assert first.recorded is not None
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = prefill(model, cache, ids, torch.ones_like(ids), 9, start=int(position[0]) + 3)
    _decode(step, model, cache, logits.argmax(-1), position + 12, steps=2)
    assert len(step._graphs[cache]) == 2 and first.recorded is None


@pytest.mark.heavy
def test_a_changed_state_passes_the_guards_again_and_takes_its_own_graph():
    """One step alternating between caches of two shapes (two graphs), then a prompt chunk that grows one cache's
    slots (new buffers) and a budget changed between steps: each new state is checked by dynamo's guards, which
    pick or compile its graph, and every logit stays the eager step's."""
    torch._dynamo.reset()
    step, eager, runs = None, None, []
    for budget in (BUDGET, BUDGET + 3):
        model, reference, token, position = _prefilled("h2o", budget=budget)
        _, cache, _, _ = _prefilled("h2o", budget=budget)
        runs.append([reference, cache, token, position])
    step, eager = _through_dynamo(model), DecodeStep(model)
    torch._dynamo.utils.counters.clear()

    def one_step(run):
        reference, cache, token, position = run
        expected = _decode(eager, model, reference, token, position, steps=1)
        torch.testing.assert_close(_decode(step, model, cache, token, position, steps=1), expected)
        with torch.inference_mode():
            run[2:] = expected[0].argmax(-1), position + 1

    for _ in range(3):
        for run in runs:
            one_step(run)
    # each cache's first two steps checked: by dynamo (compiling), then to find the graph it compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2 and step.unguarded_steps == 2
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    for index, cache in enumerate(runs[0][:2]):
        with torch.inference_mode():
            logits = prefill(model, cache, ids, torch.ones_like(ids), 9, start=int(runs[0][3][0]))
        if index == 0:
            expected = logits
    torch.testing.assert_close(logits, expected)
    with torch.inference_mode():
        runs[0][2:] = logits.argmax(-1), runs[0][3] + 9
    one_step(runs[0])
    for cache in runs[1][:2]:
        for layer in cache.layers:
            layer.policy = make_policy("h2o", BUDGET)  # a smaller budget: the same slots, another eviction
    for _ in range(2):
        for run in runs:
            one_step(run)
    # the grown cache compiles a third graph (checked twice, then run directly once); the smaller budget's guards
    # find that graph at once (its slots and budget are the grown cache's now), which then runs directly
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
    assert step.compiled_steps == 11 and step.unguarded_steps == 2 + 1 + 1


def test_the_compiled_step_builds_on_a_torch_without_a_per_function_recompile_limit(monkeypatch):
    """torch before 2.13 has no ``recompile_limit`` keyword on ``torch.compile`` (an H200 run on torch 2.11 failed on
    it): the step is compiled without it, and dynamo's global limit is raised to the step's instead."""
    import sparsegen.engine.step as decoding

    def old_compile(model, *, fullgraph=False, options=None):  # torch.compile's signature before the keyword
        return ("compiled", model, fullgraph, options)

    before = torch._dynamo.config.recompile_limit
    monkeypatch.setattr(torch, "compile", old_compile)
    # (dynamo's config restored by its own patch: monkeypatch's undo deletes the setting, which hides it from dynamo)
    with torch._dynamo.config.patch(recompile_limit=8):
        compiled = decoding._compiled_step.__wrapped__(False)
        assert compiled[:3] == ("compiled", _step, True)
        assert torch._dynamo.config.recompile_limit == decoding.COMPILED_SHAPES
    assert torch._dynamo.config.recompile_limit == before  # (and still readable: later compiles need it)


def _deep_llama():
    """Four layers, so that a regional step in blocks of two runs two blocks through one graph."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.kv.families import _gqa

    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(LlamaConfig(**_gqa(num_hidden_layers=4)), attn_implementation="sdpa").eval()


def _regional(model, monkeypatch, backend="eager", block: int = 2) -> DecodeStep:
    """A regional DecodeStep whose blocks go through dynamo with ``backend``, in blocks of ``block`` layers; each
    block's layers are recorded in ``step.blocks_run``."""
    import sparsegen.engine.step as decoding

    compiled = torch.compile(decoding.run_block, fullgraph=True, backend=backend)

    def run(layers, hidden, calls):
        step.blocks_run.append(layers)
        return compiled(layers, hidden, calls)

    monkeypatch.setattr(decoding, "_compiled_block", lambda: run)
    monkeypatch.setattr(decoding, "BLOCK_LAYERS", block)
    step = DecodeStep(model, compile="regional")
    step.blocks_run = []
    assert step.mode == "regional"
    return step


@pytest.mark.parametrize("kv_bits", [None, KVQuantization(4, residual=3)])
@pytest.mark.parametrize("name, family", [(name, "deep llama") for name in ("full", "streaming", "h2o", "snapkv")]
                         + [("h2o", "gemma3"), ("streaming", "gemma3")])
def test_a_regional_step_gives_the_eager_steps_logits_kept_tokens_and_counts(name, family, kv_bits, monkeypatch):
    """The layers run a block at a time through one compiled function (each layer seeing the cache as its own
    ``LayerView``): the eager step's logits, kept tokens and counts, filling and evicting, rows of two lengths, K/V
    quantized or not; one graph serves every block of the same layer kinds (Gemma 3's three layers: one block)."""
    torch._dynamo.reset()
    budget, room = _sizes(name)
    options = {**room, "kv_bits": kv_bits} if kv_bits else room
    model = _deep_llama() if family == "deep llama" else tiny_model(family)
    cache = {}
    for which in ("reference", "regional"):
        cache[which], token, position = _prefilled_with(model, name, budget, options)
    step = _regional(model, monkeypatch)
    torch._dynamo.utils.counters.clear()
    expected = _decode(DecodeStep(model), model, cache["reference"], token, position)
    torch.testing.assert_close(_decode(step, model, cache["regional"], token, position), expected, rtol=1e-5,
                               atol=1e-5)
    layers = list(model.model.layers)
    size = 2 if family == "deep llama" else 3
    assert step.compiled_steps == STEPS and step.block_size == size
    assert step.blocks_run == STEPS * [tuple(layers[i:i + size]) for i in range(0, len(layers), size)]
    rolling = any(layer.sinks for layer in cache["regional"].layers)  # (they take the sinks' frame: a new state)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1 + rolling
    for ours, theirs in zip(cache["regional"].layers, cache["reference"].layers):
        assert (ours.used, ours.peak_tokens) == (theirs.used, theirs.peak_tokens)
        assert torch.equal(_kept(ours), _kept(theirs))
    assert cache["regional"].block_step is None  # (only during a step)


@pytest.mark.parametrize("name, family", [(name, "deep llama") for name in ("full", "streaming", "h2o")]
                         + [("h2o", "gemma3"), ("h2o", "deep llama w8a8")])
def test_a_regional_steps_steady_blocks_run_their_graphs_without_dynamo_and_give_the_eager_logits(name, family,
                                                                                                   monkeypatch):
    """Each block's graph, once dynamo's guards have chosen it for a state, is recorded on two calls and, where both
    recorded the same inputs, called on them from the third (``graph_calls.BlockCalls``): the eager step's logits,
    the same logits, kept tokens and counts as every block through dynamo, and every block of a steady step direct
    (rolling sinks: a second state, once they may evict). With packed weights too: their linears that share an
    input (``SharedInput``) hand outputs on between calls, which a replayed block must do as dynamo's code did."""
    import sparsegen.engine.step as decoding

    budget, room = _sizes(name)
    model = tiny_model(family) if family == "gemma3" else _deep_llama()
    if family.endswith("w8a8"):
        with torch.inference_mode():
            quantize_weights(model, "w8a8")
    monkeypatch.setattr(decoding, "BLOCK_LAYERS", 2)
    results = []
    for direct in (True, False):
        torch._dynamo.reset()
        compiled = torch.compile(decoding.run_block, fullgraph=True, backend="eager", isolate_recompiles=True)
        monkeypatch.setattr(decoding, "_compiled_block", lambda: compiled)
        (cache, token, position), (reference, _, _) = (_prefilled_with(model, name, budget, room) for _ in range(2))
        step = DecodeStep(model, compile="regional")
        step.direct_calls = direct
        logits = _decode(step, model, cache, token, position)
        results.append((logits, cache, step))
        if direct:
            torch.testing.assert_close(logits, _decode(DecodeStep(model), model, reference, token, position),
                                       rtol=1e-5, atol=1e-5)
            assert step.unguarded_steps == STEPS - 3 * _graph_states(cache)
        else:
            assert step.unguarded_steps == 0
    (logits, cache, _), (expected, expected_cache, _) = results
    assert torch.equal(logits, expected)
    for ours, theirs in zip(cache.layers, expected_cache.layers):
        assert (ours.used, ours.peak_tokens) == (theirs.used, theirs.peak_tokens)
        assert torch.equal(_kept(ours), _kept(theirs))


def _prefilled_with(model, name: str, budget: int | None, room: dict):
    """``model``'s cache of two rows of ``PROMPT`` tokens (the second left-padded by 3), its next tokens and
    positions."""
    cache = EvictionCache(model, make_policy(name, budget), chunk_size=8, **room)
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.inference_mode():
        return cache, prefill(model, cache, ids, mask, 8).argmax(-1), mask.sum(-1)


def test_a_confirmed_graph_call_is_replayed_only_where_its_inputs_are_the_calls_fresh_ones_or_the_same():
    """A graph recorded with ``confirm`` is called on its recorded inputs from its third call, the call's fresh
    tensors in their places; one whose graph reads a tensor made anew for each call outside ``fresh`` (here an
    attribute) records two different inputs, so it is never replayed: every call runs dynamo's code, and is right."""

    class Holder:
        pass

    def add(holder, x):
        return x + holder.addend

    compiled = torch.compile(add, fullgraph=True, backend="eager", isolate_recompiles=True)
    for addend_each_call in (False, True):
        holder = Holder()
        holder.addend = torch.ones(3)
        compiled(holder, torch.zeros(3))
        graph = graph_calls.graph_passing_guards(add, compiled._isolate_recompiles_id,
                                                 {"holder": holder, "x": torch.zeros(3)}, confirm=True)
        for i in range(5):
            if addend_each_call:
                holder.addend = torch.full((3,), float(i))
            x = torch.full((3,), 10.0 * i)
            assert torch.equal(graph((holder, x), (x,)), x + holder.addend)
        assert (graph.recorded is not None) == (not addend_each_call) and graph.replayable == (not addend_each_call)


def _llama_of(layers: int, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.kv.families import _gqa

    return LlamaForCausalLM._from_config(LlamaConfig(**_gqa(num_hidden_layers=layers, **config)))


def _gemma_of(layers: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tests.kv.families import _gqa

    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    return Gemma3ForCausalLM._from_config(Gemma3TextConfig(**_gqa(head_dim=16, num_hidden_layers=layers,
                                                                  sliding_window=6, layer_types=kinds)))


@pytest.mark.parametrize("model, size", [(lambda: _llama_of(30), 5), (lambda: _llama_of(2), 2),
                                         (lambda: _llama_of(7), 7), (lambda: _llama_of(12), 6),
                                         (lambda: _gemma_of(18), 6), (lambda: _gemma_of(26), 6),
                                         (lambda: tiny_model("gemma3"), 3)])
def test_a_regional_steps_blocks_repeat_the_layer_kinds_and_divide_the_layers(model, size):
    """SmolLM2's 30 layers in 6 blocks of 5; Gemma 3's pattern of five sliding layers and a global one in blocks of
    6 (18 layers: 3 blocks; 26: 4 and a last block of 2, its own graph); 7 layers in one block (no size from 5 to 6
    divides them); a model of fewer than 5 layers in one block."""
    from sparsegen.engine.step import block_size

    assert block_size(model()) == size


def test_what_compile_means_for_a_model():
    """True and None (where compiled by default) are regional on a CPU; a model whose decoder layers carry hooks of
    their own (a contextual plan's predictors run where a layer is called, which a block moves) compiles whole, and
    asked for regional explicitly, says so; an unknown mode is refused."""
    from sparsegen.engine.step import compile_mode

    model = tiny_model("llama")
    assert compile_mode(model, True) == compile_mode(model, "regional") == "regional"
    assert compile_mode(model, None) is None and compile_mode(model, False) is None  # (fp32 weights: eager)
    assert compile_mode(model, "whole") == "whole"
    with pytest.raises(ValueError, match="regional, whole"):
        compile_mode(model, "fast")
    handle = model.model.layers[0].register_forward_pre_hook(lambda module, args: None)
    assert compile_mode(model, True) == "whole"
    with pytest.raises(ValueError, match="--compile whole"):
        compile_mode(model, "regional")
    handle.remove()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_regional_step_counts_no_graph_breaks_in_its_blocks(family, monkeypatch):
    model, cache, token, position = _prefilled("h2o", family, prompt=12)
    step = _regional(model, monkeypatch)
    with torch.inference_mode():
        assert step.graph_breaks(cache, token, position) == 0


@pytest.mark.heavy
def test_a_regional_step_compiles_one_block_for_every_block_and_gives_the_eager_logits(monkeypatch):
    """Through inductor (C++ wrapper, as shipped): two blocks of two layers, one graph for both, the eager step's
    logits, filling and evicting."""
    import sparsegen.engine.step as decoding

    torch._dynamo.reset()
    monkeypatch.setattr(decoding, "BLOCK_LAYERS", 2)
    model = _deep_llama()
    caches = [EvictionCache(model, make_policy("streaming", BUDGET), chunk_size=8) for _ in range(2)]
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        token = [prefill(model, cache, ids, torch.ones_like(ids), 8).argmax(-1) for cache in caches][0]
        position = torch.full((2,), PROMPT)  # (an inference tensor, as the steps' next positions are)
    step = DecodeStep(model, compile="regional")
    torch._dynamo.utils.counters.clear()
    expected = _decode(DecodeStep(model), model, caches[0], token, position)
    torch.testing.assert_close(_decode(step, model, caches[1], token, position), expected, rtol=1e-4, atol=1e-4)
    assert step.compiled_steps == STEPS and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # (sinks)


def test_a_regional_compile_within_a_known_shape_is_told_and_counted(monkeypatch, capsys):
    """A new state within a shape the step has run (rolling sinks passing their budget) compiles its blocks anew
    without the shape's watch: once the step is done, past the notice's wait, it is counted and told."""
    import sparsegen.engine.step as decoding

    slow = {"steps": 0}

    def run(layers, hidden, calls):  # (the blocks eager; the third step as long as a compile)
        if slow["steps"] == 2 and layers[0] is model.model.layers[0]:
            time.sleep(0.2)
        return decoding.run_block(layers, hidden, calls)

    model = _deep_llama()
    monkeypatch.setattr(decoding, "_compiled_block", lambda: run)
    monkeypatch.setattr(decoding, "COMPILE_NOTICE_AFTER", 0.1)
    step = DecodeStep(model, compile="regional")
    cache = EvictionCache(model, make_policy("h2o", 12), chunk_size=8)
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        token = prefill(model, cache, ids, torch.ones_like(ids), 8).argmax(-1)
        before = decoding.COMPILES.count
        for position in range(10, 13):
            token = step(cache, token, torch.tensor([position])).argmax(-1)
            slow["steps"] += 1
    assert decoding.COMPILES.count == before + 1
    assert "decode step compiled in" in capsys.readouterr().err
