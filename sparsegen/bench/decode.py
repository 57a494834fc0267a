"""Decode latency, throughput and memory of each KV policy against context length and batch.

Two baselines sit beside the policies: ``dense`` is transformers' own ``DynamicCache`` (what a user runs
without sparsegen) and ``recompute`` re-encodes the last ``budget`` tokens from scratch for every new token
(the sliding-window-with-recomputation baseline of StreamingLLM). ``full`` is sparsegen's cache keeping
everything, so ``full`` vs a policy isolates what eviction changes.

The decode loop is our own (one forward per token, greedy), timed per step after ``warmup`` steps;
on CUDA with events and synchronisation.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import transformers
from transformers import DynamicCache

from sparsegen.bench.fill import fill_random
from sparsegen.bench.llamacpp import Baseline
from sparsegen.bench.roofline import (
    decode_bytes,
    measure_bandwidth,
    roofline_tokens_per_s,
    synchronize,
    weight_bytes_per_step,
    weights,
)
from sparsegen.bench.stats import percentile
from sparsegen.bench.syncs import count_syncs
from sparsegen.engine.prefill import prefill
from sparsegen.engine.speculative import Speculation, speculative_tokens
from sparsegen.engine.step import DecodeStep, forward
from sparsegen.kv import EvictionCache, KVQuantization, Policy
from sparsegen.kv.quantized import AS_COMPUTED, held_kv, policy_and_bits
from sparsegen.memory import PeakMemory, available_bytes
from sparsegen.models.anatomy import weights_of
from sparsegen.models.spec import kv_bytes_per_token, kv_shape
from sparsegen.quant.fast import kernel_path

BASELINES = ("dense", "recompute")
SYNC_STEPS = 2  # decode steps whose host reads are counted, after the timed ones


@dataclass
class Setup:
    """What every measurement of one run shares."""

    model: torch.nn.Module
    model_name: str
    random_weights: bool
    new_tokens: int = 128
    warmup: int = 4
    chunk_size: int = 512
    prefill: str = "real"  # or "synthetic": the cache is filled with random K/V of the same shape (no prefill cost)
    recompute_tokens: int = 8
    memory_limit: int | None = None
    bandwidth: float | None = None
    compiled: str | None = None  # compile_mode's answer for bench's --compile: "regional", "whole" or None (eager)
    seed: int = 0
    repeats: int = 1  # measure every policy this many times, interleaved, and pool the steps
    text_ids: torch.Tensor | None = None  # prefill with this token stream (rows at different offsets), not random ids
    # how the evicting caches hold K/V (None: the model's default; dense and recompute rows as computed)
    kv_bits: KVQuantization | int | None = None

    def __post_init__(self):
        if self.prefill not in ("real", "synthetic"):
            raise ValueError(f"prefill must be 'real' or 'synthetic', got {self.prefill!r}")
        if self.new_tokens < 1 or self.warmup < 0 or self.recompute_tokens < 1 or self.repeats < 1:
            raise ValueError("new_tokens, recompute_tokens and repeats must be >= 1 and warmup >= 0")
        self.kv_bits = held_kv(self.model, self.kv_bits)  # (None asks for the model's default: resolved here)
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.element_size = param.element_size()
        self.kv_per_token = kv_bytes_per_token(self.model.config, self.element_size)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in weights(self.model))
        self.step_weight_bytes = weight_bytes_per_step(self.model)
        self.vocab = self.model.config.get_text_config().vocab_size
        from sparsegen.contextual.runtime import attached_plan

        plan = attached_plan(self.model)
        # with contextual sparsity the bytes a step reads depend on the input: no roofline is claimed
        self.contextual = None if plan is None else plan.method

    def kv_bits_of(self, name: str) -> KVQuantization | None:
        """How row ``name``'s cache holds K/V (``row_kv_bits``)."""
        return row_kv_bits(name, self.kv_bits)

    def kv_bytes_per_token(self, name: str) -> int:
        """K/V bytes per token of row ``name``: the model's own cache for the baselines, an evicting cache's
        storage (quantized as ``kv_bits_of`` says) for every policy."""
        if name in BASELINES:
            return self.kv_per_token
        return kv_bytes_per_token(self.model.config, self.element_size, self.kv_bits_of(name))

    @property
    def step_compile(self) -> str | bool:
        """``DecodeStep``'s ``compile`` for this setup: its mode, or False (eager; None there means a default)."""
        return self.compiled or False

    def environment(self) -> dict:
        device = self.device
        machine, flags = (torch.cuda.get_device_name(device), []) if device.type == "cuda" else _cpu_info()
        return {
            "model": self.model_name, "random_weights": self.random_weights, "device": str(device),
            "weights": weights_of(self.model),
            "machine": machine, "vector_extensions": flags, "kernels": None if device.type == "cuda" else kernel_path(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "compiled": self.compiled,
            "prefill": self.prefill, "contextual": self.contextual,
            "bandwidth_gb_s": round(self.bandwidth / 1e9, 2) if self.bandwidth else None,
            "kv_bits": self.kv_bits.bits if self.kv_bits else None, "weight_bytes": self.weight_bytes,
        }


def row_kv_bits(name: str, default: KVQuantization | None) -> KVQuantization | None:
    """How row ``name`` holds K/V: ``POLICY+kvBITS`` in BITS bits (16: float16; ``h2o+kv16`` beside ``h2o`` compares
    the two in one run), any other row as ``default`` (the bench's ``--kv-bits``) says."""
    bits = policy_and_bits(name)[1]
    if bits is None:
        return default
    if bits == AS_COMPUTED:
        return None
    return replace(default, bits=bits) if default else KVQuantization(bits)


VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def _cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, list[str]]:
    """The CPU's name (with the threads used) and its vector extensions among ``VECTOR_FLAGS``: what the kernels
    compared may use (sparsegen's C++ kernels take AVX2; FBGEMM, and llama.cpp built natively, take AVX-512 and VNNI
    where the CPU has them), so that a result says which machine kind it ran on."""
    try:
        with open(path) as f:
            first = f.read().split("\n\n")[0].splitlines()  # (the first processor's fields)
    except OSError:
        first = []
    fields = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in first if ":" in line)}
    name = fields.get("model name") or platform.processor() or platform.machine()
    present = set(fields.get("flags", "").split())
    return f"{name} ({torch.get_num_threads()} threads)", [flag for flag in VECTOR_FLAGS if flag in present]


class StepTimer:
    """Seconds per step: wall clock on CPU, CUDA events on GPU (read once, after one synchronisation)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((started, event))
        else:
            self.marks.append(time.perf_counter() - started)

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in self.marks]
        return list(self.marks)


class MLPTimer:
    """Wall-clock seconds per step inside the decoder layers' MLPs (their ``.mlp``, or for OPT the fc1/fc2 linears)
    and the contextual MLP predictors (the predictor's cost belongs to the MLP it prunes). CPU only: on CUDA the
    launches return before the work ends. Off under ``--compile`` (its hooks would break the compiled step)."""

    def __init__(self, model: torch.nn.Module, enabled: bool = True):
        from sparsegen.contextual.runtime import attached_plan
        from sparsegen.models.anatomy import decoder_layers, mlp_layout

        self.steps: list[float] = []
        self._spent, self._started, self.handles = 0.0, 0.0, []
        if next(model.parameters()).device.type != "cpu" or not enabled:
            return
        producers, consumer = mlp_layout(model.config.model_type)
        timed = []
        for layer in decoder_layers(model):
            mlp = getattr(layer, "mlp", None)
            timed += [mlp] if mlp is not None else [layer.get_submodule(p) for p in (*producers, consumer)]
        plan = attached_plan(model)
        if plan is not None:
            timed += [module for name, module in plan.predictors.items() if name.startswith("mlp")]
        for module in timed:
            self.handles.append(module.register_forward_pre_hook(self._start))
            self.handles.append(module.register_forward_hook(self._stop))

    def _start(self, module, args):
        self._started = time.perf_counter()

    def _stop(self, module, args, output):
        self._spent += time.perf_counter() - self._started

    def step(self, timed: bool) -> None:
        if timed and self.handles:
            self.steps.append(self._spent)
        self._spent = 0.0

    def close(self) -> float | None:
        for handle in self.handles:
            handle.remove()
        return statistics.median(self.steps) * 1000 if self.steps else None


def _cache_for(setup: Setup, name: str, policy: Policy | None, batch: int, context: int):
    """A fresh cache for ``name`` holding ``context`` tokens (random K/V when the prefill is synthetic)."""
    total = context + setup.warmup + setup.new_tokens + SYNC_STEPS + 1  # + the step captured to count graph breaks
    if name == "dense":
        cache = DynamicCache(config=setup.model.config)
    else:
        cache = EvictionCache(setup.model, policy, chunk_size=setup.chunk_size, expected_length=total,
                              kv_bits=setup.kv_bits_of(name) or AS_COMPUTED)
    if setup.prefill == "synthetic":
        _, kv_heads, head_dim = kv_shape(setup.model.config)
        generator = torch.Generator(device=setup.device).manual_seed(setup.seed)
        if name == "dense":
            for layer in range(len(cache.layers) if cache.layers else setup.model.config.num_hidden_layers):
                kv = torch.randn(batch, kv_heads, context, head_dim, dtype=setup.dtype, device=setup.device,
                                 generator=generator)
                cache.update(kv, kv.clone(), layer)
        else:
            fill_random(cache, batch, context, kv_heads, head_dim, setup.dtype, setup.device, generator)
    return cache


def _attended_tokens(cache, compiled: bool) -> float:
    """Slots a step reads, averaged over the layers, its own token's included: a fixed-shape step's fixed slots (the
    free ones too), else the held ones. (Averaged: Gemma 3's sliding-window layers read their window and its global
    ones the whole context; the largest layer's count for all put Gemma's full cache at 8K at 121% of its bytes
    roofline.)"""
    if not isinstance(cache, EvictionCache):  # (a sliding layer's ``get_seq_length`` counts what it has seen)
        lengths = [layer.keys.shape[-2] for layer in cache.layers if layer.is_initialized] or [cache.get_seq_length()]
    elif compiled and cache.fits_fixed_step():
        lengths = [layer.fixed_slots for layer in cache.layers]
    else:
        lengths = cache.held_tokens()
    return sum(lengths) / len(lengths) + 1


def _peak_kv_bytes(cache, setup: Setup, batch: int) -> int:
    if isinstance(cache, EvictionCache):
        return cache.stats()["kv_bytes_peak"]
    return cache.get_seq_length() * setup.kv_per_token * batch


def estimate_bytes(setup: Setup, name: str, policy: Policy | None, context: int, batch: int) -> int:
    """Memory a measurement needs beyond the weights: the KV cache at its peak and the largest attention scores."""
    heads = setup.model.config.get_text_config().num_attention_heads
    chunk = min(setup.chunk_size, context) if setup.prefill == "real" else 1
    if name == "recompute":
        held, chunk = min(int(policy), context), min(int(policy), context)
    elif policy is None or isinstance(policy, Speculation) or policy.budget is None:  # (speculation: its full cache)
        held = context + setup.warmup + setup.new_tokens + SYNC_STEPS
    else:
        held = min(policy.budget, context) + chunk
    return batch * (held * setup.kv_bytes_per_token(name) + heads * chunk * held * 4)


@torch.inference_mode()
def measure(setup: Setup, name: str, policy: Policy | int | None, context: int, batch: int,
            checks: bool = True) -> dict:
    """One row: prefill time, decode ms per step (median, p90), tokens/s, KV and process memory, roofline.

    ``policy`` is a ``Policy`` for sparsegen caches, None for ``dense``, the window (tokens) for ``recompute``, and a
    ``Speculation`` for self-speculative decoding under the full cache. ``checks=False``: host syncs and graph breaks
    are not counted (None; a repeat of a row whose first measurement counted them: they do not change, and the
    graph-break count traces the whole step again, seconds a row).
    """
    row = {"policy": name, "context": context, "batch": batch, "budget": None}
    if isinstance(policy, Policy):
        row.update(policy.describe(), policy=name)
        kv_bits = setup.kv_bits_of(name)
        row["kv_bits"] = kv_bits.bits if kv_bits else None
    elif isinstance(policy, Speculation):
        row.update({"budget": policy.policy.budget, "draft": policy.policy.describe()})
    elif name == "recompute":
        row["budget"] = int(policy)
    free = available_bytes(setup.device)
    need = estimate_bytes(setup, name, policy, context, batch)
    if free is not None and need > 0.9 * free:
        return {**row, "skipped": f"needs about {need / 2**30:.1f} GiB beyond the weights, {free / 2**30:.1f} GiB free"}
    ids = _context_ids(setup, batch, context)
    bandwidth = _row_bandwidth(setup)
    if bandwidth is not None:
        row["bandwidth_gb_s"] = round(bandwidth / 1e9, 2)
    with PeakMemory(setup.device) as peak:
        if isinstance(policy, Speculation):
            row.update(_measure_speculative(setup, policy, ids))
        elif name == "recompute":
            row.update(_measure_recompute(setup, ids, int(policy)))
        else:
            row.update(_measure_cached(setup, name, policy, ids, checks, bandwidth))
    row["peak_memory_bytes"] = peak.bytes
    row["peak_memory_method"] = peak.method
    if setup.memory_limit is not None:
        per_sequence = row["peak_kv_bytes"] / batch
        row["max_batch_at_limit"] = max(0, int((setup.memory_limit - setup.weight_bytes) // per_sequence))
    return row


def _row_bandwidth(setup: Setup) -> float | None:
    """The copy bandwidth just before a row, where the run has a roofline: a shared machine's bandwidth drifts
    (35-74 GB/s within one session on the 2-core EPYC), and a bandwidth-bound step's time follows it, so each row's
    roofline is taken against its own probe (smaller than the run's first: a 128 MiB copy, best of 3)."""
    return measure_bandwidth(setup.device, megabytes=128, repeats=3) if setup.bandwidth else None


def _context_ids(setup: Setup, batch: int, context: int) -> torch.Tensor:
    """Random token ids, or windows of the setup's text, row ``i`` starting ``i / batch`` of the way in (the text
    repeated if it is too short)."""
    if setup.text_ids is None:
        generator = torch.Generator(device=setup.device).manual_seed(setup.seed)
        return torch.randint(setup.vocab, (batch, context), device=setup.device, generator=generator)
    text = setup.text_ids
    stream = text.repeat(-(-(context + len(text)) // len(text)))
    starts = [row * len(text) // batch for row in range(batch)]
    return torch.stack([stream[start:start + context] for start in starts]).to(setup.device)


def _measure_speculative(setup: Setup, speculation: Speculation, ids: torch.Tensor) -> dict:
    """Prefill both caches, then ``warmup + new_tokens`` tokens per row, greedy; ms per token is the decode time over
    the tokens of a row (a mean over rounds: a round yields several tokens)."""
    if setup.prefill != "real":
        raise ValueError("speculative rows need a real prefill (the draft must read what the target read): run "
                         "without --prefill synthetic")
    batch, context = ids.shape
    tokens = setup.warmup + setup.new_tokens
    compile_seconds = None
    if setup.compiled:  # the draft step's shape is its budget's, not the context's: compiled here, outside the timing
        t0 = time.perf_counter()
        warm = ids[:, :min(context, 2 * speculation.policy.budget + setup.chunk_size)]
        speculative_tokens(setup.model, warm, torch.ones_like(warm), speculation, max_new_tokens=setup.warmup + 2,
                           chunk_size=setup.chunk_size, compile=setup.step_compile)
        compile_seconds = time.perf_counter() - t0
    new, counts, stats, prefill_seconds, decode_seconds = speculative_tokens(
        setup.model, ids, torch.ones_like(ids), speculation, max_new_tokens=tokens, chunk_size=setup.chunk_size,
        compile=setup.step_compile)
    per_row = decode_seconds / float(counts.float().mean())
    report = stats["speculation"]
    kv_bytes = context * setup.kv_per_token * batch  # what one step of the full cache reads besides the weights
    return {
        "prefill_seconds": prefill_seconds, "prefill_tokens_per_s": batch * context / prefill_seconds,
        "kv_share": kv_bytes / (kv_bytes + setup.step_weight_bytes),
        "step_seconds": [per_row], "ms_per_token": per_row * 1000, "ms_per_token_p90": None,
        "tokens_per_s": batch / per_row, "timed_tokens": tokens, "kv_tokens": stats["kv_tokens"],
        "bytes_per_step": None, "roofline_fraction": None, "mlp_ms_per_token": None,
        "peak_kv_bytes": stats["kv_bytes_peak"] + stats["draft_cache"]["kv_bytes_peak"],
        **{key: report[key] for key in ("acceptance_rate", "tokens_per_step", "draft_ms", "verify_ms",
                                         "mean_draft_length", "rows_per_round")},
        # the draft's one-token steps that ran compiled (a round's first call feeds two tokens where a row carried
        # its last accepted draft: eager)
        "compiled_share": report["draft_compiled_steps"] / max(report["draft_steps"], 1),
        "compile_seconds": compile_seconds,  # a short speculative run on the same draft shape, before the timed one
    }


def _measure_cached(setup: Setup, name: str, policy: Policy | None, ids: torch.Tensor, checks: bool = True,
                    bandwidth: float | None = None) -> dict:
    model, device = setup.model, setup.device
    batch, context = ids.shape
    cache = _cache_for(setup, name, policy, batch, context)
    prefill_seconds = None
    if setup.prefill == "real":
        synchronize(device)
        t0 = time.perf_counter()
        logits = prefill(model, cache, ids, torch.ones_like(ids), setup.chunk_size)
        synchronize(device)
        prefill_seconds = time.perf_counter() - t0
        token = logits.argmax(-1)
    else:
        token = ids[:, -1]
    position = torch.full((batch,), context, device=device)
    decode = DecodeStep(model, setup.step_compile)
    timer, mlp_timer = StepTimer(device), MLPTimer(model, enabled=not setup.compiled)
    steps = setup.warmup + setup.new_tokens

    def step(run: Callable = decode) -> None:
        nonlocal token, position
        token = run(cache, token, position).argmax(-1)
        position = position + 1

    attended = []  # slots a step reads, at the first and the last timed step
    for index in range(steps):
        if index == setup.warmup:
            compiled_before = decode.compiled_steps
        if index in (setup.warmup, steps - 1):
            attended.append(_attended_tokens(cache, setup.compiled is not None))
        started = timer.start()
        step()
        if index >= setup.warmup:
            timer.stop(started)
        mlp_timer.step(index >= setup.warmup)
    kv_tokens = sum(attended) / len(attended)
    compiled_share = (decode.compiled_steps - compiled_before) / setup.new_tokens
    mlp_ms = mlp_timer.close()  # its hooks call the host clock: a graph break, and not part of the step
    # counted on steps after the timed ones (counting costs time); off CUDA by a dispatch mode, under which dynamo
    # does not run: there the eager step's code is counted (a compiled fullgraph step cannot hold a sync of its own)
    counted = decode.uncompiled if setup.compiled and device.type != "cuda" else decode
    syncs = None
    if checks:
        with count_syncs(device) as syncs:
            for _ in range(SYNC_STEPS):
                step(counted)
    return {
        "host_syncs_per_token": syncs.count / SYNC_STEPS if syncs is not None else None,
        "host_sync_ops": dict(syncs.ops) if syncs is not None else None,
        "compiled_share": compiled_share,  # of the timed steps (the others ran eagerly: see DecodeStep)
        "compile_seconds": decode.compile_seconds,  # the first compiled step's wall time (None: none compiled)
        "graph_breaks": decode.graph_breaks(cache, token, position) if checks else None,
        "prefill_seconds": prefill_seconds,
        "prefill_tokens_per_s": batch * context / prefill_seconds if prefill_seconds else None,
        **_decode_stats(setup, name, timer.seconds(), batch, kv_tokens, bandwidth),
        "mlp_ms_per_token": mlp_ms,
        "peak_kv_bytes": _peak_kv_bytes(cache, setup, batch),
    }


def _measure_recompute(setup: Setup, ids: torch.Tensor, window: int) -> dict:
    """Each new token re-encodes the last ``window`` tokens (positions 0..window-1) with no cache."""
    model = setup.model
    batch, context = ids.shape
    window = min(window, context)
    recent = ids[:, -window:]
    timer = StepTimer(setup.device)
    for step in range(min(setup.warmup, 1) + setup.recompute_tokens):
        started = timer.start()
        logits = model(input_ids=recent, use_cache=False, logits_to_keep=1).logits[:, -1]
        recent = torch.cat([recent[:, 1:], logits.argmax(-1, keepdim=True)], dim=1)
        if step >= min(setup.warmup, 1):
            timer.stop(started)
    stats = _decode_stats(setup, "recompute", timer.seconds(), batch, kv_tokens=window)
    stats["roofline_fraction"] = None  # compute-bound: every step encodes `window` tokens
    return {"prefill_seconds": None, "prefill_tokens_per_s": None, **stats,
            "peak_kv_bytes": window * setup.kv_per_token * batch}


def _decode_stats(setup: Setup, name: str, seconds: list[float], batch: int, kv_tokens: float,
                  bandwidth: float | None = None) -> dict:
    """Step times, and the roofline of row ``name`` (the KV bytes it reads as its cache stores them) at
    ``bandwidth`` (the row's own probe; else the run's)."""
    bandwidth = bandwidth or setup.bandwidth
    median = statistics.median(seconds)
    stats = {
        "step_seconds": seconds,
        "ms_per_token": median * 1000,
        "ms_per_token_p90": percentile(seconds, 0.9) * 1000,
        "tokens_per_s": batch / median,
        "timed_tokens": len(seconds),
        "kv_tokens": kv_tokens,
        "bytes_per_step": decode_bytes(setup.step_weight_bytes, kv_tokens,
                                       setup.kv_bytes_per_token(name), batch),
    }
    if bandwidth and setup.contextual is None:
        bound = roofline_tokens_per_s(bandwidth, stats["bytes_per_step"], batch)
        stats["roofline_tokens_per_s"] = bound
        stats["roofline_fraction"] = stats["tokens_per_s"] / bound
    return stats


@torch.inference_mode()
def _warm_up(setup: Setup) -> None:
    """One short untimed prefill and decode, so one-time costs (allocator, kernels, compilation) stay out of rows."""
    cache = DynamicCache(config=setup.model.config)
    ids = torch.zeros(1, min(setup.chunk_size, 64), dtype=torch.long, device=setup.device)
    forward(setup.model, cache, ids, torch.arange(ids.shape[1], device=setup.device)[None])
    DecodeStep(setup.model, compile=False)(cache, ids[:, 0], torch.tensor([ids.shape[1]], device=setup.device))
    synchronize(setup.device)


def run(setup: Setup, policies: list[tuple[str, Callable[[], Policy | int | None]]], contexts: list[int],
        batches: list[int], on_row: Callable[[dict], None] | None = None,
        baseline: Baseline | None = None) -> list[dict]:
    """Every (policy, context, batch); each row carries the run's environment. ``baseline``: llama.cpp's row at each
    context (batch 1), measured in every turn after the policies."""
    env = setup.environment()
    _warm_up(setup)
    rows = []
    for batch in batches:
        for context in contexts:
            beside = baseline is not None and batch == 1
            # policy after policy, `repeats` times over: slow drifts of the machine hit every policy alike
            turns, theirs = [], []
            for turn in range(setup.repeats):
                turns.append([measure(setup, name, make(), context, batch, checks=not turn) for name, make in policies])
                if beside:
                    theirs.append(baseline.measure(context))
            measured = [{**env, **_merge(setup, [t[i] for t in turns])} for i in range(len(policies))]
            if beside:
                measured += baseline.pool(theirs)
            for row in measured:
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows


def _merge(setup: Setup, repeats: list[dict]) -> dict:
    """One row from repeated measurements: statistics over all their steps, the largest peak memory."""
    first = repeats[0]
    if len(repeats) == 1 or "skipped" in first:
        return first
    seconds = [s for r in repeats for s in r["step_seconds"]]
    probes = [r["bandwidth_gb_s"] for r in repeats if r.get("bandwidth_gb_s")]
    bandwidth = statistics.median(probes) if probes else None  # (the turns' probes)
    merged = {**first, **_decode_stats(setup, first["policy"], seconds, first["batch"], first["kv_tokens"],
                                       bandwidth * 1e9 if bandwidth else None), "repeats": len(repeats)}
    if bandwidth:
        merged["bandwidth_gb_s"] = round(bandwidth, 2)
    mlp = [r["mlp_ms_per_token"] for r in repeats if r.get("mlp_ms_per_token") is not None]
    merged["mlp_ms_per_token"] = statistics.median(mlp) if mlp else None
    if "roofline_fraction" in first and first["roofline_fraction"] is None:
        merged["roofline_fraction"] = None
    if first["prefill_seconds"] is not None:
        merged["prefill_seconds"] = statistics.median(r["prefill_seconds"] for r in repeats)
        merged["prefill_tokens_per_s"] = first["batch"] * first["context"] / merged["prefill_seconds"]
    peaks = [r["peak_memory_bytes"] for r in repeats if r["peak_memory_bytes"] is not None]
    merged["peak_memory_bytes"] = max(peaks) if peaks else None
    return merged
