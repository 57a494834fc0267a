import pytest
import torch

import sparsegen
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.compat import cache_kwargs


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_checkpoint):
    return sparsegen.load(tiny_checkpoint)


PROMPTS = ["it was the best of times, it was the worst", "it was the age", "the season of Light, it was"]


def test_full_policy_equals_transformers_generate(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    ours = sparsegen.generate(model, tokenizer, PROMPTS, max_new_tokens=10, stop_at_eos=False, chunk_size=4)
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    theirs = model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    expected = tokenizer.batch_decode(theirs[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    assert ours.texts == expected
    assert ours.new_tokens == [10, 10, 10]


def test_policy_equals_transformers_generate_with_our_cache(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    policy = dict(policy="h2o", budget=6)
    ours = sparsegen.generate(model, tokenizer, PROMPTS, max_new_tokens=12, stop_at_eos=False, chunk_size=64, **policy)
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    cache = EvictionCache(model, make_policy("h2o", 6))
    theirs = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                            **cache_kwargs(cache))
    assert ours.texts == tokenizer.batch_decode(theirs[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    assert cache.stats()["kv_tokens"] == 6
    assert ours.cache["kv_tokens"] == 6


def test_sampling_is_seeded(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    run = lambda seed: sparsegen.generate(model, tokenizer, PROMPTS[0], max_new_tokens=15, temperature=1.0,  # noqa: E731
                                          top_p=0.9, seed=seed, stop_at_eos=False).text
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_fractional_budget_and_stats(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    result = sparsegen.generate(model, tokenizer, PROMPTS[0] * 4, policy="streaming", budget="0.25",
                                max_new_tokens=5, chunk_size=8, stop_at_eos=False)
    prompt = result.prompt_tokens[0]
    budget = round(0.25 * prompt)
    assert result.cache["budget"] == budget
    assert result.cache["kv_tokens"] == budget
    assert result.cache["kv_tokens_peak"] <= budget + 8
    out = result.to_dict()
    assert {"text", "new_tokens", "kv_tokens_peak", "kv_bytes_peak", "seconds"} <= set(out)


@pytest.mark.parametrize("bad, message", [
    (dict(policy="h2o", budget=0), "positive"),
    (dict(policy="window", budget="1.5"), r"\(0, 1\]"),
    (dict(policy="lru", budget=8), "unknown policy"),
    (dict(policy="window"), "needs a budget"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_input(model_and_tokenizer, bad, message):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match=message):
        sparsegen.generate(model, tokenizer, "it was", **bad)


def test_transformers_chunked_prefill_stays_within_budget_plus_chunk(model_and_tokenizer):
    """model.generate(prefill_chunk_size=...) with our cache ingests a long prompt at bounded memory, and gives
    what sparsegen.generate gives with the same chunks."""
    model, tokenizer = model_and_tokenizer
    prompt = " ".join(PROMPTS) * 6
    cache = EvictionCache(model, make_policy("h2o", 16), chunk_size=32)
    enc = tokenizer(prompt, return_tensors="pt")
    theirs = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                            **cache_kwargs(cache), prefill_chunk_size=32)
    assert enc.input_ids.shape[1] > 100
    assert cache.stats()["kv_tokens_peak"] <= 16 + 32
    ours = sparsegen.generate(model, tokenizer, prompt, policy="h2o", budget=16, chunk_size=32, max_new_tokens=8,
                              stop_at_eos=False)
    assert ours.text == tokenizer.decode(theirs[0, enc.input_ids.shape[1]:], skip_special_tokens=True)


def test_a_context_and_a_question_follow_kvpress_protocol(model_and_tokenizer):
    """The context in one pass, compressed once to the budget (a fraction is of the context), then the question:
    with the full cache, the answer of the prompt they make; under a budget, the cache held the whole context once."""
    model, tokenizer = model_and_tokenizer
    context, question = " ".join(PROMPTS * 6), " it was the season of"
    full = sparsegen.generate(model, tokenizer, context=context, question=question, max_new_tokens=8,
                              stop_at_eos=False, chunk_size=8)
    ids = tokenizer(context)["input_ids"] + tokenizer(question, add_special_tokens=False)["input_ids"]
    expected = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)
    assert full.texts == [tokenizer.decode(expected[0, len(ids):], skip_special_tokens=True)]
    squeezed = sparsegen.generate(model, tokenizer, context=context, question=question, policy="snapkv", budget=0.25,
                                  max_new_tokens=4, chunk_size=8)
    streamed = sparsegen.generate(model, tokenizer, context + question, policy="snapkv", budget=0.25,
                                  max_new_tokens=4, chunk_size=8)
    context_tokens = len(tokenizer(context)["input_ids"])
    assert squeezed.cache["kv_tokens_peak"] >= context_tokens > 2 * streamed.cache["kv_tokens_peak"]
    with pytest.raises(ValueError, match="not both"):
        sparsegen.generate(model, tokenizer, "a prompt", context=context, question=question)
    with pytest.raises(ValueError, match="not both"):
        sparsegen.generate(model, tokenizer, context=context)
