"""The examples extend sparsegen in one file each: what they register works by name, as the built-in kinds do."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparsegen
from sparsegen.kv import POLICIES, EvictionCache, make_policy
from sparsegen.models.compat import cache_kwargs
from sparsegen.plugins import load_plugin

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.fixture(scope="module")
def strided():
    load_plugin(str(EXAMPLES / "custom_policy.py"))
    yield POLICIES["strided"]


def test_the_custom_policy_keeps_sinks_recent_and_every_stride(strided, tiny_checkpoint):
    model, _ = sparsegen.load(tiny_checkpoint)
    for stride, older in ((8, [24, 32, 40, 48]), (4, [36, 40, 44, 48])):
        cache = EvictionCache(model, make_policy("strided", 16, stride=stride))
        with torch.no_grad():
            model(input_ids=torch.arange(2, 60)[None], **cache_kwargs(cache))
        kept = sorted(cache.layers[0].index[0, 0, :16].tolist())
        # 4 sinks, the 8 most recent, and the 4 newest multiples of the stride before them (ties: the newer token)
        assert kept == [0, 1, 2, 3] + older + list(range(50, 58))
    with pytest.raises(ValueError, match="takes no --sinks.*--stride"):
        make_policy("strided", 16, sinks=2)


@pytest.mark.heavy
def test_the_custom_policy_is_exact_at_full_budget_and_in_the_cli(strided, tiny_checkpoint):
    from tests.kv.test_exactness import test_full_budget_equals_dynamic_cache

    test_full_budget_equals_dynamic_cache("llama", "strided", "sdpa")  # the built-in policies' exactness test
    out = subprocess.run([sys.executable, "-m", "sparsegen", "--plugin", str(EXAMPLES / "custom_policy.py"), "generate",
                          "--model", str(tiny_checkpoint), "--policy", "strided", "--budget", "16", "--prompt",
                          "it was the best of times " * 8, "--max-new-tokens", "4", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"policy": "strided"' in out.stdout and '"stride": 8' in out.stdout


@pytest.mark.heavy
def test_the_example_runs_as_a_script():
    out = subprocess.run([sys.executable, str(EXAMPLES / "custom_policy.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "held per layer: 16 of a budget of 16" in out.stdout


def test_a_bad_plugin_is_one_line(capsys):
    from sparsegen.cli import main

    assert main(["--plugin", "no/such/file.py", "info", "reference"]) == 2
    assert "no plugin file" in capsys.readouterr().err
    assert main(["--plugin", "no_such_module_xyz", "info", "reference"]) == 2
    assert "no such module" in capsys.readouterr().err


@pytest.mark.heavy
def test_the_custom_pruning_method_scores_as_ria_and_prunes_2_4(tmp_path, corpus, tiny_checkpoint):
    from sparsegen.models.anatomy import decoder_layers, linears
    from sparsegen.models.calibration import Statistics
    from sparsegen.pruning import METHODS, PruneConfig, prune_model
    from tests.kv.families import tiny_model
    from tests.pruning.test_prune import _ids

    ria = load_plugin(str(EXAMPLES / "custom_pruning.py")).RIA
    assert METHODS["ria"] is ria
    weight = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    stats = Statistics(torch.nn.Linear(2, 2), "norms")
    stats.sq_sum += torch.tensor([16.0, 1.0], dtype=torch.float64)
    expected = torch.tensor([[1 / 3 + 1 / 4, 2 / 3 + 2 / 6], [3 / 7 + 3 / 4, 4 / 7 + 4 / 6]]) * torch.tensor([2.0, 1.0])
    torch.testing.assert_close(ria().scores(weight, stats), expected)
    model, wanda = tiny_model("llama"), tiny_model("llama")
    prune_model(model, PruneConfig("ria", pattern="2:4", batch_size=4), _ids(), progress=False)
    prune_model(wanda, PruneConfig("wanda", pattern="2:4", batch_size=4), _ids(), progress=False)
    masks = [(lin.weight == 0) for layer in decoder_layers(model) for lin in linears(layer).values()]
    assert all(m.reshape(m.shape[0], -1, 4).sum(-1).eq(2).all() for m in masks)  # 2 of every 4 inputs, every row
    assert any(not torch.equal(m, (w.weight == 0)) for m, w in
               zip(masks, [lin for layer in decoder_layers(wanda) for lin in linears(layer).values()]))
    out = subprocess.run([sys.executable, "-m", "sparsegen", "--plugin", str(EXAMPLES / "custom_pruning.py"), "prune",
                          "--model", str(tiny_checkpoint), "--method", "ria", "--structured", "neurons=0.25",
                          "--calib", str(corpus / "books/train"), "--nsamples", "4", "--seqlen", "16",
                          "--out", str(tmp_path / "ria")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "ria, structured neurons=0.25" in out.stdout


def test_the_custom_family_evicts_exactly_and_prunes(tmp_path):
    from transformers import DynamicCache, GraniteConfig, GraniteForCausalLM

    from sparsegen.models.anatomy import decoder_layers, group_count, neuron_count
    from sparsegen.models.families import FAMILIES, family
    from sparsegen.pruning import PruneConfig, prune_model
    from tests.kv.test_exactness import CHUNKS, TOL, _padded_batch, _run_chunks
    from tests.pruning.test_prune import _ids

    with pytest.raises(ValueError, match="unsupported architecture 'granite-like'.*register_family"):
        family("granite-like")
    load_plugin(str(EXAMPLES / "custom_family.py"))
    assert FAMILIES["granite"].separate_heads
    torch.manual_seed(0)
    config = GraniteConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, attention_multiplier=0.2,
                           embedding_multiplier=4.0, residual_multiplier=0.5, logits_scaling=2.0, pad_token_id=0)
    model = GraniteForCausalLM(config).eval()
    ids, mask = _padded_batch([28, 20, 13], 28)
    expected = _run_chunks(model, DynamicCache(config=model.config), ids, mask, CHUNKS)
    for name in ("full", "window", "streaming", "h2o", "snapkv", "adakv"):
        cache = EvictionCache(model, make_policy(name, None if name == "full" else 64), chunk_size=8)
        got = _run_chunks(model, cache, ids, mask, CHUNKS)
        assert (got - expected)[mask.bool()].abs().max() <= TOL, name
    cache = EvictionCache(model, make_policy("streaming", 8), chunk_size=8)  # rolling positions, evicting
    assert torch.isfinite(_run_chunks(model, cache, ids, mask, CHUNKS)).all() and max(cache.held_tokens()) == 8
    prune_model(model, PruneConfig("wanda", structured="neurons=0.5,heads=0.5", batch_size=4), _ids(), progress=False)
    assert [neuron_count(layer, "granite") for layer in decoder_layers(model)] == [24, 24]
    assert [group_count(layer) for layer in decoder_layers(model)] == [1, 1]
