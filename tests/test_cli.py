import json
import subprocess
import sys
from pathlib import Path


from sparsegen.cli import main

INFO_KEYS = {"params", "layers", "heads", "kv_heads", "head_dim", "max_positions", "kv_bytes_per_token"}


def test_console_script_lists_subcommands():
    script = Path(sys.executable).parent / "sparsegen"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("info", "generate", "train-reference", "sinks", "bench", "prune"):
        assert command in out


def test_info_json(tiny_checkpoint, capsys):
    assert main(["info", str(tiny_checkpoint), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert INFO_KEYS <= set(info)
    assert (info["layers"], info["heads"], info["kv_heads"], info["head_dim"]) == (2, 4, 2, 8)


def test_info_table(tiny_checkpoint, capsys):
    assert main(["info", str(tiny_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "kv_bytes_per_token" in out and "LlamaForCausalLM" in out


def test_missing_model_is_one_line_and_exit_2(tmp_path, capsys):
    missing = tmp_path / "empty"
    missing.mkdir()
    assert main(["info", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no config.json" in err


def test_generate_is_greedy_and_deterministic(tiny_checkpoint, capsys):
    args = ["generate", "--model", str(tiny_checkpoint), "--prompt", "it was the", "--max-new-tokens", "12"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert first.startswith("it was the") and len(first) > len("it was the")


def test_generate_rejects_bad_lengths(tiny_checkpoint, capsys):
    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "x", "--max-new-tokens", "0"]) == 2
    assert "max_new_tokens" in capsys.readouterr().err
