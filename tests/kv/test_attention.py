import pytest
import torch

import sparsegen.kv.attention as attention
from sparsegen.engine.prefill import prefill
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, make_policy
from tests.kv.families import VOCAB, tiny_model


def _kept_and_logits(model, policy: str, ids: torch.Tensor, mask: torch.Tensor, chunk_size: int | None = None,
                     budget: int | None = 24, positions: str | None = None):
    """Each layer's kept token positions after a prefill (by default in one pass: a long call, compressed once), then
    the logits of the prefill and of three decode steps."""
    cache = EvictionCache(model, make_policy(policy, budget), positions)
    logits = [prefill(model, cache, ids, mask, chunk_size=chunk_size or ids.shape[1])]
    kept = [layer.index.masked_fill(~layer.valid, -1).sort(-1).values for layer in cache.layers]
    step, position = DecodeStep(model), mask.sum(-1)
    for _ in range(3):
        logits.append(step(cache, logits[-1].argmax(-1), position))
        position = position + 1
    return kept, torch.stack(logits)


@pytest.mark.parametrize("policy", ["snapkv", "tova"])
def test_a_long_call_scores_only_the_queries_its_policy_reads_and_keeps_what_scoring_all_keeps(policy, monkeypatch):
    """SnapKV's window, TOVA's last query: a long call's attention runs through SDPA and only those queries'
    probabilities are computed; the kept tokens are those of the reference (every query's probabilities by grouped
    matmuls), in a left-padded batch too."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (2, 120), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0  # the second row left-padded
    calls = []
    fast = attention._attention_observing_last
    monkeypatch.setattr(attention, "_attention_observing_last", lambda *a, **k: calls.append(1) or fast(*a, **k))
    kept, logits = _kept_and_logits(model, policy, ids, mask)
    assert calls  # the long call took the new path
    monkeypatch.setattr(attention, "observed_queries", lambda policy, q: None)
    calls.clear()
    kept_ref, logits_ref = _kept_and_logits(model, policy, ids, mask)
    assert not calls
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_ref))
    torch.testing.assert_close(logits, logits_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family,policy,budget,positions", [
    ("llama", "full", None, None), ("llama", "snapkv", 24, None), ("qwen2", "h2o", 24, None),
    ("llama", "streaming", 200, "rolling"), ("gemma3", "full", None, None), ("gpt_neox", "tova", 24, "rolling"),
    ("llama", "window", 24, None), ("qwen2", "streaming", 40, "original"), ("gemma3", "streaming", 24, "original")])
@pytest.mark.parametrize("padded", [False, True])
def test_a_first_pass_builds_no_mask_and_keeps_what_the_mask_keeps(family, policy, budget, positions, padded,
                                                                   monkeypatch):
    """An empty cache's one-pass prompt, every token real, builds no [q, q] mask: plain causal attention goes to
    SDPA's ``is_causal`` (through SDPA, SnapKV's observed window, H2O's grouped sums, rolling positions, Gemma 3's
    global layer), and an order policy's or a sliding-window layer's band (a window, sinks and recent tokens, Gemma 3's
    sliding layers) a block of queries at a time over the keys it sees; a padded batch keeps its mask. Either way:
    the kept tokens and logits of the mask."""
    model = tiny_model(family)
    ids = torch.randint(3, VOCAB, (2, 120), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :30] = 0
    monkeypatch.setattr(attention, "QUERY_BLOCK", 32)  # bands a block of queries at a time: several blocks
    bands = []
    decide = attention._first_pass_band
    monkeypatch.setattr(attention, "_first_pass_band", lambda *a: bands.append(decide(*a)) or bands[-1])
    kept, logits = _kept_and_logits(model, policy, ids, mask, budget=budget, positions=positions)
    assert any(bands) != padded
    if not padded and (policy in ("window", "streaming") and budget < 100 or family == "gemma3"):
        assert any(band is not None and band[1] < 119 for band in bands)  # a band narrower than the pass
    monkeypatch.setattr(attention, "_first_pass_band", lambda *a: None)
    kept_ref, logits_ref = _kept_and_logits(model, policy, ids, mask, budget=budget, positions=positions)
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_ref))
    torch.testing.assert_close(logits, logits_ref, atol=1e-5, rtol=1e-5)


def test_which_queries_a_policy_reads():
    assert attention.observed_queries(make_policy("snapkv", 128), 4096) == 32
    assert attention.observed_queries(make_policy("tova", 128), 4096) == 1
    assert attention.observed_queries(make_policy("snapkv", 128), 40) is None  # too short a call to gain
    assert attention.observed_queries(make_policy("h2o", 128), 4096) is None  # sums every query's attention
    assert attention.observed_queries(make_policy("pyramid", 128), 4096) is None  # H2O's rule, per layer
    assert attention.observed_queries(make_policy("streaming", 128), 4096) is None  # reads no attention


@pytest.mark.parametrize("chunk_size", [None, 50])
@pytest.mark.parametrize("family,policy", [("llama", "h2o"), ("llama", "scissorhands"), ("gemma3", "h2o"),
                                           ("qwen3", "pyramid")])
def test_a_long_call_attends_a_block_of_queries_at_a_time_and_keeps_what_one_pass_keeps(family, policy, chunk_size,
                                                                                       monkeypatch):
    """H2O's sums and Scissorhands' votes over a
    long call (the whole prompt, or a chunk after held tokens), its queries taken a block at a time over the keys
    each block can see: the kept tokens and logits of one pass over every query, in a left-padded batch too, and on
    Gemma 3's sliding-window layers (whose masks hide the keys behind each query's window)."""
    model = tiny_model(family)
    ids = torch.randint(3, VOCAB, (2, 120), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    blocks = []
    blocked = attention._attention_by_query_blocks
    monkeypatch.setattr(attention, "_attention_by_query_blocks", lambda *a, **k: blocks.append(1) or blocked(*a, **k))
    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    kept, logits = _kept_and_logits(model, policy, ids, mask, chunk_size)
    assert blocks
    monkeypatch.setattr(attention, "QUERY_BLOCK", 1 << 20)
    blocks.clear()
    kept_ref, logits_ref = _kept_and_logits(model, policy, ids, mask, chunk_size)
    assert not blocks
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_ref))
    torch.testing.assert_close(logits, logits_ref, atol=1e-5, rtol=1e-5)
