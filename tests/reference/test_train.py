import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sparsegen.data
from sparsegen.reference.train import PRESETS, learning_rate, model_config, train_reference

TINY = dict(hidden_size=32, layers=2, heads=4, kv_heads=2, intermediate_size=64, context=32, batch_size=4,
            vocab_size=300, lr=3e-3)


@pytest.fixture
def data_env(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_DATA", str(corpus))
    monkeypatch.setattr(sparsegen.data, "CACHE_DIR", tmp_path / "cache")


def _train(tmp_path, name, steps, **kw):
    return train_reference(tmp_path / f"{name}-out", work_dir=tmp_path / f"{name}-work", compile=False,
                           steps=steps, checkpoint_every=2, **{**TINY, **kw})


def test_trains_exports_and_resumes_exactly(data_env, tmp_path):
    record = _train(tmp_path, "straight", steps=6)
    # the same run, stopped after 3 steps (a state is saved at the stop) and resumed
    assert _train(tmp_path, "resumed", steps=6, stop_after=3) is None
    assert not (tmp_path / "resumed-out").exists()
    _train(tmp_path, "resumed", steps=6)
    straight = AutoModelForCausalLM.from_pretrained(tmp_path / "straight-out")
    resumed = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed-out")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name

    assert record["params"] == sum(p.numel() for p in straight.parameters())
    assert record["training_tokens"] == 6 * 4 * 32
    assert straight.config.num_key_value_heads == 2 and straight.config.max_position_embeddings == 32
    assert straight.dtype == torch.float16  # exported in half precision
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "straight-out")
    assert tokenizer("it was").input_ids[0] == tokenizer.bos_token_id
    assert json.loads((tmp_path / "straight-out" / "training.json").read_text())["preset"] == "reference"
    saved = json.loads((tmp_path / "straight-out" / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "PreTrainedTokenizerFast" and "is_local" not in saved


def test_loss_falls(data_env, tmp_path):
    _train(tmp_path, "learn", steps=30)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "learn-work" / "log.jsonl").read_text().splitlines()]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_every_sample_starts_with_bos(data_env, tmp_path):
    import numpy as np

    from sparsegen.reference.train import TrainConfig, sample_batch

    cfg = TrainConfig(**{**TINY, "steps": 1})
    batch = sample_batch(np.arange(5, 1000, dtype=np.uint16), cfg, bos_id=0, rng=np.random.default_rng(0))
    assert batch.shape == (4, 32) and (batch[:, 0] == 0).all() and (batch[:, 1:] >= 5).all()


def test_changed_settings_refuse_to_resume(data_env, tmp_path):
    _train(tmp_path, "a", steps=2)
    with pytest.raises(ValueError, match="other settings"):
        train_reference(tmp_path / "a-out", work_dir=tmp_path / "a-work", compile=False,
                        **{**TINY, "steps": 2, "lr": 1e-4})


def test_schedule_and_presets():
    cfg = PRESETS["reference"]
    assert learning_rate(cfg, 0) < learning_rate(cfg, 49) == pytest.approx(cfg.lr)
    assert learning_rate(cfg, cfg.steps - 1) == pytest.approx(cfg.lr * cfg.min_lr_fraction, rel=1e-3)
    with pytest.raises(ValueError, match="unknown preset"):
        train_reference("x", preset="huge")


def test_relu_preset_differs_only_in_the_gate(tiny_tokenizer):
    relu, swiglu = PRESETS["reference-relu"], PRESETS["reference"]
    assert relu.act == "relu" and swiglu.act == "silu"
    assert {k: v for k, v in vars(relu).items() if k != "act"} == {k: v for k, v in vars(swiglu).items() if k != "act"}
    assert model_config(relu, tiny_tokenizer).hidden_act == "relu"


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_crafted_state_file_is_refused_and_never_run(data_env, tmp_path):
    """Resuming unpickled the state with weights_only=False: a crafted file ran code."""
    import pickle

    work = tmp_path / "evil-work"
    work.mkdir()
    marker = tmp_path / "ran"
    torch.save({"step": _RunsCode(marker)}, work / "train_state.pt")
    with pytest.raises(pickle.UnpicklingError):
        _train(tmp_path, "evil", steps=2)
    assert not marker.exists()
