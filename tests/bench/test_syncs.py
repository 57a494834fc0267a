"""The host-read counter behind bench's ``host_syncs_per_token``: it sees every kind of read of a device value, and
nothing else."""

import pytest
import torch

from sparsegen.bench import decode
from sparsegen.bench.syncs import HostSyncs
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.compat import cache_kwargs
from tests.kv.families import VOCAB, tiny_model


@pytest.mark.parametrize("read,op", [
    (lambda x: int(x.max()), "scalar"), (lambda x: float(x.sum()), "scalar"), (lambda x: x[0].item(), "scalar"),
    (lambda x: bool((x > 2).any()), "scalar"), (lambda x: x.nonzero(), "nonzero"),
    (lambda x: x.nonzero(as_tuple=True), "nonzero"),
    (lambda x: x[x > 2], "index"), (lambda x: torch.equal(x, x), "equal"), (lambda x: x.unique(), "_unique2"),
])
@pytest.mark.parametrize("inference", [False, True])  # (the dispatcher sees some reads differently in each)
def test_each_kind_of_host_read_is_counted_once(read, op, inference):
    x = torch.arange(5)
    with torch.inference_mode(inference), HostSyncs() as syncs:
        read(x)
    assert dict(syncs.ops) == {op: 1}


def test_device_side_work_is_not_counted():
    x = torch.arange(6.0).view(2, 3)
    with HostSyncs() as syncs:
        y = torch.where(x > 2, x, 0).softmax(-1).argmax(-1, keepdim=True)
        x.scatter_(1, y, 1.0)
        x[:, :2] = x[:, 1:]  # slicing with Python ints reads nothing
    assert syncs.count == 0


@pytest.mark.heavy
def test_a_bench_row_counts_the_reads_of_its_decode_step():
    """The row's count is what one decode step of that cache reads: the same number counted here directly."""
    model = tiny_model("llama")
    setup = decode.Setup(model=model, model_name="tiny", random_weights=True, new_tokens=2, warmup=1, chunk_size=8)
    row = decode.measure(setup, "adakv", make_policy("adakv", 8), context=24, batch=1)  # (a policy that still reads)
    cache = EvictionCache(model, make_policy("adakv", 8), chunk_size=8)
    ids = torch.randint(3, VOCAB, (1, 24))
    with torch.inference_mode():
        for start in range(0, 24, 8):
            model(input_ids=ids[:, start:start + 8], **cache_kwargs(cache))
        with HostSyncs() as syncs:
            model(input_ids=ids[:, :1], position_ids=torch.tensor([[24]]), **cache_kwargs(cache))
    assert row["host_syncs_per_token"] == syncs.count > 0
