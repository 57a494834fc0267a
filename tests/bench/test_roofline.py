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


def test_decode_bytes_and_bound():
    # Llama-3.2-1B in bf16: 32 KiB of KV per token; 2,048 held tokens for each of 8 sequences
    step = decode_bytes(weight_bytes=2_471_628_800, kv_tokens=2048, kv_bytes_per_token=32768, batch=8)
    assert step == 2_471_628_800 + 8 * 2048 * 32768
    assert math.isclose(roofline_tokens_per_s(3.35e12, step, batch=8), 8 * 3.35e12 / step)


def test_bandwidth_is_a_plausible_number():
    bandwidth = measure_bandwidth("cpu", megabytes=16, repeats=2)
    assert 1e8 < bandwidth < 1e13
