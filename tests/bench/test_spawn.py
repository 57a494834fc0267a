"""``bench-serve --spawn``: real servers started per policy and cap, long conversations against them, one row each."""

import json
from pathlib import Path

import pytest

from sparsegen.bench.spawn import policy_flags
from sparsegen.cli import main


def test_policy_specs_read_budgets_as_tokens_or_fractions_of_the_context():
    assert policy_flags("full", 4096) == ["--policy", "full"]
    assert policy_flags("h2o:0.2", 4096) == ["--policy", "h2o", "--budget", "819"]
    assert policy_flags("streaming:1024", 4096) == ["--policy", "streaming", "--budget", "1024"]
    with pytest.raises(ValueError, match="NAME:BUDGET"):
        policy_flags("h2o:lots", 4096)


@pytest.mark.heavy
def test_spawned_servers_serve_every_policy_under_the_cap(tmp_path, capsys):
    """The reference model under a cap of two full sessions: full admits two, a small h2o budget more, nobody
    fails, the K/V bytes stay under the cap, and a cap that holds no session is a row of its own."""
    out, png = tmp_path / "spawn.json", tmp_path / "spawn.png"
    assert main(["bench-serve", "--spawn", "--model", "reference", "--policies", "full,h2o:0.25",
                 "--kv-memory", "1MiB,2.5MiB", "--context", "384", "--sessions", "4", "--turns", "2",
                 "--max-tokens", "8", "--chunk-size", "32", "--json", str(out), "--plot", str(png)]) in (0, None)
    rows = {(row["policy"], row["kv_memory_bytes"]): row for row in json.loads(out.read_text())["rows"]}
    assert "holds no session" in rows["full", 2**20]["skipped"]
    full, h2o = rows["full", 2.5 * 2**20], rows["h2o:0.25", 2.5 * 2**20]
    assert full["sessions_admitted"] == 2 and h2o["sessions_admitted"] == 4
    for row in (full, h2o):
        assert row["failed"] == 0 and row["requests"] == 8 and 8 <= row["completion_tokens"] <= 8 * 8
        assert 0 < row["kv_bytes_peak"] <= 2.5 * 2**20 and row["decode_tokens_per_s"] > 0
        assert row["itl_p50_s"] > 0 and row["ttft_p99_s"] >= row["ttft_p50_s"]
    assert h2o["throughput_ratio_vs_full"] == pytest.approx(h2o["decode_tokens_per_s"] / full["decode_tokens_per_s"],
                                                            abs=0.01)
    assert png.stat().st_size > 0 and "the cap holds no session" in capsys.readouterr().out


def test_each_policys_row_is_saved_as_it_ends(tmp_path, monkeypatch):
    """A run cut off in its second policy (a crash, a Ctrl-C) keeps the first policy's row in the JSON."""
    from sparsegen.bench import spawn

    def serve_one(setup, spec, cap, openings, log):
        if spec != "full":
            raise KeyboardInterrupt
        return {"policy": spec, "kv_memory_bytes": cap, "sessions_admitted": 2, "decode_tokens_per_s": 1.0,
                "failed": 0, "server_errors": 0}

    monkeypatch.setattr(spawn, "serve_one", serve_one)
    out = tmp_path / "spawn.json"
    with pytest.raises(KeyboardInterrupt):
        main(["bench-serve", "--spawn", "--model", "reference", "--policies", "full,h2o:0.25", "--kv-memory", "1MiB",
              "--context", "384", "--sessions", "2", "--turns", "1", "--json", str(out)])
    assert [row["policy"] for row in json.loads(out.read_text())["rows"]] == ["full"]


def test_a_chunk_of_several_tokens_counts_as_that_many_gaps():
    from sparsegen.bench.spawn import token_gaps

    assert token_gaps([0.0, 1.0, 3.0, 3.5], [1, 1, 2, 1]) == [1.0, 1.0, 1.0, 0.5]
    assert token_gaps([2.0], [3]) == []  # the first chunk's wait is the time to first token


def test_streamed_throughput_counts_tokens_over_the_time_any_reply_streamed():
    from sparsegen.bench.spawn import streamed_tokens_per_s

    # two replies overlapping in [1, 2], one alone later: busy 0-3 and 5-6 = 4 s, tokens after each first: 4+2+2
    replies = [{"streamed": (0.0, 2.0, 4)}, {"streamed": (1.0, 3.0, 2)}, {"streamed": (5.0, 6.0, 2)},
               {"streamed": None}]
    assert streamed_tokens_per_s(replies) == 2.0
    assert streamed_tokens_per_s([{"streamed": (1.0, 1.0, 0)}]) is None  # one token each: no streaming time


def test_llamacpps_own_counters_and_kv_size_are_read_from_its_output():
    from sparsegen.bench.llamacpp import server_kv_bytes
    from sparsegen.bench.spawn import _prometheus

    log = ("llama_kv_cache:        CPU KV buffer size =    48.00 MiB\n"
           "llama_kv_cache: size =   48.00 MiB (  8192 cells,   3 layers,  1/1 seqs), K (f16):   24.00 MiB\n"
           "llama_kv_cache:        CPU KV buffer size =    22.50 MiB\n")  # a global and a sliding-window cache
    assert server_kv_bytes(log) == int(70.5 * 2**20)
    with pytest.raises(RuntimeError, match="no KV buffer size"):
        server_kv_bytes("loading model\n")
    metrics = ("# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
               "llamacpp:prompt_tokens_total 4096\nllamacpp:n_busy_slots_per_decode 3.5\n")
    assert _prometheus(metrics) == {"prompt_tokens_total": 4096.0, "n_busy_slots_per_decode": 3.5}


def test_the_llamacpp_baseline_without_its_server_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    assert main(["bench-serve", "--spawn", "--model", "reference", "--kv-memory", "1MiB",
                 "--baseline", "llama.cpp"]) == 2


def test_the_llamacpp_baseline_runs_with_its_prompt_cache_off_and_on_and_nothing_else_differs(tmp_path):
    from sparsegen.bench.spawn import LLAMACPP_PROMPT_CACHE, SpawnSetup, llamacpp_server_command

    setup = SpawnSetup("smollm2", ["full"], [2**26], context=4096, threads=2, chunk_size=128)
    off, on = (llamacpp_server_command(Path("llama-server"), Path("m.gguf"), setup, 3, 8080,
                                       LLAMACPP_PROMPT_CACHE[name]) for name in ("llama.cpp", "llama.cpp+cache"))
    at = off.index("--cache-ram")
    assert off[at + 1] == "0" and "--cache-ram" not in on and off[:at] + off[at + 2:] == on
    assert on[on.index("-c") + 1] == str(3 * 4096) and on[on.index("-np") + 1] == "3" and "--no-kv-unified" in on


def _llama_server() -> bool:
    from sparsegen.bench.llamacpp import server_binary

    try:
        return server_binary() is not None
    except ValueError:
        return False


@pytest.mark.heavy
@pytest.mark.skipif(not _llama_server(), reason="llama-server is not built (make llama-server)")
def test_llamacpps_server_runs_under_the_same_cap_and_clients(tmp_path):
    """llama.cpp's server on SmolLM2's GGUF under a cap of two of its sessions: two slots, every reply served, its
    K/V what the cap holds, the same client-side measures as sparsegen's rows."""
    out = tmp_path / "spawn.json"
    assert main(["bench-serve", "--spawn", "--model", "smollm2", "--policies", "full", "--kv-memory", "64MiB",
                 "--context", "512", "--sessions", "3", "--turns", "2", "--max-tokens", "8", "--chunk-size", "128",
                 "--baseline", "llama.cpp", "--serve-arg=--no-compile", "--json", str(out)]) in (0, None)
    rows = {row["policy"]: row for row in json.loads(out.read_text())["rows"]}
    llama = rows["llama.cpp"]
    per_session = llama["kv_bytes_per_session"]
    assert llama["sessions_admitted"] == min(3, 64 * 2**20 // per_session) >= 1
    assert llama["failed"] == 0 and llama["requests"] == 6 and llama["completion_tokens"] == 6 * 8
    assert llama["kv_bytes_peak"] == llama["sessions_admitted"] * per_session <= 64 * 2**20
    assert llama["streamed_tokens_per_s"] > 0 and llama["tokens_per_s"] > 0 and llama["decode_tokens_per_s"] is None
    assert rows["full"]["streamed_tokens_per_s"] > 0 and llama["streamed_ratio_vs_full"] > 0
    cached = rows["llama.cpp+cache"]  # its default prompt cache on: the same slots, every reply served
    assert not llama["prompt_cache_in_ram"] and cached["prompt_cache_in_ram"]
    assert cached["sessions_admitted"] == llama["sessions_admitted"] and cached["failed"] == 0
    assert cached["completion_tokens"] == 6 * 8
