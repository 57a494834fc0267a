import pytest
import torch

import sparsegen
from sparsegen.cli import main
from sparsegen.prompt import PromptPrefix, TuneConfig, prefix_of, tune_prompt
from tests.kv.families import VOCAB, tiny_model


def _windows():
    """One window repeated: the held-out windows are the training text, so the loss must fall."""
    return torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0)).repeat(10, 1)


def test_training_lowers_the_loss_and_leaves_the_model_unchanged():
    model, _ = sparsegen.load("reference")  # a real LM: a random one is near-uniform whatever it is prompted with
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prefix = tune_prompt(model, _windows(), TuneConfig(tokens=4, steps=15, lr=0.05, batch_size=2, eval_windows=2),
                         progress=False)
    assert prefix.info["held_out_loss_with_prompt"] < prefix.info["held_out_loss_without_prompt"] - 0.1
    assert prefix.embeddings.shape == (4, model.config.hidden_size)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.requires_grad for p in model.parameters()) and prefix_of(model) is None


def test_training_is_deterministic_for_a_seed():
    config = TuneConfig(tokens=3, steps=4, lr=0.01, batch_size=2, eval_windows=2, seed=3)
    first = tune_prompt(tiny_model("llama"), _windows(), config, progress=False)
    second = tune_prompt(tiny_model("llama"), _windows(), config, progress=False)
    assert torch.equal(first.embeddings, second.embeddings)


def test_distillation_from_a_teacher_lowers_the_kl():
    student, _ = sparsegen.load("reference")
    teacher, _ = sparsegen.load("reference")
    with torch.no_grad():
        for layer in student.get_decoder().layers:
            layer.mlp.down_proj.weight.mul_(0.5)  # a "compressed" student
    prefix = tune_prompt(student, _windows(), TuneConfig(tokens=4, steps=15, lr=0.05, batch_size=2, eval_windows=2),
                         teacher=teacher, progress=False)
    assert prefix.info["loss"] == "kl_to_teacher"
    assert prefix.info["held_out_loss_with_prompt"] < 0.9 * prefix.info["held_out_loss_without_prompt"]


def test_bad_settings():
    with pytest.raises(ValueError, match="at least 1"):
        TuneConfig(tokens=0)
    with pytest.raises(ValueError, match="learning rate"):
        TuneConfig(lr=0)
    with pytest.raises(ValueError, match="none to train on"):
        tune_prompt(tiny_model("llama"), _windows()[:2], TuneConfig(eval_windows=2), progress=False)


def test_cli_prompt_tune_then_run_commands_with_the_prompt(tiny_checkpoint, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_DATA", str(corpus))
    out = tmp_path / "p.safetensors"
    assert main(["prompt-tune", "--model", str(tiny_checkpoint), "--teacher", str(tiny_checkpoint), "--tokens", "4",
                 "--steps", "3", "--nsamples", "20", "--seqlen", "16", "--batch-size", "2", "--out", str(out)]) == 0
    assert "4-token soft prompt, 3 steps" in capsys.readouterr().out
    model, _ = sparsegen.load(tiny_checkpoint)
    assert PromptPrefix.load(out).embeddings.shape == (4, model.config.hidden_size)
    assert main(["prompt-tune", "--model", str(tiny_checkpoint), "--out", str(out)]) == 2  # exists
    assert "--force" in capsys.readouterr().err
    assert main(["ppl", "--windows", "--model", str(tiny_checkpoint), "--soft-prompt", str(out)]) == 0
    assert f"windows of {model.config.max_position_embeddings - 4})" in capsys.readouterr().out
    assert main(["generate", "--model", str(tiny_checkpoint), "--soft-prompt", str(out), "--prompt", "It was",
                 "--policy", "streaming", "--budget", "8", "--max-new-tokens", "12", "--json"]) == 0
    assert '"kv_tokens": 8' in capsys.readouterr().out
    assert main(["generate", "--model", str(tiny_checkpoint), "--hard-prompt", "the age of wisdom", "--prompt",
                 "It was", "--max-new-tokens", "3"]) == 0
    assert main(["generate", "--model", str(tiny_checkpoint), "--soft-prompt", str(out), "--prompt", "It was",
                 "--policy", "window", "--budget", "4"]) == 2
    assert "raise the budget above 4" in capsys.readouterr().err


def test_text_init_starts_from_a_passage_of_the_training_text():
    model = tiny_model("llama")
    ids = _windows()
    prefix = tune_prompt(model, ids, TuneConfig(tokens=4, steps=1, lr=1e-9, batch_size=2, eval_windows=2, init="text"),
                         progress=False)
    expected = model.get_input_embeddings().weight[ids[0, -4:]]
    assert torch.allclose(prefix.embeddings, expected, atol=1e-6)
    with pytest.raises(ValueError, match="init must be"):
        TuneConfig(init="zeros")
