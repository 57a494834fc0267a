import pytest
import torch

from sparsegen.engine.step import forward
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.kv.packed import PackedStep
from tests.kv.families import FAMILIES, VOCAB, tiny_model

CASES = [("full", None, None), ("streaming", 8, None), ("h2o", 8, None), ("adakv", 8, None), ("h2o", 8, 4),
         ("snapkv", 8, None)]


def _caches(model, policy, budget, kv_bits, positions=None):
    """A 3-row cache that has seen 10 tokens per row and a 1-row cache that has seen 6, from fixed random ids."""
    generator = torch.Generator().manual_seed(1)
    rows, prompt = (torch.randint(3, VOCAB, shape, generator=generator) for shape in ((3, 10), (1, 6)))

    def cache(ids):
        made = EvictionCache(model, make_policy(policy, budget), positions, kv_bits=kv_bits, chunk_size=4)
        for start in range(0, ids.shape[1], 4):
            chunk = ids[:, start:start + 4]
            forward(model, made, chunk, torch.arange(start, start + chunk.shape[1])[None].expand_as(chunk))
        return made

    return cache(rows), cache(prompt)


def _then(model, decoding, prefilling, tokens, chunk):
    """Logits of one more decode step on each cache after the step under test: what their state now gives."""
    after = forward(model, decoding, tokens[:, None], decoding.length + torch.zeros(3, 1, dtype=torch.long))
    more = chunk[:, :2]
    return after[:, 0], forward(model, prefilling, more, prefilling.length + torch.arange(2)[None])[0]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("policy,budget,kv_bits", CASES)
def test_a_packed_step_equals_the_decode_step_and_the_chunk_run_apart(family, policy, budget, kv_bits):
    """Each row's next token and a prompt's chunk in one forward give the logits the two forwards give, and leave
    both caches as those leave them (the next steps agree), for every family and kind of policy."""
    model = tiny_model(family)
    positions = "original" if family == "opt" else None  # (learned absolute positions cannot roll)
    tokens, chunk = torch.tensor([5, 7, 11]), torch.tensor([[13, 17, 19, 23, 29]])
    decoding, prefilling = _caches(model, policy, budget, kv_bits, positions)
    alone = forward(model, decoding, tokens[:, None], torch.full((3, 1), 10))[:, 0]
    chunk_alone = forward(model, prefilling, chunk, torch.arange(6, 11)[None])[0]
    later = _then(model, decoding, prefilling, tokens, chunk)

    decoding, prefilling = _caches(model, policy, budget, kv_bits, positions)
    ids = torch.cat((tokens, chunk[0]))[None]
    positions = torch.cat((torch.full((3,), 10), torch.arange(6, 11)))[None]
    packed = forward(model, PackedStep(decoding, prefilling), ids, positions)[0]
    torch.testing.assert_close(packed[:3], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[3:], chunk_alone, atol=1e-5, rtol=1e-5)
    assert (decoding.length, prefilling.length) == (11, 11)
    for got, expected in zip(_then(model, decoding, prefilling, tokens, chunk), later):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_packed_step_refuses_what_it_cannot_split():
    model = tiny_model("llama")
    decoding, prefilling = _caches(model, "h2o", 8, None)
    fresh = EvictionCache(model, make_policy("h2o", 8))
    with pytest.raises(ValueError, match="needs decoding rows"):
        PackedStep(fresh, prefilling)
    with pytest.raises(ValueError, match="prefills one sequence"):
        PackedStep(prefilling, decoding)
    packed = PackedStep(decoding, prefilling)
    with pytest.raises(ValueError, match="one unpadded row"):
        forward(model, packed, torch.tensor([[5, 7, 11, 13]]), torch.tensor([[10, 10, 10, 6]]),
                mask=torch.ones(1, 4, dtype=torch.long))
