import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import sparsegen
from sparsegen.cli import main
from sparsegen.models import ModelLoadError
from sparsegen.pruning import PruneConfig, prune_model, save_pruned
from sparsegen.pruning.sparsegpt import sparsegpt_prune
from sparsegen.quant import QuantizeConfig, QuantLinear, quantize_model
from sparsegen.quant.groups import GroupQuantizer, round_to_nearest
from sparsegen.quant.linear import pack, unpack
from tests.kv.families import FAMILIES, VOCAB, tiny_model


def _ids(n=8, length=24, seed=0):
    return torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [0, 32, 128])
def test_round_trip_error_is_at_most_half_the_group_scale_and_zeros_stay_zero(bits, group_size):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 256, generator=generator) * torch.rand(16, 1, generator=generator)
    weight[torch.rand(16, 256, generator=generator) < 0.5] = 0  # a pruned layer
    weight[3] = 0  # an all-zero row
    weight[4] = weight[4].abs()  # a row whose range does not reach below 0
    quantizer = round_to_nearest(weight, bits, group_size)
    linear = QuantLinear.from_linear(torch.nn.Linear(256, 16, bias=False), weight, quantizer)
    restored = linear.dequantized(torch.float32)
    scale = quantizer.expand(quantizer.scales, 256)
    assert ((restored - weight).abs() <= scale / 2 * (1 + 1e-5)).all()
    assert (restored[weight == 0] == 0).all()
    assert linear.weight_packed.dtype == torch.int32 and linear.weight_packed.shape[1] == 256 * bits // 32
    codes = linear.codes()
    # the largest magnitude of each sign reaches the grid's last code (q = -7 and 7 at 4 bits, the -8 code unused)
    assert int(codes.min()) == 1 and int(codes.max()) == 2**bits - 1


@pytest.mark.parametrize("bits, words", [(4, 1), (8, 2)])
def test_packing_round_trips_odd_widths(bits, words):
    codes = torch.randint(0, 2**bits, (5, 7), dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes, bits), bits, 7), codes)
    assert pack(codes, bits).shape == (5, words) and pack(codes, bits).dtype == torch.int32


def test_w8a8_runs_as_an_integer_product_equal_to_the_dequantized_one(monkeypatch):
    from sparsegen.quant.linear import DynamicInputQuantLinear, quantize_per_token

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48)
    quantized = DynamicInputQuantLinear.from_linear(linear, linear.weight.data,
                                                    round_to_nearest(linear.weight.data, 8, 0))
    calls = []
    product = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda *a: calls.append(1) or product(*a))
    x = torch.randn(3, 5, 128)
    reference = F.linear(quantize_per_token(x), quantized.dequantized(torch.float32), linear.bias)
    torch.testing.assert_close(quantized(x), reference, rtol=1e-5, atol=1e-5)
    assert calls
    quantized.weight.mul_(-1)  # new codes (a checkpoint loaded in place): the product's copy follows
    reference = F.linear(quantize_per_token(x), quantized.dequantized(torch.float32), linear.bias)
    torch.testing.assert_close(quantized(x), reference, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # a model loaded under inference mode holds inference tensors (no write counts)
        made = DynamicInputQuantLinear.from_linear(linear, linear.weight.data,
                                                   round_to_nearest(linear.weight.data, 8, 0))
        torch.testing.assert_close(made(x), quantized(x).neg() + 2 * linear.bias, rtol=1e-5, atol=1e-5)


def test_quant_linear_forward_is_a_linear_with_the_dequantized_weight():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24)
    quantized = QuantLinear.from_linear(linear, linear.weight.data, round_to_nearest(linear.weight.data, 4, 16))
    x = torch.randn(3, 5, 64)
    assert torch.allclose(quantized(x), F.linear(x, quantized.dequantized(torch.float32), linear.bias), atol=1e-6)
    assert torch.equal(quantized.bias, linear.bias)


def test_gptq_beats_round_to_nearest_on_correlated_inputs_and_keeps_pruned_zeros():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 8, generator=generator) @ torch.randn(8, 128, generator=generator)  # low-rank inputs
    x += 0.05 * torch.randn(2048, 128, generator=generator)
    weight = torch.randn(32, 128, generator=generator)
    weight[torch.rand(32, 128, generator=generator) < 0.5] = 0
    hessian = 2 * x.T @ x / len(x)
    quantizer = GroupQuantizer(32, 128, 4, 64, weight.device)
    gptq, _ = sparsegpt_prune(weight, hessian, quantizer=quantizer, keep_zeros=True)
    rtn = round_to_nearest(weight, 4, 64)
    rtn_weight = QuantLinear.from_linear(torch.nn.Linear(128, 32, bias=False), weight, rtn).dequantized(torch.float32)
    gptq_linear = QuantLinear.from_linear(torch.nn.Linear(128, 32, bias=False), gptq, quantizer)
    gptq_weight = gptq_linear.dequantized(torch.float32)
    assert torch.allclose(gptq_weight, gptq, atol=1e-5)  # GPTQ's output lies on its grids
    assert (gptq_weight[weight == 0] == 0).all()
    error = lambda w: (x @ (w - weight).T).pow(2).mean().item()  # noqa: E731
    assert error(gptq_weight) < 0.5 * error(rtn_weight)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_eight_bit_models_stay_close_to_dense(family, method):
    model = tiny_model(family)
    ids = _ids()
    dense = model(ids).logits
    report = quantize_model(model, QuantizeConfig(bits=8, group_size=16, method=method, batch_size=4), ids,
                            progress=False)
    quantized = model(ids).logits
    swapped = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(swapped) == len(report["layers"]) >= 8
    assert not any(isinstance(m, torch.nn.Linear) for layer in model.get_decoder().layers for m in layer.modules())
    assert (quantized - dense).abs().max() < 0.02 * dense.abs().max()
    assert report["linear_bytes_after"] < report["linear_bytes_before"] / 3


def test_quantizing_twice_and_bad_settings_are_refused():
    model = tiny_model("llama")
    quantize_model(model, QuantizeConfig(method="rtn"), progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, QuantizeConfig(method="rtn"), progress=False)
    with pytest.raises(ValueError, match="bits must be one of"):
        QuantizeConfig(bits=3)
    with pytest.raises(ValueError, match="unknown quantization method"):
        QuantizeConfig(method="awq")
    with pytest.raises(ValueError, match="unknown checkpoint format 'gguf'"):
        QuantizeConfig(format="gguf")
    with pytest.raises(ValueError, match="use --group-size 0"):
        QuantizeConfig(bits=8, group_size=64, format="int-quantized")
    with pytest.raises(ValueError, match="calibration data"):
        quantize_model(tiny_model("llama"), QuantizeConfig(method="gptq"), None, progress=False)


def test_pruned_then_quantized_checkpoint_saves_and_loads_exactly(tiny_checkpoint, tmp_path):
    model, tokenizer = sparsegen.load(tiny_checkpoint)
    ids = torch.randint(3, len(tokenizer), (4, 16), generator=torch.Generator().manual_seed(0))
    prune_model(model, PruneConfig(method="wanda", sparsity=0.5, batch_size=4), ids, progress=False)
    report = quantize_model(model, QuantizeConfig(bits=4, group_size=16, method="gptq", batch_size=4), ids,
                            progress=False)
    save_pruned(model, tokenizer, tmp_path / "q", report, "quantization.json")
    loaded, _ = sparsegen.load(tmp_path / "q")
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == len(report["layers"])
    for layer in loaded.get_decoder().layers:  # the pruned half stays zero after quantization
        zeros = (layer.mlp.down_proj.dequantized(torch.float32) == 0).float().mean().item()
        assert zeros >= 0.5
    recorded = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert recorded["config_groups"]["group_0"]["weights"]["num_bits"] == 4 and recorded["ignore"] == ["lm_head"]


@pytest.mark.parametrize("bits, group_size, format", [(4, 16, "pack-quantized"), (8, 0, "pack-quantized"),
                                                      (4, 16, "int-quantized"), (8, 0, "int-quantized")])
def test_plain_transformers_with_compressed_tensors_reads_the_checkpoint(tiny_checkpoint, tmp_path, bits, group_size,
                                                                         format):
    """The checkpoint is compressed-tensors' format: the codes pack as its own packer packs them (pack-quantized) or
    sit one per int8 (int-quantized), its config validates, and plain AutoModelForCausalLM gives sparsegen.load's
    logits — with int8 inputs, compressed-tensors' own per-token rounding of the activations."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    model, tokenizer = sparsegen.load(tiny_checkpoint)
    report = quantize_model(model, QuantizeConfig(bits=bits, group_size=group_size, method="rtn", format=format),
                            progress=False)
    save_pruned(model, tokenizer, tmp_path / "q", report, "quantization.json")
    ours, _ = sparsegen.load(tmp_path / "q")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    assert type(plain.hf_quantizer).__name__ == "CompressedTensorsHfQuantizer"  # (on CPU it decompresses to Linear)
    ids = _ids()
    # W8A8 runs as integers here (int8 x int8 summed in int32), compressed-tensors in float: an activation on a
    # rounding boundary may land on the next code, a step of 1/255 of its token's range
    tolerance = 1e-3 if (bits, format) == (8, "int-quantized") else 1e-4
    assert torch.allclose(plain(ids).logits, ours(ids).logits, atol=tolerance)
    linear = ours.model.layers[0].self_attn.q_proj
    assert type(linear).FORMAT == format
    original = sparsegen.load(tiny_checkpoint)[0].model.layers[0].self_attn.q_proj.weight.data
    signed = (round_to_nearest(original, bits, group_size).codes(original).to(torch.int16) - 2 ** (bits - 1))
    signed = signed.to(torch.int8)
    expected = signed if format == "int-quantized" else pack_to_int32(signed, bits)
    assert torch.equal(linear.get_buffer(linear.CODES), expected)
    QuantizationConfig.model_validate(json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"])


def test_groups_must_divide_every_linear(tiny_checkpoint):
    model, _ = sparsegen.load(tiny_checkpoint)
    with pytest.raises(ValueError, match="cannot be cut into groups of 24 columns"):
        quantize_model(model, QuantizeConfig(method="rtn", group_size=24), progress=False)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # refused before any layer changed


def test_corrupted_or_mismatched_quantized_checkpoints_get_clear_errors(tiny_checkpoint, tmp_path):
    model, tokenizer = sparsegen.load(tiny_checkpoint)
    report = quantize_model(model, QuantizeConfig(method="rtn", group_size=16), progress=False)
    folder = tmp_path / "q"
    save_pruned(model, tokenizer, folder, report, "quantization.json")
    weights = folder / "model.safetensors"
    state = load_file(weights)
    config = json.loads((folder / "config.json").read_text())
    weights_scheme = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights_scheme["num_bits"] = 8  # the recorded scheme no longer matches the tensors
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="could not be read"):
        sparsegen.load(folder)
    weights_scheme["num_bits"], weights_scheme["symmetric"] = 4, False  # a scheme sparsegen does not rebuild
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="symmetric 4- or 8-bit"):
        sparsegen.load(folder)
    weights_scheme["symmetric"] = True
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    (folder / "config.json").write_text(json.dumps(config))  # inputs quantized, but not in the int-quantized format
    with pytest.raises(ValueError, match="dynamic per-token int8 inputs"):
        sparsegen.load(folder)
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in state.items() if "weight_scale" not in k}, weights)
    with pytest.raises(ValueError, match="do not match the layers"):
        sparsegen.load(folder)
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="corrupted"):
        sparsegen.load(folder)


def test_contextual_plans_refuse_quantized_models(tiny_checkpoint):
    from sparsegen.contextual import Contextual, attach

    model, _ = sparsegen.load(tiny_checkpoint)
    quantize_model(model, QuantizeConfig(method="rtn", group_size=16), progress=False)
    plan = Contextual(method="teal", info={"model_type": "llama"}, thresholds={"0.mlp.down_proj": 0.1})
    with pytest.raises(ValueError, match="quantized"):
        attach(model, plan)


def test_cli_quantize(tiny_checkpoint, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_DATA", str(corpus))
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(tiny_checkpoint), "--bits", "4", "--group-size", "16", "--nsamples", "4",
                 "--seqlen", "16", "--out", str(out)]) == 0
    assert "gptq int4, group 16" in capsys.readouterr().out
    report = json.loads((out / "quantization.json").read_text())
    assert report["method"] == "gptq" and report["nsamples"] == 4
    assert main(["ppl", "--windows", "--model", str(out), "--ctx", "16", "--text", str(corpus / "books/test")]) == 0
    assert "PPL" in capsys.readouterr().out
    assert main(["quantize", "--model", str(tiny_checkpoint), "--bits", "3", "--out", str(tmp_path / "x")]) == 2
    assert "bits must be one of 4, 8" in capsys.readouterr().err
    assert main(["quantize", "--model", str(tiny_checkpoint), "--method", "rtn", "--format", "int-quantized",
                 "--out", str(tmp_path / "a8")]) == 0
    assert "rtn int4, int8 inputs per token, group 128" in capsys.readouterr().out
    assert json.loads((tmp_path / "a8" / "quantization.json").read_text())["format"] == "int-quantized"
    assert main(["quantize", "--model", str(tiny_checkpoint), "--method", "rtn", "--format", "int-quantized",
                 "--bits", "8", "--out", str(tmp_path / "w8a8")]) == 0
    assert "rtn int8, int8 inputs per token, group row (W8A8's)" in capsys.readouterr().out


@pytest.mark.parametrize("group_size", [32, 0])  # 0: one group of the row's 128 columns
def test_bfloat16_int4_forward_uses_the_packed_kernel_and_matches_the_dequantized_weight(group_size, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(128, 48, bias=True)
    quantized = QuantLinear.from_linear(linear, linear.weight.data, round_to_nearest(linear.weight.data, 4, group_size))
    x = torch.randn(2, 3, 128, generator=generator).bfloat16()
    reference = F.linear(x.float(), quantized.dequantized(torch.float32), linear.bias)
    calls = []
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", lambda *a: calls.append(1) or kernel(*a))
    out = quantized(x)
    assert calls and out.dtype == torch.bfloat16 and out.shape == (2, 3, 48)
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)
    quantized.weight_scale.mul_(2)  # new weights (a checkpoint loaded in place): the kernel's copy follows
    torch.testing.assert_close(quantized(x).float(), 2 * reference - linear.bias.detach(), rtol=2e-2, atol=4e-2)


@pytest.mark.heavy
def test_cli_quantizes_a_random_shape_for_speed_measurements(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "--model", f"random:{tiny_checkpoint}", "--method", "rtn", "--group-size", "16",
                 "--out", str(out)]) == 0
    model, _ = sparsegen.load(out) if (out / "tokenizer.json").exists() else (None, None)
    assert model is None and json.loads((out / "config.json").read_text())["quantization_config"]
    assert main(["bench", "--model", str(out), "--dtype", "bfloat16", "--policies", "full", "--contexts", "16",
                 "--prefill", "synthetic", "--new-tokens", "2", "--warmup", "1"]) == 0  # no tokenizer needed
    assert main(["quantize", "--model", f"random:{tiny_checkpoint}", "--method", "gptq", "--out",
                 str(tmp_path / "g")]) == 2
    assert "use --method rtn" in capsys.readouterr().err


def test_the_default_group_size_is_the_largest_that_divides_every_linear():
    from sparsegen.quant.quantize import fitting_group_size
    from tests.kv.families import tiny_model

    model = tiny_model("llama")
    columns = {linear.in_features for layer in model.model.layers for linear in
               (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj)}
    size = fitting_group_size(model)
    assert size and all(c % size == 0 or c < size for c in columns)
    assert size == 128 or any(c % (2 * size) and c >= 2 * size for c in columns)  # the largest that fits
    report = quantize_model(model, QuantizeConfig(bits=4, method="rtn"))
    assert report["group_size"] == size
