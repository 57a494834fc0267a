import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import sparsegen
from sparsegen.cli import main
from sparsegen.models.anatomy import attention_heads, decoder_layers, head_families, mlp_layout
from sparsegen.pruning import PruneConfig, prune_model, save_pruned, structured
from tests.kv.families import FAMILIES, VOCAB, tiny_model

IDS = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))


def _mask_like_pruning(model, amounts):
    """Zero, in the dense model, exactly what magnitude structured pruning removes."""
    model_type = model.config.model_type
    producers, consumer = mlp_layout(model_type)
    with torch.no_grad():
        for layer in decoder_layers(model):
            down = layer.get_submodule(consumer)
            ones = torch.ones(down.in_features)
            keep = structured.lowest_kept(structured.neuron_scores(layer, model_type, ones), amounts["neurons"], "")
            gone = torch.ones(down.in_features, dtype=torch.bool)
            gone[keep] = False
            down.weight[:, gone] = 0
            if "heads" in amounts:
                attention = layer.self_attn
                q_heads, kv_heads, head_dim = attention_heads(attention)
                scores = structured.group_scores(layer, torch.ones(attention.o_proj.in_features))
                kept = structured.lowest_kept(scores, amounts["heads"], "")
                removed = [g for g in range(kv_heads) if g not in kept.tolist()]
                group = q_heads // kv_heads
                for g in removed:
                    columns = slice(g * group * head_dim, (g + 1) * group * head_dim)
                    attention.o_proj.weight[:, columns] = 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shrunk_model_equals_the_masked_dense_model(family):
    amounts = {"neurons": 0.5, "heads": 0.5} if family in head_families() else {"neurons": 0.5}
    spec = ",".join(f"{k}={v}" for k, v in amounts.items())
    model = tiny_model(family)
    masked = copy.deepcopy(model)
    report = prune_model(model, PruneConfig(method="magnitude", structured=spec), progress=False)
    _mask_like_pruning(masked, amounts)
    assert report["params_after"] < report["params_before"]
    for entry in report["layers"]:
        assert entry["neurons"] == entry["neurons_before"] // 2
    if "heads" in amounts:  # 4 query heads over 2 KV groups: one group, and its 2 query heads, stay
        assert all(e["kv_groups_before"] == 2 and e["kv_groups"] == 1 for e in report["layers"])
        attention = decoder_layers(model)[0].self_attn
        assert attention.q_proj.out_features == 2 * attention.head_dim == attention.o_proj.in_features
    torch.testing.assert_close(model(IDS).logits, masked(IDS).logits, rtol=0, atol=1e-5)


def test_structured_checkpoint_round_trip(tiny_checkpoint, corpus, tmp_path):
    out = tmp_path / "shrunk"
    assert main(["prune", "--model", str(tiny_checkpoint), "--method", "wanda", "--structured",
                 "neurons=0.25,heads=0.5", "--calib", str(corpus / "books/train"), "--nsamples", "4",
                 "--seqlen", "32", "--out", str(out)]) == 0
    report = json.loads((out / "sparsity.json").read_text())
    assert report["structured"] == {"neurons": 0.25, "heads": 0.5} and report["removed"] > 0.1
    model, tokenizer = sparsegen.load(out)
    config = json.loads((out / "config.json").read_text())  # uniform sizes: a plain config any tool builds from
    assert (config["intermediate_size"], config["num_key_value_heads"], config["num_attention_heads"]) == (48, 1, 2)
    assert "sparsegen_structure" not in config
    spec = sparsegen.model_spec(out)
    assert spec.params == report["params_after"] == sum(p.numel() for p in model.parameters())
    assert spec.kv_bytes_per_token == 2 * 2 * 1 * 8 * 4  # K and V, 2 layers, 1 KV group of 8 dims, fp32
    assert model.model.layers[1].mlp.down_proj.weight.shape == (32, 48)
    again, _ = sparsegen.load(out)
    ids = torch.tensor([[0, 5, 6, 7, 8]])
    torch.testing.assert_close(model(ids).logits, again(ids).logits, rtol=0, atol=0)
    streamed = sparsegen.generate(model, tokenizer, "it was the", policy="streaming", budget=8, max_new_tokens=5,
                                  stop_at_eos=False)
    assert streamed.new_tokens == [5]
    plain = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_per_layer_sizes_load_in_sparsegen_and_plain_transformers_refuses_them(tiny_checkpoint, tmp_path):
    model, tokenizer = sparsegen.load(tiny_checkpoint)
    structured.keep_neurons(decoder_layers(model)[0], "llama", torch.arange(40))  # layer 0 narrower than layer 1
    structured.record(model.config, decoder_layers(model))
    assert model.config.sparsegen_structure == {"neurons": [40, 64], "kv_groups": [2, 2]}
    save_pruned(model, tokenizer, tmp_path / "uneven", {})
    again, _ = sparsegen.load(tmp_path / "uneven")
    ids = torch.tensor([[0, 5, 6, 7, 8]])
    torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
    with pytest.raises(Exception, match="mismatch"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "uneven")


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="wanda", structured="neurons=1.0"), "in \\[0, 1\\)"),
    (dict(method="wanda", structured="rows=0.5"), "neurons=F and/or heads=F"),
    (dict(method="sparsegpt", structured="neurons=0.5"), "\\(magnitude, wanda[^)]*\\); sparsegpt prunes single "
                                                         "weights"),
])
def test_bad_structured_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PruneConfig(**kwargs)


def test_heads_on_a_fused_attention_family_is_refused():
    with pytest.raises(ValueError, match="neurons=F"):
        prune_model(tiny_model("gpt_neox"), PruneConfig(method="magnitude", structured="heads=0.5"), progress=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_shrunk_uniformly_is_a_plain_checkpoint(family, tmp_path):
    model = tiny_model(family)
    amounts = "neurons=0.5,heads=0.5" if family in head_families() else "neurons=0.5"
    prune_model(model, PruneConfig(method="magnitude", structured=amounts), progress=False)
    save_pruned(model, None, tmp_path / family, {})
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / family)
    torch.testing.assert_close(plain(IDS).logits, model(IDS).logits, rtol=0, atol=1e-6)
