"""kvzap: a scorer fit to KVzip's reconstruction scores, then a policy that keeps tokens by its prediction."""

import pytest
import torch
from transformers import DynamicCache

from sparsegen.cli import main
from sparsegen.engine.prefill import prefill
from sparsegen.engine.scorer import KEEP, fit_scorer, save_scorer
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.kv.policies.kvzap import token_features
from sparsegen.models.compat import cache_kwargs
from tests.kv.families import VOCAB, tiny_model

BUDGET, CHUNK = 12, 16


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    model = tiny_model("llama")
    windows = torch.randint(3, VOCAB, (5, 48), generator=torch.Generator().manual_seed(0))
    weights, report = fit_scorer(model, windows[:4], windows[4:], chunk_size=CHUNK, progress=False)
    path = save_scorer(tmp_path_factory.mktemp("scorer") / "tiny.safetensors", model, weights, report, "tiny")
    return model, str(path), weights, report


def test_the_fit_reports_how_much_of_kvzips_choice_it_keeps(fitted):
    """On windows it was fit on, the scorer keeps more of KVzip's top 30% than a random choice (30%) would; a random
    tiny model's held-out windows (the fixture's) carry no signal to generalise, so there it is only a share."""
    model, _, weights, report = fitted
    assert weights.shape == (2, 2, 8 // 2 + 8 + 1)  # [layers, KV heads, rotary pairs + value + 1] (head_dim 8)
    assert set(report["kept_agreement_by_layer"]) == {0, 1} and 0 <= report["kept_agreement"] <= 1
    windows = torch.randint(3, VOCAB, (4, 48), generator=torch.Generator().manual_seed(0))
    _, in_sample = fit_scorer(model, windows, windows, chunk_size=CHUNK, progress=False)
    assert KEEP < in_sample["kept_agreement"] <= 1


@torch.inference_mode()
def test_at_full_budget_it_gives_the_dense_caches_logits(fitted):
    model, path, _, _ = fitted
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    dense = model(input_ids=ids, **cache_kwargs(DynamicCache())).logits[:, -1]
    cache = EvictionCache(model, make_policy("kvzap", 64, scorer=path))
    torch.testing.assert_close(prefill(model, cache, ids, torch.ones_like(ids), CHUNK), dense, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_the_first_layer_keeps_the_highest_predicted_scores(fitted):
    """Layer 0's K/V do not depend on what was evicted: its kept set, chunk after chunk, is the reference's (the
    ``recent`` newest, then the highest ``features @ weights``; ties the newer) over the dense cache's K/V."""
    model, path, weights, _ = fitted
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    dense = DynamicCache()
    model(input_ids=ids, **cache_kwargs(dense))
    scores = torch.einsum("htf,hf->ht", token_features(dense.layers[0].keys, dense.layers[0].values)[0], weights[0])
    policy = make_policy("kvzap", BUDGET, scorer=path)
    cache = EvictionCache(model, policy, chunk_size=CHUNK)
    prefill(model, cache, ids, torch.ones_like(ids), CHUNK)
    held = [set() for _ in range(scores.shape[0])]
    for end in range(CHUNK, 40 + CHUNK, CHUNK):
        end = min(end, 40)
        for h, kept in enumerate(held):
            candidates = kept | set(range(end - CHUNK if end % CHUNK == 0 else end - end % CHUNK, end))
            recent = {t for t in candidates if t >= end - policy.recent}
            others = sorted(candidates - recent, key=lambda t: (float(scores[h, t]), t))
            held[h] = recent | set(others[len(others) - (BUDGET - len(recent)):]) if len(candidates) > BUDGET \
                else candidates
    layer = cache.layers[0]
    assert [set(layer.index[0, h, :layer.used].tolist()) for h in range(len(held))] == held


def test_a_scorer_fit_on_another_model_is_refused(fitted):
    _, path, _, _ = fitted
    with pytest.raises(ValueError, match="fit on another model"):
        EvictionCache(tiny_model("llama", seed=1), make_policy("kvzap", BUDGET, scorer=path))
    with pytest.raises(ValueError, match="fitted scorer"):
        make_policy("kvzap", BUDGET)
    with pytest.raises(FileNotFoundError, match="fit-scorer"):
        make_policy("kvzap", BUDGET, scorer="missing.safetensors")


@pytest.mark.heavy  # a fit, then a CLI generate that compiles its step: 30 s
def test_fit_scorer_then_generate_with_it(tmp_path, capsys):
    out = tmp_path / "s.safetensors"
    assert main(["fit-scorer", "--model", "reference", "--nsamples", "2", "--held-out", "1", "--seqlen", "96",
                 "--chunk-size", "32", "--out", str(out)]) == 0
    assert "of what KVzip keeps" in capsys.readouterr().out
    assert main(["generate", "--model", "reference", "--prompt", "Once upon a time, in a quiet village by the sea,",
                 "--policy", "kvzap", "--scorer", str(out), "--budget", "8", "--max-new-tokens", "4"]) == 0


@torch.inference_mode()
def test_kvzap_global_at_full_budget_gives_the_dense_caches_logits(fitted):
    model, path, _, _ = fitted
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    dense = model(input_ids=ids, **cache_kwargs(DynamicCache())).logits[:, -1]
    cache = EvictionCache(model, make_policy("kvzap-global", 64, scorer=path))
    torch.testing.assert_close(prefill(model, cache, ids, torch.ones_like(ids), CHUNK), dense, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("kv_bits", [None, 8])  # (8: a pool of codes from the start, scored through its heads)
def test_kvzap_global_gives_the_models_slots_to_its_highest_predictions_in_any_layer(fitted, kv_bits):
    """One ranking over every (layer, KV head, token) of a context read whole: the ``recent`` newest of each head
    kept, then the highest ``features @ weights`` over the dense cache's K/V (nothing is evicted while the context
    is read, so every layer's K/V are the dense cache's); each layer's budget becomes its heads' share of what it
    won. Then a decode step keeps each layer within that pool."""
    model, path, weights, _ = fitted
    context = 40
    ids = torch.randint(3, VOCAB, (1, context), generator=torch.Generator().manual_seed(4))
    dense = DynamicCache()
    model(input_ids=ids, **cache_kwargs(dense))
    policy = make_policy("kvzap-global", BUDGET, scorer=path)
    cache = EvictionCache(model, policy, chunk_size=CHUNK, kv_bits=kv_bits)
    prefill(model, cache, ids, torch.ones_like(ids), CHUNK, first_chunk=context)
    layers, heads = weights.shape[:2]
    held = set()
    for i, layer in enumerate(cache.layers):
        valid = layer.valid[0, 0, :layer.used]
        held |= {(i, h, t) for h, t in zip(layer.head[0, 0, :layer.used][valid].tolist(),
                                            layer.index[0, 0, :layer.used][valid].tolist())}
    if kv_bits is None:  # (low-bit codes are scored from their rounded K/V: the kept set is theirs, not the dense's)
        scores = [torch.einsum("htf,hf->ht", token_features(dense.layers[i].keys, dense.layers[i].values)[0],
                               weights[i]) for i in range(layers)]
        newest = range(context - policy.recent, context)
        recent = {(i, h, t) for i in range(layers) for h in range(heads) for t in newest}
        others = sorted(((i, h, t) for i in range(layers) for h in range(heads) for t in range(context)
                         if (i, h, t) not in recent), key=lambda key: (float(scores[key[0]][key[1:]]), key[2]))
        assert held == recent | set(others[len(others) - (BUDGET * heads * layers - len(recent)):])
    won = [sum(1 for key in held if key[0] == i) for i in range(layers)]
    assert sum(won) == BUDGET * heads * layers
    assert [layer.policy.budget for layer in cache.layers] == [-(-n // heads) for n in won]
    budgets = [layer.policy.budget for layer in cache.layers]
    model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[context]]), **cache_kwargs(cache))
    assert all(n <= b for n, b in zip(cache.held_tokens(), budgets))
