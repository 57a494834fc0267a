"""``PolicySpec``: one value for a cache's settings, checked when made, equal to the flat form it replaces."""

import pytest

import sparsegen
from sparsegen.kv import KVQuantization, PolicySpec, make_policy
from tests.kv.families import tiny_model


@pytest.mark.parametrize("text, expected", [
    ("full", PolicySpec()),
    ("h2o:0.2", PolicySpec("h2o", 0.2)),
    ("streaming:1024+kv4", PolicySpec("streaming", 1024, kv_bits=4)),
    ("full+kv16", PolicySpec("full", kv_bits=KVQuantization(16))),
])
def test_parse_reads_the_written_form(text, expected):
    spec = PolicySpec.parse(text)
    assert spec == expected
    assert PolicySpec.parse(str(spec)) == spec


def test_settings_are_normalized_so_equal_settings_compare_equal():
    assert PolicySpec("h2o", "0.2", {"recent": None}) == PolicySpec("h2o", 0.2)
    assert PolicySpec("h2o", "64").budget == 64
    assert PolicySpec.of("h2o", 64, heavy=32, kv_bits=4) == PolicySpec("h2o", 64, {"heavy": 32}, None,
                                                                        KVQuantization(4))
    assert PolicySpec.sharing("full", 1024) == PolicySpec()
    assert PolicySpec.sharing("window", 1024).budget == 1024


@pytest.mark.parametrize("make, message", [
    (lambda: PolicySpec("lru", 8), "unknown policy"),
    (lambda: PolicySpec("full", 8), "takes no budget"),
    (lambda: PolicySpec("window"), "needs a budget"),
    (lambda: PolicySpec("window", "1.5"), r"\(0, 1\]"),
    (lambda: PolicySpec("h2o", 0), "positive"),
    (lambda: PolicySpec.of("window", 8, heavy=2), "takes no --heavy"),
    (lambda: PolicySpec.of("streaming", 4, sinks=4), "smaller than the budget"),
    (lambda: PolicySpec.of("h2o", 8, recent=9), "between 0 and the budget"),
    (lambda: PolicySpec("h2o", 8, positions="absolute"), "original, rolling"),
    (lambda: PolicySpec("h2o", 8, kv_bits=3), "kv_bits must be one of"),
    (lambda: PolicySpec(make_policy("h2o", 8), 8), "carries its own budget"),
    (lambda: PolicySpec.parse("h2o:8+kv4", kv_bits=4), "drop kv_bits"),
    (lambda: PolicySpec.parse(" "), "NAME"),
])
def test_bad_settings_fail_when_made_naming_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_fraction_is_resolved_against_the_input_and_checked_then():
    spec = PolicySpec.of("streaming", 0.5, sinks=4)
    assert spec.build(100).budget == 50 and spec.build(100).sinks == 4
    resolved = PolicySpec.of("streaming", 0.5, positions="original", kv_bits=4).resolved(100)
    assert resolved.build() is resolved.policy and resolved.policy.budget == 50 and resolved.bounded
    assert (resolved.positions, resolved.kv_bits) == ("original", KVQuantization(4))
    with pytest.raises(ValueError, match="smaller than the budget"):
        spec.build(8)  # 4 tokens: all sinks
    with pytest.raises(ValueError, match="needs the input length"):
        spec.build()


def test_the_cache_it_makes_is_the_flat_forms():
    model = tiny_model("llama")
    spec = PolicySpec("streaming", 16, {"sinks": 2}, positions="original", kv_bits=4)
    cache = spec.cache(model, chunk_size=8)
    assert (cache.policy.budget, cache.policy.sinks, cache.positions, cache.quantization.bits) == (16, 2, "original", 4)


def test_the_api_takes_it_in_place_of_flat_keywords(tiny_checkpoint):
    """``generate(policy=PolicySpec(...))`` is ``generate(policy=name, budget=...)`` with the options; the flat
    option keywords are gone (a TypeError, not silently ignored)."""
    model, tokenizer = sparsegen.load(tiny_checkpoint)
    common = dict(max_new_tokens=8, stop_at_eos=False)
    named = sparsegen.generate(model, tokenizer, "It was a bright cold day", "h2o", 12, **common)
    spec = sparsegen.generate(model, tokenizer, "It was a bright cold day", PolicySpec("h2o", 12), **common)
    assert named.texts == spec.texts and named.cache["kv_tokens"] == spec.cache["kv_tokens"] == 12
    quantized = sparsegen.generate(model, tokenizer, "It was a bright cold day", PolicySpec("h2o", 12, kv_bits=4),
                                   **common)
    assert quantized.cache["kv_bits"] == 4
    with pytest.raises(ValueError, match="carries the budget"):
        sparsegen.generate(model, tokenizer, "It was", PolicySpec("h2o", 12), 12)
    with pytest.raises(TypeError):
        sparsegen.generate(model, tokenizer, "It was", "h2o", 12, sinks=2)
