"""``bench-serve --spawn``: real servers started per policy and cap, long conversations against them, one row each."""

import json

import pytest

from sparsegen.bench.spawn import policy_flags
from sparsegen.cli import main


def test_policy_specs_read_budgets_as_tokens_or_fractions_of_the_context():
    assert policy_flags("full", 4096) == ["--policy", "full"]
    assert policy_flags("h2o:0.2", 4096) == ["--policy", "h2o", "--budget", "819"]
    assert policy_flags("streaming:1024", 4096) == ["--policy", "streaming", "--budget", "1024"]
    with pytest.raises(ValueError, match="NAME:BUDGET"):
        policy_flags("h2o:lots", 4096)


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
