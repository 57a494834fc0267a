"""Quantized KV: codes round-trip within their bounds, a full-budget quantized cache matches a plain fake-quantizing
reference, the residual and padding are handled, a decode step reads the codes as the dequantizing read does, and the
bytes held drop as the bit width says."""

import pytest
import torch
from transformers import DynamicCache

from sparsegen.engine.step import DecodeStep, forward
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.kv.layer import EvictionLayer
from sparsegen.kv.quantized import HeldCodes, KVQuantization, dequantize, pack, quantize, unpack
from sparsegen.kv.rows import remove_row, stack
from sparsegen.models.compat import cache_kwargs
from tests.kv.families import FAMILIES, VOCAB, tiny_model
from tests.kv.test_exactness import CHUNKS, _padded_batch, _run_chunks


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize-dequantize each row of the last dimension, written out plainly: min-max, float16 scale and zero."""
    low = x.amin(-1, keepdim=True).half().double()
    scale = ((x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / (2 ** bits - 1)).clamp(min=1e-6).half().double()
    return ((x - low) / scale).round().clamp(0, 2 ** bits - 1) * scale + low


class FakeQuantizedCache(DynamicCache):
    """transformers' cache holding every token in full precision, handing attention the earlier calls' tokens
    fake-quantized (keys divided by each channel's largest magnitude in the layer's first call, then per token;
    values per token), except the ``residual`` newest tokens. Unpadded rows."""

    def __init__(self, bits: int, residual: int):
        super().__init__()
        self.bits, self.residual, self.channels = bits, residual, {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        channels = self.channels.setdefault(layer_idx, key_states.double().abs().amax(2, keepdim=True).clamp(min=1e-6))
        keys, values = keys.double().clone(), values.double().clone()
        held = keys.shape[2]  # the earlier calls' tokens (a sliding layer's window of them), then this call's
        for t in range(min(held - key_states.shape[2], held - self.residual)):  # earlier, not among the newest
            keys[:, :, t] = fake_quantize(keys[:, :, t] / channels[:, :, 0], self.bits) * channels[:, :, 0]
            values[:, :, t] = fake_quantize(values[:, :, t], self.bits)
        return keys.to(key_states.dtype), values.to(value_states.dtype)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_codes_round_trip_within_half_a_step(bits):
    codes = torch.randint(0, 2 ** bits, (3, 5, 64))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack(packed, bits).long(), codes)
    x = torch.randn(4, 7, 64) * torch.logspace(-2, 2, 64)  # channels of very different magnitudes
    x[0, 0] = 0  # a constant row
    packed, scale, zero = quantize(x, bits)
    assert scale.dtype == zero.dtype == torch.float16
    error = (dequantize(packed, scale, zero, bits) - x).abs()
    bound = scale.float() / 2 + (zero.float() - x.amin(-1, keepdim=True)).abs() + 1e-6 * x.abs().amax(-1, keepdim=True)
    assert bool((error <= bound).all())


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("bits,residual", [(8, 4), (4, 4), (2, 0)])
def test_full_budget_matches_the_fake_quantizing_reference(family, bits, residual):
    model = tiny_model(family, dtype=torch.float64)
    ids = torch.randint(3, VOCAB, (2, sum(CHUNKS)), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    cache = EvictionCache(model, make_policy("full"), chunk_size=8, kv_bits=KVQuantization(bits, residual))
    ours = _run_chunks(model, cache, ids, mask, CHUNKS)
    reference = _run_chunks(model, FakeQuantizedCache(bits, residual), ids, mask, CHUNKS)
    plain = _run_chunks(model, DynamicCache(), ids, mask, CHUNKS)
    assert (reference - plain).abs().max() > 1e-4  # the quantization is felt, so matching means something
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_the_residual_is_read_in_full_precision():
    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(3, VOCAB, (1, sum(CHUNKS)), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    runs = {r: _run_chunks(model, EvictionCache(model, make_policy("full"), kv_bits=KVQuantization(2, r)), ids, mask,
                           CHUNKS) for r in (0, 6)}
    reference = _run_chunks(model, FakeQuantizedCache(2, 6), ids, mask, CHUNKS)
    torch.testing.assert_close(runs[6], reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(runs[0], runs[6], atol=1e-3)
    # a residual as long as the sequence: everything read in full precision after the first call's channel scale
    whole = EvictionCache(model, make_policy("full"), kv_bits=KVQuantization(2, sum(CHUNKS)))
    torch.testing.assert_close(_run_chunks(model, whole, ids, mask, CHUNKS),
                               _run_chunks(model, DynamicCache(), ids, mask, CHUNKS), atol=1e-5, rtol=1e-5)


def test_padding_never_enters_the_residual():
    """Left-padded rows: each row's ring holds its own newest real tokens (pads share a real token's ordinal)."""
    model = tiny_model("llama")
    ids, mask = _padded_batch([21, 12], sum(CHUNKS))
    quantized = EvictionCache(model, make_policy("full"), chunk_size=8, kv_bits=KVQuantization(4, 5))
    plain = EvictionCache(model, make_policy("full"), chunk_size=8)
    _run_chunks(model, quantized, ids, mask, CHUNKS)
    _run_chunks(model, plain, ids, mask, CHUNKS)
    for layer, (q, p) in enumerate(zip(quantized.layers, plain.layers)):
        for row in range(2):
            valid = p.valid[row, 0, :p.used]
            index = p.index[row, 0, :p.used][valid]
            newest = index >= int(p.index[row, 0, :p.used][valid].max()) - 4
            expected = {int(i): p.keys[row, :, :p.used][:, valid][:, j] for j, i in enumerate(index) if newest[j]}
            assert sorted(q.ring_index[row, :5].tolist()) == sorted(expected)
            for slot, i in enumerate(q.ring_index[row, :5].tolist()):
                if layer == 0:  # (later layers' keys already differ: the layers before them read quantized K/V)
                    torch.testing.assert_close(q.ring_keys[row, :, slot], expected[i])


@pytest.mark.parametrize("policy,budget,positions", [("h2o", 10, None), ("streaming", 10, "rolling"),
                                                     ("knorm", 10, None), ("lagkv", 10, None), ("pyramid", 10, None)])
def test_every_policy_evicts_over_quantized_storage(policy, budget, positions):
    """Padded batch, chunks and decode steps: the policy's bound holds and the output stays near the unquantized
    cache's (8 bits); order policies keep exactly the tokens they keep unquantized."""
    model = tiny_model("llama")
    ids, mask = _padded_batch([21, 15], sum(CHUNKS))
    runs = {}
    for bits in (None, 8):
        cache = EvictionCache(model, make_policy(policy, budget), positions=positions, chunk_size=8, kv_bits=bits)
        runs[bits] = (_run_chunks(model, cache, ids, mask, CHUNKS), cache)
    (plain, plain_cache), (quantized, cache) = runs[None], runs[8]
    real = mask.bool()
    assert all(layer.peak_tokens <= layer.policy.budget + 8 for layer in cache.layers)
    assert (quantized - plain)[real].abs().max() < 0.05
    if policy == "streaming":
        for q, p in zip(cache.layers, plain_cache.layers):
            assert torch.equal(q.index[q.valid].sort().values, p.index[p.valid].sort().values)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_bytes_held_follow_the_bit_width(bits):
    model = tiny_model("llama")  # 2 KV heads of 8 dims, fp32
    ids = torch.randint(3, VOCAB, (1, 40))
    stats = {}
    for kv_bits in (None, KVQuantization(bits, 0)):
        cache = EvictionCache(model, make_policy("h2o", 16), chunk_size=8, kv_bits=kv_bits)
        _run_chunks(model, cache, ids, torch.ones_like(ids), [8] * 5)
        stats[kv_bits is None] = cache.stats()
    layers, heads, dim = 2, 2, 8
    assert stats[True]["kv_bytes_peak"] == layers * 24 * heads * 2 * dim * 4
    per_token = 2 * (dim * bits // 8 + 4)  # K and V codes, and each one's float16 scale and zero
    assert stats[False]["kv_bytes_peak"] == layers * 24 * heads * per_token + layers * heads * dim * 4  # + channels
    assert stats[False]["kv_bits"] == bits and stats[False]["kv_tokens_peak"] == 24


@pytest.mark.parametrize("policy,positions", [("h2o", None), ("streaming", "rolling"), ("full", None)])
def test_float16_storage_halves_the_bytes_and_keeps_the_logits_near(policy, positions):
    """``kv_bits=16``: K/V held as float16 numbers (no codes, no residual), half an fp32 cache's bytes; every path
    reads them widened (no kernel here: 8-wide heads), so outputs stay within float16's rounding of the fp32 cache's."""
    model = tiny_model("llama")  # 2 KV heads of 8 dims, fp32
    ids, mask = _padded_batch([21, 15], sum(CHUNKS))
    runs = {}
    for bits in (None, 16):
        cache = EvictionCache(model, make_policy(policy, None if policy == "full" else 10), positions=positions,
                              chunk_size=8, kv_bits=bits)
        runs[bits] = (_run_chunks(model, cache, ids, mask, CHUNKS), cache)
    (plain, plain_cache), (half, cache) = runs[None], runs[16]
    assert all(layer.keys.dtype == layer.values.dtype == torch.float16 for layer in cache.layers)
    assert (half - plain)[mask.bool()].abs().max() < 5e-3
    stats, plain_stats = cache.stats(), plain_cache.stats()
    assert stats["kv_bits"] == 16 and stats["kv_residual"] == 0
    assert 2 * stats["kv_bytes_peak"] == plain_stats["kv_bytes_peak"]
    assert KVQuantization(16).token_bytes(8) == 2 * 8 * 2 and KVQuantization(16).row_bytes(2, 8, 4) == 0


def test_stacked_rows_decode_as_alone():
    """A server's batched decode: quantized rows stacked, stepped together, written back == stepped alone."""
    model = tiny_model("qwen2")
    quantization = KVQuantization(4, 3)
    prompts = [torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (13, 20)]
    alone, rows = [], []
    for prompt in prompts:
        for target in (alone, rows):
            cache = EvictionCache(model, make_policy("h2o", 12), kv_bits=quantization)
            with torch.no_grad():
                model(prompt, **cache_kwargs(cache))
            target.append(cache)
    token = torch.tensor([[5], [7]])
    with torch.no_grad():
        expected = [model(token[i:i + 1], position_ids=torch.tensor([[p.shape[1]]]), **cache_kwargs(c)).logits
                    for i, (p, c) in enumerate(zip(prompts, alone))]
        batched = stack(model, rows, capacity=2)
        got = model(token, position_ids=torch.tensor([[13], [20]]), **cache_kwargs(batched),
                    attention_mask=torch.ones(2, 1, dtype=torch.long)).logits
    for i in range(2):
        torch.testing.assert_close(got[i:i + 1], expected[i], atol=1e-5, rtol=1e-5)
    remove_row(batched, 0, rows[0], steps=1)
    for a, b in zip(rows[0].layers, alone[0].layers):
        assert torch.equal(a.ring_index, b.ring_index) and torch.equal(a.key_channels, b.key_channels)


def test_bad_quantization_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="one of 16, 8, 4, 2"):
        EvictionCache(model, make_policy("full"), kv_bits=3)
    with pytest.raises(ValueError, match="residual"):
        KVQuantization(4, -1)


@pytest.mark.parametrize("policy", ["h2o", "streaming-h2o", "adakv"])
def test_stepwise_replay_over_quantized_storage(policy):
    """Streaming perplexity's per-token replay runs over quantized storage: each layer within its budget, the output
    near the unquantized replay's at 8 bits. (Not equal to one-token calls: the residual is per call, so a chunk's
    queries read the tokens just before the chunk from their codes, where one-token calls read some from the ring.)"""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    runs = {}
    for bits in (None, KVQuantization(8, 4)):
        cache = EvictionCache(model, make_policy(policy, 12), chunk_size=16, stepwise=True, kv_bits=bits)
        runs[bits is None] = _run_chunks(model, cache, ids, mask, [16, 16, 8])
        assert max(cache.held_tokens()) == 12
    assert (runs[True] - runs[False]).abs().max() < 0.05


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("ring", [True, False])
def test_codes_are_read_as_their_dequantized_values(bits, ring):
    """``HeldCodes``'s scores and weighted sums equal plain matmuls over the dequantized keys and values, the fresh
    slots' taken from the ring (the reference: what ``EvictionLayer.held`` decodes)."""
    _check_codes_read(bits, ring, compiled=False)


@pytest.mark.heavy
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_compiled_codes_are_read_as_their_dequantized_values(bits):
    """Compiled, the codes are unpacked inside the sums (another form than eager's): the same values."""
    _check_codes_read(bits, ring=True, compiled=True)


def _check_codes_read(bits: int, ring: bool, compiled: bool) -> None:
    generator = torch.Generator().manual_seed(bits)
    batch, heads, slots, dim, residual, queries = 2, 3, 40, 16, 5, 4
    keys, values = (torch.randn(batch, heads, slots, dim, generator=generator) for _ in range(2))
    channels = keys.abs().amax(2, keepdim=True)
    (key_codes, key_scale, key_zero), (value_codes, value_scale, value_zero) = (
        quantize(keys / channels, bits), quantize(values, bits))
    index = torch.randperm(slots, generator=generator).repeat(batch, heads, 1)  # slots out of token order
    entry = index % residual
    fresh = index >= slots - residual  # the newest tokens, each in ring entry (ordinal % residual)
    ring_keys, ring_values = (torch.randn(batch, heads, residual, dim, generator=generator) for _ in range(2))
    residual_read = (fresh, entry) if ring else (None, None)
    held = {"key": HeldCodes(key_codes, key_scale, key_zero, bits, channels, ring_keys if ring else None,
                             *residual_read),
            "value": HeldCodes(value_codes, value_scale, value_zero, bits, None, ring_values if ring else None,
                               *residual_read)}
    decoded_keys = dequantize(key_codes, key_scale, key_zero, bits) * channels
    decoded_values = dequantize(value_codes, value_scale, value_zero, bits)
    if ring:
        take = entry[..., None].expand(-1, -1, -1, dim)
        decoded_keys = torch.where(fresh[..., None], ring_keys.gather(2, take), decoded_keys)
        decoded_values = torch.where(fresh[..., None], ring_values.gather(2, take), decoded_values)
    query = torch.randn(batch, heads, queries, dim, generator=generator)
    probs = torch.softmax(torch.randn(batch, heads, queries, slots, generator=generator), -1)
    assert held["key"].shape == decoded_keys.shape

    def read(keys: HeldCodes, values: HeldCodes, query: torch.Tensor, probs: torch.Tensor):
        return keys.scores(query), values.weigh(probs)

    scores, weighted = (torch.compile(read, fullgraph=True) if compiled else read)(held["key"], held["value"], query,
                                                                                   probs)
    torch.testing.assert_close(scores, query @ decoded_keys.transpose(-1, -2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weighted, probs @ decoded_values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("policy,residual", [("h2o", 4), ("full", 4), ("window", 0)])
def test_a_decode_step_reads_the_codes_as_the_dequantizing_step_does(family, policy, residual, monkeypatch):
    """fp32 on a CPU, the fixed-shape decode step reads the held codes without decoding them (``HeldCodes``): the
    same logits, step by step (fp32 tolerance), as the step that dequantizes every held slot first."""
    model = tiny_model(family)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    read = []
    monkeypatch.setattr(HeldCodes, "scores", lambda self, queries, scores=HeldCodes.scores: (
        read.append(1), scores(self, queries))[1])

    def decode(reads_codes: bool) -> torch.Tensor:
        with monkeypatch.context() as patch:
            if not reads_codes:
                patch.setattr(EvictionLayer, "reads_codes", property(lambda self: False))
            cache = EvictionCache(model, make_policy(policy, None if policy == "full" else 10), chunk_size=8,
                                  kv_bits=KVQuantization(4, residual), expected_length=20)
            step = DecodeStep(model, compile=True)
            with torch.inference_mode():
                logits = [forward(model, cache, ids, torch.arange(6).expand(2, -1), last=True)]
                for position in range(6, 16):  # the budget (10) fills, then the step evicts
                    assert cache.fits_fixed_step()
                    logits.append(step.uncompiled(cache, logits[-1].argmax(-1), torch.full((2,), position)))
            return torch.stack(logits)

    dequantizing = decode(False)
    assert not read
    reading = decode(True)
    assert read  # (the codes were read: the step took the path under test)
    # fp32 rounding, except where the two paths' last-bit differences (1e-7) round a new token's 4-bit code the other
    # way: a code step moves the logits by ~1e-5 (seen on an AVX-512 Xeon, gemma3 under window: 1.3e-7 at step 3,
    # 1.5e-5 at step 4); the tokens picked stay the same
    assert torch.equal(reading.argmax(-1), dequantizing.argmax(-1))
    torch.testing.assert_close(reading, dequantizing, atol=1e-4, rtol=1e-4)
