"""`sparsegen export-window`: a checkpoint whose layers are all sliding windows (vLLM serves it in bounded KV memory;
`make test-vllm` checks vLLM's tokens against sparsegen's window policy)."""

import json

import pytest
from safetensors.torch import load_file

from sparsegen.cli import main
from sparsegen.models.windowed import windowed_config


def test_export_window_writes_a_windowed_config_and_the_same_weights(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "windowed"
    assert main(["export-window", "--model", str(tiny_checkpoint), "--window", "64", "--max-context", "4096",
                 "--out", str(out)]) == 0
    assert "--policy window --budget 63" in capsys.readouterr().out
    config, source = (json.loads((folder / "config.json").read_text()) for folder in (out, tiny_checkpoint))
    assert config["sliding_window"] == 64 and config["layer_types"] == ["sliding_attention"] * 2
    assert config["max_position_embeddings"] == 4096
    assert {k: v for k, v in config.items() if k not in ("sliding_window", "use_sliding_window", "layer_types",
                                                         "max_window_layers", "max_position_embeddings")} == \
        {k: v for k, v in source.items() if k not in ("sliding_window", "max_position_embeddings")}
    weights, original = load_file(out / "model.safetensors"), load_file(tiny_checkpoint / "model.safetensors")
    assert weights.keys() == original.keys() and all(weights[k].equal(original[k]) for k in weights)
    assert (out / "tokenizer.json").exists()
    assert main(["export-window", "--model", str(tiny_checkpoint), "--window", "64", "--out", str(out)]) != 0
    assert "pass --force" in capsys.readouterr().err


@pytest.mark.parametrize("config, window, max_context, message", [
    ({"model_type": "gpt_neox", "num_hidden_layers": 2}, 64, None, "cannot be windowed"),
    ({"model_type": "llama", "num_hidden_layers": 2}, 1, None, ">= 2"),
    ({"model_type": "llama", "num_hidden_layers": 2}, 64, 32, "shorter than the window"),
])
def test_windowed_config_refuses_what_an_engine_could_not_serve(config, window, max_context, message):
    with pytest.raises(ValueError, match=message):
        windowed_config(config, window, max_context)
