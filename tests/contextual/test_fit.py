import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparsegen.contextual import attach, detach
from sparsegen.contextual.dejavu import (
    DejaVuConfig,
    default_rank,
    fit_dejavu,
    measure,
    needed,
    recall_curve,
    train_predictor,
)
from sparsegen.contextual.teal import fit_teal, thresholds_for
from tests.kv.families import VOCAB, tiny_model

IDS = torch.randint(3, VOCAB, (6, 32), generator=torch.Generator().manual_seed(0))


def test_recall_curve_by_hand():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.3]])
    labels = torch.tensor([[True, True, False, False]])
    # ranked: unit0 (hit), unit2, unit3, unit1 (hit)
    assert recall_curve(scores, labels).tolist() == [0.5, 0.5, 0.5, 1.0]
    result = measure(scores, labels, torch.tensor([[3.0, 1.0, 0.0, 0.0]]), k=2)
    assert result["recall"] == 0.5 and result["precision"] == 0.5 and result["mass_recall"] == 0.75


def test_labels_relu_nonzero_and_smooth_by_mass():
    values = torch.tensor([[5.0, 0.0, 3.0, 2.0]])
    assert needed(values, relu=True, mass=0.9).tolist() == [[True, False, True, True]]
    assert needed(values, relu=False, mass=0.5).tolist() == [[True, False, False, False]]
    assert needed(values, relu=False, mass=0.75).tolist() == [[True, False, True, False]]


def test_default_rank_costs_at_most_five_percent_of_the_mlp():
    for hidden, neurons in [(256, 768), (2048, 8192), (4096, 11008)]:
        rank = default_rank(hidden, neurons, 3)
        assert rank * (hidden + neurons) <= 0.05 * 3 * hidden * neurons < (rank + 1) * (hidden + neurons)


def test_predictor_learns_a_planted_pattern():
    """Labels are a fixed low-rank function of the input; the predictor must recover them."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6000, 32, generator=generator)
    planted = x @ torch.randn(32, 4, generator=generator) @ torch.randn(4, 64, generator=generator)
    labels = planted > 1.0  # about 30% of units on, varying per token
    config = DejaVuConfig(recall=0.95, epochs=15, lr=1e-2)
    predictor = train_predictor(x[:5000], labels[:5000], rank=8, config=config)
    with torch.no_grad():
        scores = predictor(x[5000:])
    k = int(labels.float().sum(-1).mean() * 1.5)
    assert measure(scores, labels[5000:], planted[5000:].clamp(min=0), k)["recall"] >= 0.95
    shuffled = scores[torch.randperm(1000, generator=generator)]  # a predictor that does not know the input
    assert measure(shuffled, labels[5000:], planted[5000:].clamp(min=0), k)["recall"] < 0.8


def test_fit_dejavu_on_a_relu_model_reports_held_out_recall():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, hidden_act="relu")
    model = LlamaForCausalLM(config).eval()
    plan = fit_dejavu(model, IDS, DejaVuConfig(recall=0.9, heads=0.25, epochs=3), progress=False)
    assert plan.info["labels"] == "nonzero"
    for layer, k in zip(plan.info["report"], plan.top_k):
        assert 1 <= k["mlp"] <= 64 and k["heads"] == 3
        assert layer["mlp"]["units"] == 64 and 0 <= layer["mlp"]["recall"] <= 1
        assert 0.3 < layer["mlp"]["label_density"] < 0.7  # a random ReLU gate is on about half the time
    attach(model, plan)
    with torch.no_grad():
        assert model(IDS[:1]).logits.isfinite().all()
    detach(model)


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"), ({"sparsity": 0.5, "top_k": 3}, "exactly one"), ({"sparsity": 1.0}, r"\[0, 1\)"),
    ({"recall": 1.5}, "recall"), ({"sparsity": 0.5, "heads": 1.0}, "heads"), ({"top_k": 0}, "top-k"),
])
def test_dejavu_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DejaVuConfig(**kwargs)


def test_dejavu_needs_three_windows_and_separate_head_projections():
    with pytest.raises(ValueError, match="at least 3"):
        fit_dejavu(tiny_model("llama"), IDS[:2], DejaVuConfig(sparsity=0.5), progress=False)
    with pytest.raises(ValueError, match="--heads 0"):
        fit_dejavu(tiny_model("gpt_neox"), IDS, DejaVuConfig(sparsity=0.5, heads=0.5), progress=False)


def test_thresholds_hit_the_target_on_calibration_values():
    values = {"a": torch.rand(10_000).abs(), "b": torch.randn(5_001).abs()}
    for sparsity in (0.0, 0.3, 0.5, 0.9):
        for name, t in thresholds_for(values, sparsity).items():
            dropped = (values[name] < t).float().mean().item()
            assert dropped == pytest.approx(sparsity, abs=1 / len(values[name]))


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_fit_teal_zeroes_the_target_fraction_of_every_linear_input(family):
    model = tiny_model(family)
    plan = fit_teal(model, IDS, 0.5, progress=False)
    linears = sum(isinstance(m, torch.nn.Linear) for layer in model.get_decoder().layers for m in layer.modules())
    assert len(plan.thresholds) == linears
    for name, achieved in plan.info["achieved_on_calibration"].items():
        if name.endswith("fc2"):  # after a ReLU: more inputs than the target are exact zeros, and all of them go
            assert achieved >= 0.5
        else:
            assert achieved == pytest.approx(0.5, abs=0.01)
    with pytest.raises(ValueError, match="sparsity"):
        fit_teal(model, IDS, 1.0, progress=False)


@pytest.mark.heavy
def test_cli_fit_then_run(tiny_checkpoint, corpus, tmp_path, capsys):
    from sparsegen.cli import main

    calib = str(corpus / "books/train")
    assert main(["contextual", "fit", "--model", str(tiny_checkpoint), "--method", "dejavu", "--recall", "0.9",
                 "--heads", "0.25", "--epochs", "2", "--calib", calib, "--nsamples", "4", "--seqlen", "32",
                 "--out", str(tmp_path / "dv")]) == 0
    assert "recall" in capsys.readouterr().out
    assert main(["contextual", "fit", "--model", str(tiny_checkpoint), "--method", "teal", "--sparsity", "0.5",
                 "--calib", calib, "--nsamples", "2", "--seqlen", "32", "--out", str(tmp_path / "teal")]) == 0
    assert "achieved on calibration 0.5" in capsys.readouterr().out
    assert main(["contextual", "fit", "--model", str(tiny_checkpoint), "--method", "teal", "--sparsity", "0.5",
                 "--calib", calib, "--out", str(tmp_path / "teal")]) == 2  # non-empty --out without --force
    assert "--force" in capsys.readouterr().err
    for method, flags in (("teal", ["--top-k", "4"]), ("dejavu", ["--sparsity", "0.5", "--targets", "mlp"])):
        assert main(["contextual", "fit", "--model", str(tiny_checkpoint), "--method", method, *flags,
                     "--calib", calib, "--out", str(tmp_path / "bad")]) != 0  # each method takes its own options only
        assert f"{method} takes no {flags[-2]} (its options:" in capsys.readouterr().err
    for method, needs in (("teal", "teal needs --sparsity"), ("dejavu", "give exactly one of --sparsity")):
        assert main(["contextual", "fit", "--model", str(tiny_checkpoint), "--method", method, "--calib", calib,
                     "--out", str(tmp_path / "bad")]) != 0
        assert needs in capsys.readouterr().err
    assert main(["contextual", "fit", "--model", str(tiny_checkpoint), "--method", "lru", "--sparsity", "0.5",
                 "--calib", calib, "--out", str(tmp_path / "bad")]) != 0
    assert "unknown contextual method 'lru'; choose one of dejavu, teal" in capsys.readouterr().err
    for plan in ("dv", "teal"):
        assert main(["ppl", "--windows", "--model", str(tiny_checkpoint), "--text", str(corpus / "books/test"),
                     "--ctx", "32", "--contextual", str(tmp_path / plan)]) == 0
        assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "It was the", "--max-new-tokens", "4",
                     "--policy", "streaming", "--budget", "8", "--contextual", str(tmp_path / plan)]) == 0
    capsys.readouterr()
    assert main(["bench", "--model", str(tiny_checkpoint), "--policies", "full", "--contexts", "16",
                 "--new-tokens", "2", "--warmup", "1", "--contextual", f"none,{tmp_path / 'teal'}"]) == 0
    out = capsys.readouterr().out
    assert f"speed-up of {tiny_checkpoint} + {tmp_path / 'teal'} over {tiny_checkpoint}" in out
    assert "MLP speed-up" in out


@pytest.mark.heavy
def test_cli_fit_on_a_random_shape(tiny_checkpoint, tmp_path, capsys):
    """random:PATH has no tokenizer: calibration uses random token ids, and bench runs the plan on that shape."""
    from sparsegen.cli import main

    model = f"random:{tiny_checkpoint}"
    assert main(["contextual", "fit", "--model", model, "--method", "dejavu", "--sparsity", "0.5", "--epochs", "1",
                 "--nsamples", "3", "--seqlen", "16", "--out", str(tmp_path / "dv")]) == 0
    assert main(["bench", "--model", model, "--policies", "full", "--contexts", "16", "--new-tokens", "2",
                 "--warmup", "1", "--contextual", str(tmp_path / "dv")]) == 0
