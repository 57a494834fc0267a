import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsegen.cli import main
from sparsegen.models.anatomy import decoder_layers, linears
from sparsegen.models.calibration import first_layer_inputs, run_layer
from sparsegen.pruning import METHODS, PruneConfig, prune_model
from tests.kv.families import FAMILIES, VOCAB, tiny_model


def _ids(n=8, length=24, seed=0):
    return torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("method", list(METHODS))  # every registered method
def test_every_family_prunes_every_linear_to_the_requested_sparsity(family, method):
    model = tiny_model(family)
    embeddings = model.get_input_embeddings().weight.clone()
    head = model.get_output_embeddings().weight.clone()
    report = prune_model(model, PruneConfig(method=method, sparsity=0.5, batch_size=4), _ids(), progress=False)
    pruned = [lin for layer in decoder_layers(model) for lin in linears(layer).values()]
    assert len(report["layers"]) == len(pruned) >= 2 * 4
    for linear in pruned:
        assert (linear.weight == 0).float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert report["achieved"] == pytest.approx(0.5, abs=0.005)
    assert torch.equal(model.get_input_embeddings().weight, embeddings)
    assert torch.equal(model.get_output_embeddings().weight, head)
    assert torch.isfinite(model(_ids(2)).logits).all()


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding and global layers get their own masks/RoPE
def test_layer_by_layer_forward_reproduces_the_model(family):
    model = tiny_model(family)
    ids = _ids(4)
    hidden = model(ids, output_hidden_states=True).hidden_states
    [(x, kwargs)] = first_layer_inputs(model, ids, batch_size=4)
    assert torch.equal(x, hidden[0])
    for index, layer in enumerate(decoder_layers(model)[:-1]):  # the last output is normed by the model
        x = run_layer(layer, x, kwargs[index])
        torch.testing.assert_close(x, hidden[index + 1], rtol=0, atol=1e-6)


def test_n_m_pattern_on_a_model():
    model = tiny_model("qwen2")
    report = prune_model(model, PruneConfig(method="wanda", pattern="2:4"), _ids(), progress=False)
    for layer in decoder_layers(model):
        for linear in linears(layer).values():
            groups = (linear.weight == 0).view(linear.weight.shape[0], -1, 4)
            assert bool((groups.sum(-1) >= 2).all())
    assert report["requested"] == 0.5


def test_pattern_that_does_not_divide_a_layer_is_refused():
    with pytest.raises(ValueError, match="multiple of 64"):
        prune_model(tiny_model("llama"), PruneConfig(method="magnitude", pattern="2:64"), progress=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="obs", sparsity=0.5), "unknown pruning method"),
    (dict(method="wanda"), "exactly one"),
    (dict(method="wanda", sparsity=0.5, pattern="2:4"), "exactly one"),
    (dict(method="wanda", sparsity=1.0), r"in \[0, 1\)"),
    (dict(method="wanda", pattern="4:2"), "N must"),
])
def test_bad_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PruneConfig(**kwargs)


def test_cli_prune_saves_a_loadable_checkpoint(tiny_checkpoint, corpus, tmp_path, capsys):
    out = tmp_path / "pruned"
    args = ["prune", "--model", str(tiny_checkpoint), "--method", "sparsegpt", "--sparsity", "0.5",
            "--calib", str(corpus / "books/train"), "--nsamples", "4", "--seqlen", "32", "--out", str(out)]
    assert main(args) == 0
    report = json.loads((out / "sparsity.json").read_text())
    assert report["method"] == "sparsegpt" and report["achieved"] == pytest.approx(0.5, abs=0.005)
    assert report["calibration"].endswith("books/train") and report["nsamples"] == 4
    plain = AutoModelForCausalLM.from_pretrained(out)
    q = plain.model.layers[0].self_attn.q_proj.weight
    assert (q == 0).float().mean().item() == pytest.approx(0.5, abs=0.02)
    assert main(args) == 2 and "not empty" in capsys.readouterr().err
    assert main(args + ["--force"]) == 0
    assert main([*args[:-2], "--out", str(tiny_checkpoint)]) == 2
    assert "input model's own folder" in capsys.readouterr().err


def test_the_python_api_saves_what_the_cli_saves(tiny_checkpoint, corpus, tmp_path):
    """Same dtype (the source checkpoint's, not the float32 it ran in) and the same files."""
    import json

    import sparsegen
    from sparsegen.cli import main
    from sparsegen.pruning import PruneConfig, prune_model, save_pruned

    half = tmp_path / "half"
    model, tokenizer = sparsegen.load(tiny_checkpoint)
    model.half().save_pretrained(half)
    tokenizer.save_pretrained(half)
    assert main(["prune", "--model", str(half), "--method", "magnitude", "--sparsity", "0.5", "--out",
                 str(tmp_path / "cli")]) == 0
    model, tokenizer = sparsegen.load(half)
    assert model.dtype == torch.float32 and model.source_dtype == torch.float16
    report = prune_model(model, PruneConfig(method="magnitude", sparsity=0.5), progress=False)
    save_pruned(model, tokenizer, tmp_path / "api", report)
    files = lambda folder: sorted(p.name for p in folder.iterdir())  # noqa: E731
    assert files(tmp_path / "api") == files(tmp_path / "cli")
    for folder in ("api", "cli"):
        assert json.loads((tmp_path / folder / "config.json").read_text())["dtype"] == "float16"
    sizes = [(tmp_path / way / "model.safetensors").stat().st_size for way in ("api", "cli")]
    assert sizes[0] == sizes[1]


def test_a_pruned_models_report_travels_into_its_quantized_copy_by_the_api_as_by_the_cli(tiny_checkpoint, tmp_path):
    import json

    import sparsegen
    from sparsegen.cli import main
    from sparsegen.pruning import save_pruned
    from sparsegen.quant import QuantizeConfig, quantize_model

    pruned = tmp_path / "pruned"
    assert main(["prune", "--model", str(tiny_checkpoint), "--method", "magnitude", "--sparsity", "0.5", "--out",
                 str(pruned)]) == 0
    assert main(["quantize", "--model", str(pruned), "--bits", "8", "--method", "rtn",
                 "--out", str(tmp_path / "cli")]) == 0
    model, tokenizer = sparsegen.load(pruned)
    save_pruned(model, tokenizer, tmp_path / "api", quantize_model(model, QuantizeConfig(bits=8, method="rtn")),
                "quantization.json")
    files = lambda folder: sorted(p.name for p in folder.iterdir())  # noqa: E731
    assert files(tmp_path / "api") == files(tmp_path / "cli") and "sparsity.json" in files(tmp_path / "api")
    for folder in ("api", "cli"):
        assert json.loads((tmp_path / folder / "sparsity.json").read_text()) == \
            json.loads((pruned / "sparsity.json").read_text())
