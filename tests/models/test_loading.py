import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import sparsegen
from sparsegen.models import ModelLoadError


def test_local_checkpoint_round_trip(tiny_checkpoint):
    model, tokenizer = sparsegen.load(tiny_checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    ids = tokenizer("it was the age of wisdom", return_tensors="pt").input_ids
    assert ids[0, 0] == tokenizer.bos_token_id
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert not model.training
    assert model.dtype == torch.float32


def test_dtype_option(tiny_checkpoint):
    model, _ = sparsegen.load(tiny_checkpoint, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        sparsegen.load(tiny_checkpoint, dtype="float8")


def test_missing_hub_model_fails_fast_with_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="not a local folder and not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        sparsegen.load("no-such-org/no-such-model")


def test_unreachable_hub_is_one_error_not_retries(monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", refuse)
    with pytest.raises(ModelLoadError, match="unreachable"):
        sparsegen.load("no-such-org/no-such-model")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        sparsegen.load(tmp_path)


def test_corrupted_weights(tiny_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="corrupted"):
        sparsegen.load(broken)


def test_cuda_without_gpu_is_a_clear_error(tiny_checkpoint):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ModelLoadError, match="no CUDA GPU"):
        sparsegen.load(tiny_checkpoint, device="cuda")


def test_a_reshaping_this_version_cannot_rebuild_is_refused(tiny_checkpoint, tmp_path):
    import json

    folder = tmp_path / "future"
    shutil.copytree(tiny_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["sparsegen_hypernetwork"] = {"layers": [0]}  # written by some later version
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sparsegen_hypernetwork, which this version of sparsegen cannot rebuild"):
        sparsegen.load(folder)


def test_device_map_and_shards(tiny_checkpoint, tmp_path):
    """device_map goes to transformers (plain) or accelerate (rebuilt); a rebuilt checkpoint in several shards
    loads shard by shard to the same logits."""
    from sparsegen.quant import QuantizeConfig, quantize_model

    ids = torch.tensor([[0, 5, 6, 7, 8]])
    model, tokenizer = sparsegen.load(tiny_checkpoint)
    mapped, _ = sparsegen.load(tiny_checkpoint, device_map="cpu", tokenizer=False)
    assert torch.equal(mapped(ids).logits, model(ids).logits)
    quantize_model(model, QuantizeConfig(method="rtn", group_size=16), progress=False)
    model.save_pretrained(tmp_path / "q", max_shard_size="20KB")
    tokenizer.save_pretrained(tmp_path / "q")
    assert len(list((tmp_path / "q").glob("*.safetensors"))) > 2
    again, _ = sparsegen.load(tmp_path / "q", device_map="auto")
    assert torch.equal(again(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="device or device_map"):
        sparsegen.load(tiny_checkpoint, device="cuda", device_map="auto")


def test_every_rebuilder_is_named_and_resolves():
    """A checkpoint's reshaping key names its rebuilder ("module:function"): it resolves without any prior import."""
    from sparsegen.models.rebuild import REBUILDERS

    for key, rebuilder in REBUILDERS.items():
        for name in ("rebuild", "claims"):
            if getattr(rebuilder, name) is not None:
                module, _, function = getattr(rebuilder, name).partition(":")
                assert callable(getattr(__import__(module, fromlist=[function]), function)), (key, name)
