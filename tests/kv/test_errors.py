import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.compat import cache_kwargs
from tests.kv.families import tiny_model


def test_rolling_needs_rope():
    model = tiny_model("opt")
    with pytest.raises(ValueError, match="learned absolute positions.*original"):
        EvictionCache(model, make_policy("streaming", 16))
    EvictionCache(model, make_policy("streaming", 16), positions="original")  # the fix the error names


def test_unsupported_architecture_lists_supported_ones():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).eval()
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama, mistral"):
        EvictionCache(model, make_policy("window", 16))


def test_unsupported_attention_backend():
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="unsupported attention backend 'flash_attention_2'.*sdpa"):
        EvictionCache(model, make_policy("window", 16))


def test_bad_positions_and_chunk():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="'original' or 'rolling'"):
        EvictionCache(model, make_policy("window", 16), positions="absolute")
    with pytest.raises(ValueError, match="chunk_size"):
        EvictionCache(model, make_policy("window", 16), chunk_size=0)


def test_custom_4d_mask_is_refused():
    model = tiny_model("llama")
    cache = EvictionCache(model, make_policy("window", 16))
    with pytest.raises(ValueError, match="4D"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 1, 4, 4),
              **cache_kwargs(cache))


def test_other_caches_keep_transformers_behaviour():
    """A prepared model gives bit-identical results with its own caches."""
    plain = tiny_model("llama")
    prepared = tiny_model("llama")
    EvictionCache(prepared, make_policy("window", 16))
    ids = torch.randint(3, 90, (2, 12))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, prepared(ids).logits)
        assert torch.equal(plain.generate(ids, max_new_tokens=5, do_sample=False),
                           prepared.generate(ids, max_new_tokens=5, do_sample=False))


def test_release_leaves_no_trace_and_the_cache_prepares_again():
    from sparsegen.kv import release

    model = tiny_model("llama")
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    before = model(ids).logits
    EvictionCache(model, make_policy("window", 8))
    decoder = model.get_decoder()
    assert model.config._attn_implementation.startswith("sparsegen_") and decoder._forward_pre_hooks
    assert all("forward" in vars(layer) for layer in decoder.layers)  # (routed: ``sparsegen.kv.regions``)
    release(model)
    assert model.config._attn_implementation in ("sdpa", "eager")
    assert not decoder._forward_pre_hooks and not decoder._forward_hooks
    assert not any("forward" in vars(layer) for layer in decoder.layers)
    assert torch.equal(model(ids).logits, before)
    cache = EvictionCache(model, make_policy("window", 8))
    model(ids, **cache_kwargs(cache))
    assert max(cache.held_tokens()) == 8


@pytest.mark.heavy
def test_patched_installs_for_the_block_and_leaves_the_model_as_it_came():
    import subprocess
    import sys

    from sparsegen import patched

    model = tiny_model("llama")
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    config_before, before = model.config._attn_implementation, model(ids).logits
    with patched(model):
        with patched(model):  # nested: the inner block does not undo the outer's
            pass
        cache = EvictionCache(model, make_policy("window", 8))
        model(ids, **cache_kwargs(cache))
        assert max(cache.held_tokens()) == 8 and model.config._attn_implementation.startswith("sparsegen_")
    decoder = model.get_decoder()
    assert model.config._attn_implementation == config_before
    assert not decoder._forward_pre_hooks and not decoder._forward_hooks
    assert torch.equal(model(ids).logits, before)
    # importing sparsegen registers nothing in transformers: only a first cache (or patched) does
    code = ("from transformers import AttentionInterface; import sparsegen, sparsegen.kv; "
            "print(any(k.startswith('sparsegen') for k in AttentionInterface._global_mapping))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_rolling_positions_under_autograd():
    """A forward with gradients on (a user's own model call, or prompt tuning) through a rolling cache: the in-place
    rotation used to refuse it ("functions with out=... arguments don't support automatic differentiation")."""
    model = tiny_model("llama")
    ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = EvictionCache(model, make_policy("streaming", 8))
    logits = model(ids, **cache_kwargs(cache)).logits
    logits.sum().backward()
    assert model.lm_head.weight.grad is not None and max(cache.held_tokens()) == 8
    quantized = EvictionCache(model, make_policy("h2o", 8), kv_bits=4)  # a forward with autograd on (no backward:
    assert torch.isfinite(model(ids, **cache_kwargs(quantized)).logits).all()  # rounding has no gradient anyway)
    with torch.no_grad():
        again = EvictionCache(model, make_policy("streaming", 8))
        assert torch.allclose(model(ids, **cache_kwargs(again)).logits, logits, atol=1e-6)
