"""``sparsegen::decode_attention`` (the decode step's attention on a CPU) against its reference: the grouped matmuls and
softmax of ``_grouped_attention``, op by op and through whole decode steps of every kind of policy."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from sparsegen.engine.prefill import prefill
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, make_policy, native_attention
from tests.kv.families import VOCAB

pytestmark = pytest.mark.skipif(not native_attention.ready(), reason="sparsegen's C++ kernels could not be built")


def reference(query, key, value, incoming, mask, sink_query, sink_slot, scaling):
    """What ``_grouped_attention`` computes for a few queries a row: fp32 scores, -inf where hidden, softmax,
    weighted values; the sinks' slots scored with ``sink_query``."""
    batch, q_heads, q, dim = query.shape
    heads = key.shape[1]
    if incoming is not None:
        key, value = torch.cat((key, incoming[0]), 2), torch.cat((value, incoming[1]), 2)
    scores = query.view(batch, heads, -1, q, dim) @ key[:, :, None].transpose(-1, -2) * scaling
    if sink_query is not None:
        sink_scores = sink_query.view(batch, heads, -1, q, dim) @ key[:, :, None].transpose(-1, -2) * scaling
        scores = torch.where(sink_slot[:, :, None], sink_scores, scores)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], -torch.inf)
    probs = scores.softmax(-1)
    return (probs @ value[:, :, None]).view(batch, q_heads, q, -1), probs


def _case(batch, heads, group, slots, dim, seed=0, queries=1):
    generator = torch.Generator().manual_seed(seed)
    storage = torch.randn(batch, heads, slots + 5, dim, generator=generator)  # (held slots: a slice, as the cache's)
    values = torch.randn(batch, heads, slots + 5, dim, generator=generator)
    query = torch.randn(batch, heads * group, queries, dim, generator=generator) * 2
    incoming = (torch.randn(batch, heads, queries, dim, generator=generator),
                torch.randn(batch, heads, queries, dim, generator=generator))
    return storage[:, :, :slots], values[:, :, :slots], query, incoming, generator


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("dim,slots", [(64, 700), (256, 260), (24, 37), (64, 3)])
def test_the_kernel_is_the_grouped_matmuls(group, dim, slots):
    """AVX2 (head widths of 64 and 256: every group size's register blocking) and the portable path (24), with and
    without the step's own token beside the held slots, masks per row or per head, and the sinks' own frame."""
    key, value, query, incoming, generator = _case(2, 2, group, slots, dim)
    total = slots + 1
    row_mask = torch.rand(2, 1, 1, total, generator=generator) > 0.3
    row_mask[..., -1] = True
    head_mask = torch.rand(2, 2, 1, total, generator=generator) > 0.5
    head_mask[..., 0] = True
    span_mask = torch.zeros(2, 1, 1, total, dtype=torch.bool)  # (chunks hidden whole, at their start, at their end)
    span_mask[..., 300:520] = True
    span_mask[1, ..., 130:140] = True
    span_mask[..., -1] = True
    sink_query = torch.randn(query.shape, generator=generator)
    sink_slot = torch.zeros(2, 1, 1, total, dtype=torch.bool)
    sink_slot[..., :4] = True
    for step_token, mask, sinks in [(incoming, None, False), (incoming, row_mask, False),
                                    (incoming, row_mask, True), (incoming, head_mask, True),
                                    (incoming, span_mask, True), (incoming, span_mask, False), (None, None, False),
                                    (None, head_mask[..., 1:], False)]:
        args = (query, key, value, step_token, mask, sink_query if sinks else None, sink_slot if sinks else None)
        if step_token is None and sinks:
            continue
        out, probs = native_attention.decode_attention(*args, scaling=0.125, probs=True)
        expected_out, expected_probs = reference(*args, 0.125)
        torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-6, equal_nan=True)
        alone, none = native_attention.decode_attention(*args, scaling=0.125, probs=False)
        assert none is None and torch.allclose(alone, out, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("queries", [2, 5, 17])
@pytest.mark.parametrize("group,dim,slots", [(3, 64, 700), (4, 64, 37), (2, 24, 50)])
def test_a_few_queries_a_row_are_the_grouped_matmuls(queries, group, dim, slots):
    """A speculative verification's queries (the pending token and the drafts), each with its own mask row (causal
    among the new tokens, rows of different lengths, a head's own slots), the new tokens held or beside the held
    slots: what the grouped matmuls compute, AVX2 (64) and portable (24)."""
    key, value, query, incoming, generator = _case(2, 2, group, slots, dim, queries=queries)
    held = torch.rand(2, 1, 1, slots, generator=generator) > 0.3
    causal = torch.ones(queries, queries, dtype=torch.bool).tril()
    beside = torch.cat((held.expand(2, 1, queries, slots), causal.expand(2, 1, queries, queries)), -1)
    beside[1, :, :, slots - 20:slots] = False  # (a shorter row)
    per_head = beside.repeat(1, 2, 1, 1)
    per_head[:, 1, :, :10] = False
    seen = torch.cat((torch.ones(queries, slots, dtype=torch.bool), causal), -1)  # (one mask for all rows)
    written = torch.cat((key, incoming[0]), 2), torch.cat((value, incoming[1]), 2)  # (the new tokens held)
    sink_query = torch.randn(query.shape, generator=generator)
    sink_slot = torch.zeros(2, 1, 1, slots + queries, dtype=torch.bool)
    sink_slot[..., :4] = True
    for kv, step_tokens, mask, sinks in [((key, value), incoming, beside, False), (written, None, beside, False),
                                         ((key, value), incoming, per_head, True), (written, None, None, False),
                                         (written, None, seen[None, None], False)]:
        args = (query, *kv, step_tokens, mask, sink_query if sinks else None, sink_slot if sinks else None)
        out, probs = native_attention.decode_attention(*args, scaling=0.125, probs=True)
        expected = mask if mask is None else mask.expand(2, -1, -1, -1)
        expected_out, expected_probs = reference(*args[:4], expected, *args[5:], 0.125)
        torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dim", [64, 24])
def test_float16_keys_and_values_are_read_as_their_values(dim):
    """K/V held in float16 (``kv_bits=16``), on the AVX2 path (64) and the portable one (24): exactly what the fp32
    kernel and the reference compute over the same numbers widened."""
    key, value, query, incoming, generator = _case(2, 2, 3, 300, dim)
    key, value, incoming = key.half(), value.half(), tuple(x.half() for x in incoming)
    mask = torch.rand(2, 2, 1, 301, generator=generator) > 0.4
    widened = (key.float(), value.float(), tuple(x.float() for x in incoming))
    half_out, half_probs = native_attention.decode_attention(query, key, value, incoming, mask, None, None, 0.125, True)
    out, probs = native_attention.decode_attention(query, *widened, mask, None, None, 0.125, True)
    assert torch.equal(half_out, out) and torch.equal(half_probs, probs)
    expected_out, expected_probs = reference(query, *widened, mask, None, None, 0.125)
    torch.testing.assert_close(half_out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(half_probs, expected_probs, rtol=1e-5, atol=1e-6)
    # the step's own token, given in fp32, is read as it will be held: rounded to float16
    unrounded = tuple(x.float() + 1e-4 for x in incoming)
    rounded = tuple(x.half().float() for x in unrounded)
    assert torch.equal(native_attention.decode_attention(query, key, value, unrounded, mask, None, None, 0.1, False)[0],
                       native_attention.decode_attention(query, *widened[:2], rounded, mask, None, None, 0.1, False)[0])


def test_a_row_that_sees_nothing_is_nan_as_softmax_makes_it():
    key, value, query, _, _ = _case(1, 1, 3, 40, 64)
    hidden = torch.zeros(1, 1, 1, 40, dtype=torch.bool)
    out, probs = native_attention.decode_attention(query, key, value, None, hidden, None, None, 0.1, True)
    expected_out, expected_probs = reference(query, key, value, None, hidden, None, None, 0.1)
    assert out.isnan().all() and probs.isnan().all() and expected_out.isnan().all() and expected_probs.isnan().all()


def test_bad_operands_are_refused_with_what_is_expected():
    key, value, query, incoming, _ = _case(1, 2, 2, 16, 64)
    op = torch.ops.sparsegen.decode_attention
    grouped = query.view(1, 2, 2, 64)
    with pytest.raises(RuntimeError, match="keys and values must be float32 or float16, got Double"):
        op(grouped, None, key.double(), value, None, None, None, None, 0.1, False)
    with pytest.raises(RuntimeError, match=r"value must be Half \(as key\) \[1, 2, slots, 64\]"):
        op(grouped, None, key.half(), value, None, None, None, None, 0.1, False)
    with pytest.raises(RuntimeError, match=r"visible must be bool \[1, 1 or 2, \(queries, dividing 2,\) 17\]"):
        op(grouped, None, key, value, *incoming, torch.ones(1, 1, 16, dtype=torch.bool), None, 0.1, False)
    with pytest.raises(RuntimeError, match=r"visible must be bool \[1, 1 or 2, \(queries, dividing 2,\) 17\]"):
        op(grouped, None, key, value, *incoming, torch.ones(1, 1, 3, 17, dtype=torch.bool), None, 0.1, False)
    with pytest.raises(RuntimeError, match="2 new keys but 1 new values"):
        op(grouped, None, key, value, torch.cat([incoming[0]] * 2, 2), incoming[1], None, None, 0.1, False)
    with pytest.raises(RuntimeError, match="sink and sink_query come together"):
        op(grouped, grouped, key, value, None, None, None, None, 0.1, False)


@pytest.mark.heavy
def test_the_portable_path_is_the_reference_too():
    """The path a CPU without AVX2 takes, forced by ``SPARSEGEN_KERNELS=scalar``, in a process of its own."""
    script = """
import torch
from tests.kv.test_native_attention import _case, reference
from sparsegen.kv import native_attention
native_attention.ready()
key, value, query, incoming, _ = _case(2, 3, 3, 600, 64)
out, probs = native_attention.decode_attention(query, key, value, incoming, None, None, None, 0.125, True)
expected_out, expected_probs = reference(query, key, value, incoming, None, None, None, 0.125)
print(float((out - expected_out).abs().max()) < 1e-5, float((probs - expected_probs).abs().max()) < 1e-6)
half = native_attention.decode_attention(query, key.half(), value.half(), incoming, None, None, None, 0.125, False)[0]
widened = reference(query, key.half().float(), value.half().float(), tuple(x.half().float() for x in incoming), None,
                    None, None, 0.125)[0]
print(float((half - widened).abs().max()) < 1e-5)
"""
    env = {**os.environ, "SPARSEGEN_KERNELS": "scalar"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["True", "True", "True"], out


def _model(family: str):
    """A tiny model with 64-wide heads, three query heads a KV head (the kernel's AVX2 path, as SmolLM2's)."""
    shape = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=512, pad_token_id=0)
    torch.manual_seed(0)
    if family == "gemma3":  # a sliding-window layer (window 6) and a global one
        config = Gemma3TextConfig(**shape, sliding_window=6, query_pre_attn_scalar=64,
                                  layer_types=["sliding_attention", "full_attention"])
        return Gemma3ForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    return LlamaForCausalLM._from_config(LlamaConfig(**shape), attn_implementation="sdpa").eval()


@pytest.mark.parametrize("name,family,kv_bits", [
    ("full", "llama", None), ("streaming", "llama", None), ("h2o", "llama", None), ("tova", "llama", None),
    ("knorm", "llama", None), ("h2o", "gemma3", None),
    ("full", "llama", 16), ("streaming", "llama", 16), ("knorm", "llama", 16), ("h2o", "gemma3", 16)])
def test_decode_steps_through_the_kernel_keep_what_the_matmuls_keep(name, family, kv_bits):
    """Prefill, then eager and fixed-shape decode steps past the budget, rows padded: the same logits and the same
    kept tokens with the kernel as with the grouped matmuls (rolling positions' sinks for streaming, H2O's observed
    probabilities, Gemma 3's window), K/V held as the model computes them or in float16."""
    model = _model(family)
    ids = torch.randint(3, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # (a left-padded row)
    results = []
    for native in (True, False):
        cache = EvictionCache(model, make_policy(name, None if name == "full" else 12), chunk_size=8,
                              expected_length=40, kv_bits=kv_bits)
        cache.native_decode = native
        step = DecodeStep(model, compile=True)
        logits = []
        with torch.inference_mode():
            token = prefill(model, cache, ids, mask, 8).argmax(-1)
            position = mask.sum(-1)
            for index in range(12):  # eager steps, then fixed-shape ones (what the compiled step traces)
                run = step.eager if index < 6 else step.uncompiled
                logits.append(run(cache, token, position))
                token, position = logits[-1].argmax(-1), position + 1
        assert all(layer.keys.dtype == (torch.float32 if kv_bits is None else torch.float16) for layer in cache.layers)
        results.append((torch.stack(logits), [(layer.index.clone(), layer.valid.clone()) for layer in cache.layers]))
    (ours, our_layers), (theirs, their_layers) = results
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for (index, valid), (their_index, their_valid) in zip(our_layers, their_layers):
        assert torch.equal(valid, their_valid) and torch.equal(index[valid], their_index[their_valid])
