"""A steady decode step of an unpadded cache reads nothing from the device: whether a row is over its budget and
where its one hole is are known on the host, so the step never waits on the device (and a compiler could take it
whole). Counted at the dispatcher (``sparsegen.bench.syncs``) over steps before and after the budget fills."""

import pytest
import torch

from sparsegen.bench.syncs import HostSyncs
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.kv.rows import stack
from sparsegen.models.compat import cache_kwargs
from tests.kv.families import VOCAB, named_policies, tiny_model

# heads share a row of slots and hold different counts: their step still reads counts (Ada-KV)
SHARED_SLOTS = {name for name, cls in named_policies().items() if cls.shares_slots}
# LagKV scores a partition once it is complete: whether one is due, and how many, is read
READING = {name for name, cls in named_policies().items() if cls.reads_host}


def _decode_syncs(family: str, name: str, kv_bits=None) -> list[int]:
    """Host reads of each of 12 decode steps after a 6-token prompt, budget 10 (filled at the 5th step)."""
    model = tiny_model(family)
    cache = EvictionCache(model, make_policy(name, None if name == "full" else 10), chunk_size=8, kv_bits=kv_bits)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    counts = []
    with torch.inference_mode():
        token = model(input_ids=ids, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        for _ in range(12):
            with HostSyncs() as syncs:
                token = model(input_ids=token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
            counts.append(syncs.count)
    return counts


@pytest.mark.parametrize("kv_bits", [None, 4])
@pytest.mark.parametrize("name", sorted(set(named_policies()) - SHARED_SLOTS - READING))
def test_every_policy_decodes_without_host_reads(name, kv_bits):
    """With 4-bit K/V too: the slots whose token is still in the full-precision residual are found and read in
    shapes that do not depend on the data."""
    assert _decode_syncs("llama", name, kv_bits) == [0] * 12


def test_sliding_window_layers_too():
    assert _decode_syncs("gemma3", "h2o") == [0] * 12


@pytest.mark.parametrize("name", sorted(SHARED_SLOTS | READING))
def test_policies_that_still_read(name):
    """Not there yet (issue 36): a shared row holds a different count per head, read to size the step; LagKV reads
    whether a partition is due."""
    assert sum(_decode_syncs("llama", name)[5:]) > 0


@pytest.mark.parametrize("name", ["streaming", "h2o", "window"])
def test_a_stacked_batch_of_different_lengths_decodes_without_host_reads(name):
    """A server's batch: sessions of 3, 9 and 15 tokens stacked (padded rows), decoding past the budget."""
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(0)
    caches = []
    with torch.inference_mode():
        for length in (3, 9, 15):
            cache = EvictionCache(model, make_policy(name, 10), chunk_size=16)
            model(input_ids=torch.randint(3, VOCAB, (1, length), generator=generator), **cache_kwargs(cache))
            caches.append(cache)
        batch = stack(model, caches, capacity=3)
        token, position, counts = torch.tensor([[5], [6], [7]]), torch.tensor([[3], [9], [15]]), []
        for _ in range(10):
            with HostSyncs() as syncs:
                logits = model(input_ids=token, position_ids=position, **cache_kwargs(batch)).logits
            counts.append(syncs.count)
            token, position = logits[:, -1:].argmax(-1), position + 1
    assert counts == [0] * 10
