"""On a CUDA GPU (skipped without one; CI has none, `make gpu-check` runs these where a GPU is): the decode step
never makes the device wait for the host, as the CUDA runtime itself counts it (``set_sync_debug_mode("error")``
raises at any synchronizing call: a read of a device value, ``nonzero``, a blocking copy either way); the GPU keeps
the same tokens and logits as the CPU; and the compiled step replays CUDA graphs with the eager step's logits."""

import contextlib

import pytest
import torch

from sparsegen.engine.prefill import prefill
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.kv.rows import stack
from tests.kv.families import VOCAB, named_policies, tiny_model
from tests.kv.test_host_syncs import READING, SHARED_SLOTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SYNC_FREE = sorted(set(named_policies()) - SHARED_SLOTS - READING)
BUDGET, PROMPT, STEPS = 10, 6, 16  # the budget fills at the 5th step: steps before and after


@contextlib.contextmanager
def syncs_forbidden():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _decode(name: str, device: str, family: str = "llama", compile: bool = False, forbid: bool = True):
    """Logits of each of ``STEPS`` greedy steps after a ``PROMPT``-token prompt (two rows), and the cache; the
    steps after the first two (compiled: the first ten, where the cache fills, the step compiles and its CUDA graph
    is recorded) run with syncs forbidden."""
    model = tiny_model(family).to(device)
    cache = EvictionCache(model, make_policy(name, None if name == "full" else BUDGET), chunk_size=8,
                          max_length=PROMPT + STEPS + 1)
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    step, logits = DecodeStep(model, compile=compile), []
    with torch.inference_mode():
        token = prefill(model, cache, ids, torch.ones_like(ids), 8).argmax(-1)
        position = torch.full((2,), PROMPT, device=device)
        for index in range(STEPS):
            with syncs_forbidden() if forbid and index >= (10 if compile else 2) else contextlib.nullcontext():
                out = step(cache, token, position)
                token, position = out.argmax(-1), position + 1
            logits.append(out.clone())
    assert step.compiled_steps == (STEPS if compile else 0)  # fixed-shape steps, filling and evicting
    # every step after the first two (dynamo compiles; its guards find the graph) runs that graph directly
    # (DecodeStep._state); the first, too, finds it where an earlier test compiled the same graph
    assert step.unguarded_steps in ((STEPS - 2, STEPS - 1) if compile else (0,))
    return torch.stack(logits).cpu(), cache


@pytest.mark.parametrize("name", SYNC_FREE)
def test_every_sync_free_policy_decodes_on_cuda_without_a_sync_and_as_on_the_cpu(name):
    on_gpu, gpu_cache = _decode(name, "cuda")
    on_cpu, cpu_cache = _decode(name, "cpu", forbid=False)
    torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-4, atol=1e-4)
    def kept(layer):
        return torch.where(layer.valid[..., :layer.used], layer.index[..., :layer.used], -1).sort(-1)[0]

    for gpu_layer, cpu_layer in zip(gpu_cache.layers, cpu_cache.layers):
        assert gpu_layer.used == cpu_layer.used
        assert torch.equal(kept(gpu_layer).cpu(), kept(cpu_layer))


def test_sliding_window_layers_decode_on_cuda_without_a_sync():
    _decode("h2o", "cuda", family="gemma3")


@pytest.mark.parametrize("name, family", [("streaming", "llama"), ("h2o", "llama"), ("tova", "llama"),
                                          ("h2o", "gemma3"), ("full", "llama")])
def test_the_compiled_step_replays_cuda_graphs_with_the_eager_logits(name, family):
    """Every step, filling and evicting, replays the one graph (``full``: its slots sized by ``max_length``)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled, _ = _decode(name, "cuda", family, compile=True)
    eager, _ = _decode(name, "cuda", family)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    counters = torch._dynamo.utils.counters
    assert counters["inductor"].get("cudagraph_skips", 0) == 0, dict(counters["inductor"])
    # one graph: no recompile every step, which past dynamo's limit would run eagerly unseen
    assert counters["stats"].get("unique_graphs", 0) == 1, dict(counters["stats"])


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_a_stacked_batch_of_different_lengths_decodes_on_cuda_without_a_sync(name):
    model = tiny_model("llama").to("cuda")
    generator = torch.Generator().manual_seed(0)
    caches = []
    with torch.inference_mode():
        for length in (3, 9, 15):
            cache = EvictionCache(model, make_policy(name, BUDGET), chunk_size=16)
            ids = torch.randint(3, VOCAB, (1, length), generator=generator).to("cuda")
            prefill(model, cache, ids, torch.ones_like(ids), 16)
            caches.append(cache)
        batch = stack(model, caches, capacity=3)
        token = torch.tensor([5, 6, 7], device="cuda")
        position = torch.tensor([3, 9, 15], device="cuda")
        step = DecodeStep(model)
        with syncs_forbidden():
            for _ in range(10):
                token, position = step(batch, token, position).argmax(-1), position + 1
