import json

import matplotlib.image
import pytest
import torch

import sparsegen
from sparsegen.bench import decode
from sparsegen.bench.fill import fill_random
from sparsegen.cli import main
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, KVQuantization, make_policy
from sparsegen.models import load
from sparsegen.models.spec import kv_bytes_per_token

REQUIRED = {"policy", "context", "batch", "ms_per_token", "tokens_per_s", "peak_kv_bytes", "prefill_seconds",
            "ms_per_token_p90", "peak_memory_bytes", "roofline_fraction", "torch", "transformers", "dtype", "threads"}


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    return load(tiny_checkpoint)[0]


@pytest.mark.heavy
def test_bench_cli_writes_rows_json_and_plot(tiny_checkpoint, tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["bench", "--model", str(tiny_checkpoint), "--policies", "dense,full,window,streaming,h2o,recompute",
                 "--contexts", "48,96", "--budget", "32", "--new-tokens", "4", "--warmup", "1", "--chunk-size", "16",
                 "--batch", "1,2", "--recompute-tokens", "2", "--memory-limit", "1GiB", "--json", str(out),
                 "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "speed-up over full" in printed and "speed-up over recompute" in printed
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 * 2 * 2
    per_token = kv_bytes_per_token(load(tiny_checkpoint)[0].config, 4)
    for row in rows:
        assert REQUIRED <= set(row), row
        assert row["ms_per_token"] > 0 and row["tokens_per_s"] > 0 and row["timed_tokens"] >= 2
        if row["policy"] in ("full", "dense"):  # everything fed: context, warm-up, timed, sync- and break-counted steps
            assert row["peak_kv_bytes"] == (row["context"] + 1 + 4 + decode.SYNC_STEPS + 1) * per_token * row["batch"]
        if row["policy"] != "recompute":
            assert row["host_syncs_per_token"] >= 0 and row["graph_breaks"] >= 0 and row["compile_seconds"] is None
        if row["policy"] == "recompute":
            assert row["peak_kv_bytes"] == 32 * per_token * row["batch"] and row["prefill_seconds"] is None
        elif row["policy"] not in ("full", "dense"):  # the budget plus one prefill chunk, whatever the context
            assert row["peak_kv_bytes"] == (32 + 16) * per_token * row["batch"]
            assert row["kv_tokens"] == 32 + 1
        assert row["max_batch_at_limit"] == int((2**30 - sum(
            p.numel() * 4 for p in load(tiny_checkpoint)[0].parameters())) // (row["peak_kv_bytes"] / row["batch"]))
    assert matplotlib.image.imread(png).shape[2] in (3, 4)


def test_a_result_names_the_cpu_and_its_vector_extensions(tmp_path):
    """A bench's environment says which vector instructions the CPU has: FBGEMM and a native llama.cpp build use
    AVX-512 and VNNI where they are, so a result on such a CPU is not one on an AVX2-only CPU."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 fma f16c avx512f avx512_vnni\n\n"
                    "processor\t: 1\nmodel name\t: another\nflags\t\t: fpu\n")
    name, flags = decode._cpu_info(str(info))
    assert name.startswith("AMD EPYC (") and flags == ["avx2", "fma", "f16c", "avx512f", "avx512_vnni"]
    assert decode._cpu_info(str(tmp_path / "missing"))[1] == []


def test_the_roofline_counts_each_layers_own_slots():
    """Gemma 3's sliding layers read their window, its global layer the whole context: a step's K/V bytes are each
    layer's own slots (their mean times all layers' bytes a token), not the largest layer's times all, which put
    Gemma-3-270M's full cache at 8K at 121% of its roofline. Dense (transformers' cache) and sparsegen's alike."""
    from transformers import DynamicCache

    from tests.kv.families import tiny_model as family_model

    model = family_model("gemma3")  # two sliding layers (window 6: 5 held before a step) and one global
    cache = EvictionCache(model, make_policy("full"))
    fill_random(cache, 1, 20, kv_heads=model.config.num_key_value_heads, head_dim=16, dtype=torch.float32,
                      device=torch.device("cpu"))
    assert cache.held_tokens() == [5, 5, 20]
    assert decode._attended_tokens(cache, compiled=False) == (5 + 5 + 20) / 3 + 1
    dense = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.zeros(1, 20, dtype=torch.long), past_key_values=dense)
    assert decode._attended_tokens(dense, compiled=False) == (5 + 5 + 20) / 3 + 1


def test_synthetic_prefill_holds_what_the_policy_would(tiny_model):
    for name, budget, expected in (("streaming", 8, {0, 1, 2, 3, 16, 17, 18, 19}), ("window", 8, set(range(12, 20))),
                                   ("full", None, set(range(20)))):
        cache = EvictionCache(tiny_model, make_policy(name, budget))
        fill_random(cache, 2, 20, kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))
        for layer in cache.layers:
            for row in layer.index[:, :, : layer.used].reshape(-1, layer.used):
                assert set(row.tolist()) == expected
    h2o = EvictionCache(tiny_model, make_policy("h2o", 8))
    fill_random(h2o, 1, 20, kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))
    layer = h2o.layers[0]
    held = layer.index[0, :, : layer.used]
    assert layer.used == 8 and all({16, 17, 18, 19} <= set(head.tolist()) for head in held)
    # the heavy half is each head's top accumulated attention among the older tokens
    older = layer.attention[0, :, : layer.used].masked_fill(held >= 16, float("inf"))
    assert older.isfinite().sum().item() == 2 * 4


@pytest.mark.parametrize("name", ["knorm", "keydiff", "lagkv"])
def test_synthetic_prefill_of_a_policy_reading_keys_keeps_what_it_chooses_from_them(tiny_model, name):
    """The held keys and values are the ones the policy chose by (knorm: the smallest key norms of all 40)."""
    cache = EvictionCache(tiny_model, make_policy(name, 12))
    fill_random(cache, 2, 40, kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"),
                      generator=torch.Generator().manual_seed(0))
    layer = cache.layers[0]
    assert layer.used == 12 and layer.valid[:, :, :12].all()
    if name == "knorm":
        norms = layer.keys[:, :, :12].norm(dim=-1)
        assert (norms.max(-1).values < 3.2).all()  # 12 smallest of 40 eight-dimensional normal norms
    if name == "lagkv":  # the held tokens keep the scores they were chosen by: set where the next partition is whole
        index = layer.index[:, :, :12]
        scored = (index >= 4) & (index < 38)  # 4 sinks, partitions of 2: the last two of 40 tokens not scored yet
        assert torch.equal(layer.memo[:, :, :12].isfinite().all(-1), scored)


@pytest.mark.heavy
def test_synthetic_and_real_prefill_leave_the_same_state(tiny_model):
    policy = make_policy("streaming", 16, sinks=2)
    rows = {prefill: decode.measure(decode.Setup(model=tiny_model, model_name="tiny", random_weights=False,
                                                 new_tokens=3, warmup=1, chunk_size=8, prefill=prefill),
                                    "streaming", policy, 40, 1)
            for prefill in ("real", "synthetic")}
    assert rows["real"]["kv_tokens"] == rows["synthetic"]["kv_tokens"] == 17
    assert rows["synthetic"]["prefill_seconds"] is None and rows["real"]["prefill_seconds"] > 0
    setup = decode.Setup(model=tiny_model, model_name="tiny", random_weights=False, new_tokens=3, warmup=1,
                         prefill="synthetic")
    dense = decode.measure(setup, "dense", None, 40, 2)
    assert dense["kv_tokens"] == (42 + 44) / 2  # held + the new token, at the first and the last timed step
    assert dense["peak_kv_bytes"] == (44 + decode.SYNC_STEPS + 1) * kv_bytes_per_token(tiny_model.config, 4) * 2


def test_an_eager_setup_times_a_low_bit_model_eagerly(tiny_checkpoint, monkeypatch):
    """``Setup.compiled`` None is bench's --no-compile: no step compiles, though low-bit weights compile by default
    (a DecodeStep's own None)."""
    from sparsegen.engine import step as step_module

    packed = sparsegen.load(str(tiny_checkpoint), weights="int8")[0]
    assert step_module.compiles_by_default(packed)
    monkeypatch.setattr(step_module, "_compiled", lambda *a, **k: pytest.fail("a step compiled"))
    setup = decode.Setup(model=packed, model_name="tiny", random_weights=False, new_tokens=2, warmup=1,
                         compiled=step_module.compile_mode(packed, False))
    row = decode.measure(setup, "full", make_policy("full"), 16, 1)
    assert row["compiled_share"] == 0 and row["compile_seconds"] is None


def test_a_measurement_that_cannot_fit_is_skipped_not_run(tiny_model, monkeypatch):
    monkeypatch.setattr(decode, "available_bytes", lambda device: 1000)
    setup = decode.Setup(model=tiny_model, model_name="tiny", random_weights=False, new_tokens=2)
    row = decode.measure(setup, "full", make_policy("full"), 4096, 8)
    assert "GiB free" in row["skipped"] and "ms_per_token" not in row


@pytest.mark.parametrize("argv, message", [
    (["--policies", "streaming"], "is needed for every policy"),
    (["--policies", "full", "--contexts", "1k"], "comma-separated whole numbers"),
    (["--policies", "full", "--batch", "0"], "positive whole numbers"),
    (["--policies", "streaming", "--budget", "0"], "budget must be a positive"),
    (["--policies", "streaming", "--budget", "8", "--sinks", "8"], "smaller than the budget"),
    (["--policies", "nope", "--budget", "8"], "unknown policy"),
    (["--policies", "full", "--memory-limit", "lots"], "memory size"),
    (["--policies", "full+kvhalf"], "POLICY+kvBITS"),
    (["--policies", "full+kv3"], "one of 16, 8, 4, 2"),
])
def test_bench_bad_input(tiny_checkpoint, capsys, argv, message):
    assert main(["bench", "--model", str(tiny_checkpoint), "--contexts", "16", *argv]) == 2
    assert message in capsys.readouterr().err


def test_repeats_pool_the_steps_of_interleaved_runs(tiny_model, monkeypatch):
    setup = decode.Setup(model=tiny_model, model_name="tiny", random_weights=False, new_tokens=3, warmup=1,
                         chunk_size=8, repeats=2)
    counts = []  # the checks (host syncs, graph breaks) run on a row's first measurement only
    monkeypatch.setattr(DecodeStep, "graph_breaks", lambda self, *args: counts.append(args) or 0)
    rows = decode.run(setup, [("window", lambda: make_policy("window", 8)), ("recompute", lambda: 8)], [16], [1])
    assert [r["policy"] for r in rows] == ["window", "recompute"]
    assert rows[0]["repeats"] == 2 and rows[0]["timed_tokens"] == 6 and len(rows[0]["step_seconds"]) == 6
    assert len(counts) == 1 and rows[0]["graph_breaks"] == 0 and rows[0]["host_syncs_per_token"] == 0
    assert rows[1]["timed_tokens"] == 2 * setup.recompute_tokens and rows[1]["roofline_fraction"] is None


@pytest.mark.heavy
def test_bench_compares_several_models(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "two.json"
    assert main(["bench", "--model", f"{tiny_checkpoint},random:{tiny_checkpoint}", "--policies", "full",
                 "--contexts", "16", "--new-tokens", "2", "--warmup", "0", "--json", str(out),
                 "--plot", str(tmp_path / "two.png")]) == 0
    assert f"speed-up of random:{tiny_checkpoint} over {tiny_checkpoint}" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["random_weights"] for r in rows] == [False, True]


@pytest.mark.parametrize("family, modules", [("llama", 2), ("opt", 4)])
def test_mlp_timer_times_each_layers_mlp_and_the_contextual_predictors(family, modules):
    from sparsegen.bench.decode import MLPTimer
    from sparsegen.contextual import attach, detach
    from tests.contextual.test_runtime import dejavu_plan
    from tests.kv.families import tiny_model

    model = tiny_model(family)
    timer = MLPTimer(model)
    assert len(timer.handles) == 2 * modules  # a pre- and a post-hook on each timed module
    model(torch.ones(1, 4, dtype=torch.long))
    timer.step(timed=True)
    assert timer.close() > 0 and not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    attach(model, dejavu_plan(model, 0.5))
    assert len(MLPTimer(model).handles) == 2 * (modules + 2)  # + one MLP predictor per layer
    detach(model)


@pytest.mark.heavy
def test_shared_slot_and_quantized_caches_measure_what_they_hold(tiny_model):
    """adakv's synthetic prefill holds its mean per head in one shared row; --kv-bits rows report the codes' bytes."""
    rows = {}
    for bits in (None, KVQuantization(4, 0)):
        setup = decode.Setup(model=tiny_model, model_name="tiny", random_weights=False, new_tokens=2, warmup=1,
                             prefill="synthetic", kv_bits=bits)
        for name in ("h2o", "adakv"):
            rows[name, bits is None] = decode.measure(setup, name, make_policy(name, 12), 40, 2)
    for plain in (True, False):
        assert rows["adakv", plain]["kv_tokens"] == rows["h2o", plain]["kv_tokens"] == 13
    assert rows["adakv", True]["peak_kv_bytes"] == rows["h2o", True]["peak_kv_bytes"]
    # (quantized: adakv's heads share one row of channel scales, where h2o keeps one per head)
    assert rows["adakv", False]["peak_kv_bytes"] < rows["h2o", False]["peak_kv_bytes"]
    assert rows["h2o", False]["peak_kv_bytes"] < rows["h2o", True]["peak_kv_bytes"] / 2
    assert rows["h2o", False]["bytes_per_step"] < rows["h2o", True]["bytes_per_step"]


@pytest.mark.heavy
def test_a_policy_row_with_kv16_holds_its_cache_in_float16_beside_the_plain_row(tiny_checkpoint, tmp_path):
    out = tmp_path / "kv16.json"
    assert main(["bench", "--model", str(tiny_checkpoint), "--policies", "h2o,h2o+kv16", "--budget", "12",
                 "--contexts", "40", "--new-tokens", "2", "--warmup", "0", "--prefill", "synthetic",
                 "--json", str(out)]) == 0
    plain, half = json.loads(out.read_text())["rows"]
    assert (plain["policy"], plain["kv_bits"], half["policy"], half["kv_bits"]) == ("h2o", None, "h2o+kv16", 16)
    assert plain["kv_tokens"] == half["kv_tokens"] and half["budget"] == 12
    assert 2 * half["peak_kv_bytes"] == plain["peak_kv_bytes"]
    assert half["bytes_per_step"] < plain["bytes_per_step"]


@pytest.mark.heavy
def test_bench_times_the_compiled_step(tiny_checkpoint, tmp_path):
    """--compile times the compiled step (every timed step compiled) and still counts its syncs and graph breaks
    (off CUDA on the eager step's code: dynamo does not run under the counting dispatch mode)."""
    out = tmp_path / "c.json"
    assert main(["bench", "--model", str(tiny_checkpoint), "--policies", "streaming", "--contexts", "40",
                 "--budget", "16", "--sinks", "2", "--new-tokens", "3", "--warmup", "1", "--compile",
                 "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["compiled_share"] == 1.0 and row["host_syncs_per_token"] == 0 and row["graph_breaks"] == 0
    assert row["compile_seconds"] > row["ms_per_token"] / 1000  # the first compiled call compiled


def test_each_row_takes_its_roofline_against_its_own_bandwidth_probe(tiny_model, monkeypatch):
    """A shared machine's bandwidth drifts between rows: each row is probed just before it is measured, and repeats
    pool their turns' probes (the median)."""
    probes = iter([10e9, 30e9, 20e9, 40e9])
    monkeypatch.setattr(decode, "measure_bandwidth", lambda *args, **kwargs: next(probes))
    monkeypatch.setattr(DecodeStep, "graph_breaks", lambda self, *args: 0)
    setup = decode.Setup(model=tiny_model, model_name="tiny", random_weights=False, new_tokens=3, warmup=1,
                         chunk_size=8, repeats=2, bandwidth=99e9, prefill="synthetic")
    policies = [("window", lambda: make_policy("window", 8)), ("full", lambda: make_policy("full", None))]
    rows = decode.run(setup, policies, [16], [1])
    assert [r["bandwidth_gb_s"] for r in rows] == [15.0, 35.0]  # (window: 10 and 20; full: 30 and 40)
    for row in rows:
        bound = row["bandwidth_gb_s"] * 1e9 / row["bytes_per_step"]
        assert row["roofline_fraction"] == pytest.approx(row["tokens_per_s"] / bound)
