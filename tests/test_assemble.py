"""sparsegen.load puts on a model what the commands put on it: run-time weights, a contextual plan, a prompt."""

import pytest
import torch

import sparsegen
from sparsegen.models.anatomy import pinned_tokens


def test_load_restores_weights_and_puts_a_prompt():
    plain, tokenizer = sparsegen.load("reference")
    model, _ = sparsegen.load("reference", weights="int8", hard_prompt="A story: ")
    assert pinned_tokens(model) >= 3 and pinned_tokens(plain) == 0  # the prompt's tokens, never evicted
    assert not any(type(m) is torch.nn.Linear for m in model.get_decoder().layers.modules())  # re-stored linears
    ids = torch.tensor([tokenizer("It was a dark night")["input_ids"]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    out = sparsegen.generate(model, tokenizer, "It was a dark "
                                               "night", max_new_tokens=4, stop_at_eos=False, compile=False)
    assert out.new_tokens == [4] and out.cache["weights"] == "int8"  # (compiled by default: tested below)


def test_load_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="soft prompt or a hard prompt"):
        sparsegen.load("reference", soft_prompt="p.safetensors", hard_prompt="x")
    with pytest.raises(ValueError, match="must be one of"):
        sparsegen.load("reference", weights="int3")
    with pytest.raises(sparsegen.ModelLoadError, match="not a GGUF model"):
        sparsegen.load("reference", weights="gguf")


def test_a_gguf_model_runs_at_its_own_bit_width_by_default_and_a_folder_as_loaded(tmp_path):
    from sparsegen.assemble import default_weights
    from sparsegen.models.anatomy import weights_of

    assert default_weights("smollm2", "cpu") == default_weights("gemma3-270m", "cpu") == "gguf"
    assert default_weights(tmp_path / "model.Q4_1.GGUF", "cpu") == "gguf"
    assert default_weights("reference", "cpu") == default_weights(tmp_path, "cpu") == "fp32"
    assert default_weights("smollm2", "cuda") == "fp32"  # (the integer kernels are CPU kernels)
    model, _ = sparsegen.load("reference")  # weights="auto"
    assert weights_of(model) == "fp32" and any(type(m) is torch.nn.Linear for m in model.get_decoder().modules())
    with pytest.raises(ValueError, match="one of auto, fp32"):
        sparsegen.load("reference", weights="int2")


def test_the_compiled_step_is_the_default_where_the_weights_are_low_bit():
    from sparsegen.engine.step import DecodeStep, compiles_by_default
    from sparsegen.models.anatomy import weights_of

    plain, _ = sparsegen.load("reference")
    packed, _ = sparsegen.load("reference", weights="w8a8")
    assert weights_of(packed) == "w8a8"
    assert not compiles_by_default(plain) and compiles_by_default(packed)
    assert not DecodeStep(plain).compiled and DecodeStep(packed).compiled
    assert not DecodeStep(packed, compile=False).compiled and DecodeStep(plain, compile=True).compiled
    assert DecodeStep(packed).mode == DecodeStep(plain, compile=True).mode == "regional"  # (on a CPU)


def test_commands_that_change_weights_load_them_as_floats_and_calibration_refuses_packed_ones(monkeypatch):
    """prune, quantize, prompt-tune and contextual fit have no --weights: a GGUF model's default (gguf) would hand
    them packed linears to calibrate (CI's vLLM checkpoints once divided by zero pruned linears)."""
    import sparsegen.assemble
    from sparsegen.cli import build_parser
    from sparsegen.cli.common import load_model
    from sparsegen.pruning import PruneConfig, prune_model

    asked = {}
    monkeypatch.setattr(sparsegen.assemble, "load", lambda name, **kw: asked.setdefault(name, kw["weights"]))
    for command in (["prune", "--model", "smollm2", "--method", "magnitude", "--sparsity", "0.5", "--out", "x"],
                    ["quantize", "--model", "smollm2", "--out", "x"],
                    ["generate", "--model", "gemma3-270m", "--prompt", "x"]):
        asked.clear()
        load_model(build_parser().parse_args(command))
        assert asked == {command[2]: "auto" if command[0] == "generate" else "fp32"}
    packed, _ = sparsegen.load("reference", weights="w8a8")
    with pytest.raises(ValueError, match="stored as w8a8: load it with weights='fp32'"):
        prune_model(packed, PruneConfig(method="magnitude", sparsity=0.5), progress=False)
