import math

import torch
from transformers import LlamaForCausalLM

from sparsegen.bench.roofline import decode_bytes, measure_bandwidth, roofline_tokens_per_s, weight_bytes_per_step
from tests.conftest import tiny_llama_config


def _tiny_llama_matrix_params(vocab: int) -> tuple[int, int]:
    """(per-step parameters without embeddings, embedding parameters) of tests.conftest's tiny Llama, by hand."""
    hidden, inter, layers, head_dim, kv_heads = 32, 64, 2, 8, 2
    attention = hidden * hidden * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    mlp = 3 * hidden * inter
    norms = 2 * hidden
    body = layers * (attention + mlp + norms) + hidden  # + final norm
    return body, vocab * hidden


def test_weight_bytes_skip_lookup_tables_but_not_a_tied_output():
    vocab = 100
    body, embedding = _tiny_llama_matrix_params(vocab)
    untied = LlamaForCausalLM(tiny_llama_config(vocab))
    assert weight_bytes_per_step(untied) == 4 * (body + embedding)  # lm_head read whole; embed_tokens looked up
    tied = LlamaForCausalLM(tiny_llama_config(vocab, tie_word_embeddings=True))
    assert weight_bytes_per_step(tied) == 4 * (body + embedding)  # the shared table, read once as lm_head
    assert weight_bytes_per_step(untied.to(torch.bfloat16)) == 2 * (body + embedding)
    # packed quantized weights are buffers: read every step like parameters (rotary tables, not saved, are not)
    untied.model.layers[0].mlp.down_proj.register_buffer("weight_packed", torch.zeros(64, 4, dtype=torch.int32))
    assert weight_bytes_per_step(untied) == 2 * (body + embedding) + 64 * 4 * 4  # (bfloat16 since the line above)


def test_decode_bytes_and_bound():
    # Llama-3.2-1B in bf16: 32 KiB of KV per token; 2,048 held tokens for each of 8 sequences
    step = decode_bytes(weight_bytes=2_471_628_800, kv_tokens=2048, kv_bytes_per_token=32768, batch=8)
    assert step == 2_471_628_800 + 8 * 2048 * 32768
    assert math.isclose(roofline_tokens_per_s(3.35e12, step, batch=8), 8 * 3.35e12 / step)


def test_bandwidth_counts_read_and_write_of_the_fastest_copy(monkeypatch):
    import sparsegen.bench.roofline as roofline

    clock = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.4])  # copies of 0.5 s, 0.25 s and 0.4 s
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(clock))
    assert measure_bandwidth("cpu", megabytes=4, repeats=3) == 2 * 4 * 2**20 / 0.25
