import pytest
import torch

import sparsegen.kv.attention as attention
from sparsegen.decoding import DecodeStep, prefill
from sparsegen.kv import EvictionCache, make_policy
from tests.kv.families import VOCAB, tiny_model


def _kept_and_logits(model, policy: str, ids: torch.Tensor, mask: torch.Tensor):
    """Each layer's kept token positions after a one-pass prefill (a long call, compressed once), then the logits of
    the prefill and of three decode steps."""
    cache = EvictionCache(model, make_policy(policy, 24))
    logits = [prefill(model, cache, ids, mask, chunk_size=ids.shape[1])]
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


def test_which_queries_a_policy_reads():
    assert attention.observed_queries(make_policy("snapkv", 128), 4096) == 32
    assert attention.observed_queries(make_policy("tova", 128), 4096) == 1
    assert attention.observed_queries(make_policy("snapkv", 128), 40) is None  # too short a call to gain
    assert attention.observed_queries(make_policy("h2o", 128), 4096) is None  # sums every query's attention
    assert attention.observed_queries(make_policy("pyramid", 128), 4096) is None  # H2O's rule, per layer
    assert attention.observed_queries(make_policy("streaming", 128), 4096) is None  # reads no attention
