import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparsegen.contextual.stats import contextual_statistics, needed_fraction
from tests.kv.families import FAMILIES, VOCAB, tiny_model

IDS = torch.randint(3, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))


def test_needed_fraction_by_hand():
    values = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # 4 of 10 reaches 40%, 7 of 10 reaches 70%; a single unit carries everything; uniform needs all
    assert needed_fraction(values, 0.7).tolist() == [0.5, 0.25, 0.75]
    assert needed_fraction(values, 1.0).tolist() == [1.0, 0.25, 1.0]


def test_relu_gate_leaves_exact_zeros_that_are_counted():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, hidden_act="relu")
    model = LlamaForCausalLM(config).eval()
    captured = []
    model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    stats = contextual_statistics(model, IDS, mass=0.95, batch_size=2, progress=False)
    direct = torch.cat([c.reshape(-1, 64) for c in captured])
    assert stats["tokens"] == 4 * 16
    assert stats["layers"][1]["mlp_zero_fraction"] == pytest.approx((direct == 0).float().mean().item(), abs=1e-6)
    assert 0.3 < stats["layers"][1]["mlp_zero_fraction"] < 0.7  # a random ReLU gate: about half
    for layer in stats["layers"]:
        assert layer["mlp_sparsity"] >= layer["mlp_zero_fraction"] - 1e-6  # zeros never carry mass
        assert 0 <= layer["head_sparsity"] < 1
    assert [layer["residual_cosine"] is None for layer in stats["layers"]] == [False, False, True]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family(family):
    stats = contextual_statistics(tiny_model(family), IDS, progress=False)
    assert len(stats["layers"]) == tiny_model(family).config.num_hidden_layers
    assert all(0 <= layer["mlp_sparsity"] < 1 for layer in stats["layers"])
    assert -1 <= stats["layers"][0]["residual_cosine"] <= 1


def test_cli(tiny_checkpoint, corpus, tmp_path, capsys):
    from sparsegen.cli import main

    out = tmp_path / "stats.json"
    assert main(["contextual", "stats", "--model", str(tiny_checkpoint), "--calib", str(corpus / "books/test"),
                 "--nsamples", "2", "--seqlen", "32", "--json", str(out)]) == 0
    assert "MLP sparsity" in capsys.readouterr().out
    import json
    assert len(json.loads(out.read_text())["layers"]) == 2


def test_bundled_relu_reference_has_exact_zeros_in_its_mlp():
    import sparsegen

    model, tokenizer = sparsegen.load("reference-relu")
    assert model.config.hidden_act == "relu"
    ids = tokenizer(["It was late in the evening when the old man came back to the house"], return_tensors="pt")
    stats = contextual_statistics(model, ids["input_ids"], progress=False)
    assert all(layer["mlp_zero_fraction"] > 0.3 for layer in stats["layers"])
