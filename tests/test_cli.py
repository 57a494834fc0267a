import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparsegen.cli import main

INFO_KEYS = {"params", "layers", "heads", "kv_heads", "head_dim", "max_positions", "kv_bytes_per_token"}


@pytest.mark.heavy
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


def _bad_invocations(checkpoint: Path, tmp: Path) -> list[tuple[list[str], str]]:
    """``(argv, words in the error)``: mistakes a user can make, each to be answered in one line."""
    folder = tmp / "a-folder"
    folder.mkdir(exist_ok=True)
    a_file = tmp / "a-file"
    a_file.write_text("x")
    model = ["--model", str(checkpoint)]
    return [
        (["generate", *model, "--prompt-file", str(folder)], "a-folder"),
        (["generate", *model, "--prompt", "x", "--device", "banana"], "not a device"),
        (["generate", *model, "--prompt", "x", "--policy", "window", "--budget", "abc"], "budget"),
        (["generate", "--model", "/nonexistent/path", "--prompt", "x"], "does not exist"),
        (["generate", *model, "--prompt", "x", "--seed", str(2**70)], "seed"),
        (["generate", *model, "--prompt", "x", "--temperature", "nan"], "temperature"),
        (["generate", *model, "--prompt", "x", "--top-p", "0"], "top_p"),
        (["generate", *model, "--prompt", "x", "--policy", "streaming", "--budget", "0"], "budget"),
        (["generate", *model, "--prompt", "x", "--policy", "streaming", "--budget", "8", "--sinks", "9"], "sinks"),
        (["generate", *model, "--prompt", "x", "--policy", "teleport", "--budget", "8"], "unknown policy"),
        (["prune", *model, "--method", "magnitude", "--sparsity", "0.5", "--out", str(a_file)], "is a file"),
        (["prune", *model, "--method", "magnitude", "--sparsity", "0.5", "--pattern", "5:4", "--out",
          str(tmp / "p")], "pattern"),
        (["prune", *model, "--method", "magnitude", "--sparsity", "1.5", "--out", str(tmp / "p")], "sparsity"),
        (["ppl", *model, "--stream", "--text", str(tmp / "missing.txt")], "missing.txt"),
        (["serve", *model, "--max-batch", "0"], "positive integer"),
        (["serve", *model, "--max-queue", "-1"], "positive integer"),
        (["serve", *model, "--prefill-budget", "fast"], "positive integer, got 'fast'"),
        (["serve", *model, "--prefill-budget", "100000"], "or 'auto'"),
        (["quantize", *model, "--format", "gguf", "--out", str(tmp / "q")], "int-quantized"),
        (["serve", *model, "--max-new-tokens", "2000"], "max-tokens-limit"),
        (["info"], "model"),
        (["generate", *model, "--prompt", "x", "--max-new-tokens", "many"], "max-new-tokens"),
        (["generate", *model, "--prompt", "x", "--kv-bits", "3"], "kv-bits"),
        (["generate", *model, "--prompt", "x", "--kv-bits", "4", "--kv-residual", "-1"], "residual"),
        (["generate", *model, "--prompt", "x", "--kv-bits", "4", "--speculative", "window:8"], "kv_bits"),
        (["ppl", *model, "--windows", "--kv-bits", "4"], "--stream"),
        (["generate", *model, "--prompt", "x", "--context", str(tmp / "none.safetensors")], "sparsegen compress"),
        (["compress", *model, "--context-file", str(a_file), "--out", str(tmp / "c.pt")], "NAME.safetensors"),
        (["compress", *model, "--context-file", str(tmp / "missing.txt"), "--out", str(tmp / "c.safetensors")],
         "missing.txt"),
    ]


def test_compress_once_then_ask(tiny_checkpoint, tmp_path, capsys):
    """`sparsegen compress` saves what `generate --context` answers from: the context protocol's text."""
    import sparsegen

    text = tmp_path / "doc.txt"
    text.write_text("it was the best of times, it was the worst of times " * 8)
    saved = tmp_path / "doc.safetensors"
    model = ["--model", str(tiny_checkpoint)]
    assert main(["compress", *model, "--context-file", str(text), "--policy", "h2o", "--budget", "0.25",
                 "--out", str(saved), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["policy"] == "h2o" and summary["kv_tokens"] < summary["context_tokens"] and saved.is_file()
    loaded, tokenizer = sparsegen.load(tiny_checkpoint)
    for question in (" it was the age of", " the season of"):
        assert main(["generate", *model, "--context", str(saved), "--prompt", question, "--json",
                     "--max-new-tokens", "6"]) == 0
        got = json.loads(capsys.readouterr().out)
        expected = sparsegen.generate(loaded, tokenizer, context=text.read_text(), question=question,
                                      policy="h2o", budget=0.25, max_new_tokens=6)
        assert got["text"] == expected.text and got["prompt_tokens"] == expected.prompt_tokens[0]
    assert main(["generate", *model, "--context", str(saved), "--prompt", "x", "--policy", "window",
                 "--budget", "8"]) == 2
    assert "carries its policy" in capsys.readouterr().err


def test_every_bad_invocation_is_one_line_and_a_nonzero_exit(tiny_checkpoint, tmp_path, capsys):
    for argv, words in _bad_invocations(tiny_checkpoint, tmp_path):
        code = main(argv)
        err = "".join(line for line in capsys.readouterr().err.splitlines(keepends=True) if "%|" not in line)
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err and words in err, (argv, err)


def test_a_budget_far_above_the_sequence_allocates_what_the_sequence_needs(tiny_checkpoint, capsys):
    """`generate --budget 1000000000` tried to allocate the whole budget (256 GB on the reference model)."""
    from sparsegen.memory import current_rss

    before = current_rss()
    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "it was the", "--policy", "streaming",
                 "--budget", "1000000000", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("it was the") and current_rss() - before < 2**30


def test_kv_bits_quantize_the_cache_of_any_policy(tiny_checkpoint, capsys):
    """`generate --kv-bits 4` holds the same tokens in a fraction of the fp32 bytes, and says so (this checkpoint's
    8-dim heads: 4 bytes of codes + 4 of scale and zero per key, against 32)."""
    stats = {}
    for bits in ([], ["--kv-bits", "4", "--kv-residual", "0"]):
        assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "it was the " * 40, "--policy", "h2o",
                     "--budget", "0.5", "--max-new-tokens", "8", "--json", *bits]) == 0
        stats[bool(bits)] = json.loads(capsys.readouterr().out)["cache"]
    assert stats[True]["kv_bits"] == 4 and stats[True]["kv_tokens_peak"] == stats[False]["kv_tokens_peak"]
    assert stats[False]["kv_bytes_peak"] / stats[True]["kv_bytes_peak"] > 3.5


def test_compare_has_quantized_kv_rows(tiny_checkpoint, capsys):
    """`compare --policies h2o,h2o+kv8`: the same policy with its cache in 8 bits, side by side."""
    assert main(["compare", "--model", str(tiny_checkpoint), "--prompt", "it was the best of times " * 16,
                 "--policies", "h2o,h2o+kv8", "--budget", "48", "--max-new-tokens", "6", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows["h2o+kv8"]["cache"]["kv_bits"] == 8 and "kv_bits" not in rows["h2o"]["cache"]
    assert rows["h2o+kv8"]["kv_bytes_peak"] < rows["h2o"]["kv_bytes_peak"]
    assert main(["compare", "--model", str(tiny_checkpoint), "--prompt", "x", "--policies", "h2o+kvfour"]) == 2
    assert "POLICY+kvBITS" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench", "ruler"])
def test_compile_takes_a_mode_or_none_and_no_compile_turns_it_off(command, capsys):
    from sparsegen.cli import build_parser

    parse = build_parser().parse_args
    assert parse([command]).compile is None
    assert parse([command, "--compile"]).compile is True
    assert parse([command, "--compile", "whole"]).compile == "whole"
    assert parse([command, "--compile", "regional"]).compile == "regional"
    assert parse([command, "--no-compile"]).compile is False
    with pytest.raises(SystemExit):
        parse([command, "--compile", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err
