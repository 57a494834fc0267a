"""The decode step's bookkeeping for CUDA graphs, checked on the CPU: when a cache is steady (a step leaves its
shapes as it found them), that a step updates the cache's state in place, and that a graph step runs only on a
steady cache and hands back its own copy of the logits. (Replaying on a GPU: tests/test_cuda.py.)"""

import pytest
import torch

from sparsegen.decoding import DecodeStep, prefill
from sparsegen.kv import EvictionCache, make_policy
from tests.kv.families import VOCAB, tiny_model


def _prefilled(name: str, family: str = "llama", budget: int | None = 10, prompt: int = 6):
    model = tiny_model(family)
    cache = EvictionCache(model, make_policy(name, budget), chunk_size=8)
    ids = torch.randint(3, VOCAB, (2, prompt), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        token = prefill(model, cache, ids, torch.ones_like(ids), 8).argmax(-1)
    return model, cache, token, torch.full((2,), prompt)


def _steady_after_each_step(name: str, family: str = "llama", budget: int | None = 10) -> list[bool]:
    model, cache, token, position = _prefilled(name, family, budget)
    step, steady = DecodeStep(model), []
    with torch.inference_mode():
        for _ in range(8):
            token, position = step(cache, token, position).argmax(-1), position + 1
            steady.append(cache.steady)
    return steady


def test_a_bounded_cache_is_steady_once_every_layer_holds_its_budget():
    # 6 prompt tokens, budget 10: full after 4 steps, steady from the first eviction (the 5th step) on
    assert _steady_after_each_step("streaming") == [False] * 4 + [True] * 4
    assert _steady_after_each_step("h2o", "gemma3") == [False] * 4 + [True] * 4  # sliding layers fill first


def test_a_full_cache_never_is():
    assert _steady_after_each_step("full", budget=None) == [False] * 8


def test_a_step_updates_the_tokens_seen_in_place():
    model, cache, token, position = _prefilled("h2o")
    seen = cache.seen
    with torch.inference_mode():
        DecodeStep(model)(cache, token, position)
    assert cache.seen is seen and seen.tolist() == [7, 7]


@pytest.mark.parametrize("graphs", [False, True])
def test_a_compiled_step_runs_only_on_a_steady_cache_and_returns_its_own_logits(graphs):
    model, cache, token, position = _prefilled("streaming")
    step, graph_calls, outputs = DecodeStep(model), [], []
    step.compiled, step.graphs = True, graphs  # as with compile=True on CPU / CUDA; the "graph" is the eager step

    def graph(*args):
        graph_calls.append(cache.steady)
        outputs.append(step.eager(*args))
        return outputs[-1]

    step._run = graph
    with torch.inference_mode():
        for _ in range(8):
            logits = step(cache, token, position)
            token, position = logits.argmax(-1), position + 1
    assert graph_calls == [True] * 3 and step.compiled_steps == 3
    assert cache.length == 6 + 8  # counted once a step, inside the eager step or, around the graph, by DecodeStep
    assert (logits is not outputs[-1]) == graphs and torch.equal(logits, outputs[-1])  # a graph's output is cloned


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_a_compiled_step_compiles_once(name):
    """The step's graph reads no Python number that changes from step to step (the cache's length, which
    transformers' mask code and the step's end read, is counted outside it): one compile serves every steady step."""
    torch._dynamo.reset()
    model, cache, token, position = _prefilled(name)
    step = DecodeStep(model)
    step.compiled, step._run = True, torch.compile(step.eager, fullgraph=True, backend="eager")
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        for _ in range(8):
            token, position = step(cache, token, position).argmax(-1), position + 1
    assert step.compiled_steps == 3 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert cache.length == 6 + 8


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_the_compiled_step_writes_the_cache_in_place(name):
    """Inductor's code for a steady step allocates nothing the size of a layer's K/V: the step's one write per
    buffer (the new token into the slot it evicts) is done in place, not by copying the cache (it was, four times a
    step, before the write was made single and inductor's reordering for locality turned off)."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    torch._dynamo.reset()
    model, cache, token, position = _prefilled(name, prompt=12)  # a prompt over the budget of 10: steady
    step = DecodeStep(model, compile=True)
    with torch.inference_mode(), fresh_cache():
        _, code = run_and_get_code(step, cache, token, position)
    keys = cache.layers[0].keys
    assert step.compiled_steps == 1 and f"empty_strided_cpu({tuple(keys.shape)}" not in "".join(code)
    assert f"empty_strided_cpu({tuple(keys.shape[:3])}" in "".join(code)  # (the test sees allocations: index's)
