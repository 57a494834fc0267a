"""llama.cpp on the same GGUF: the baseline rows of ``bench --baseline llama.cpp``.

Where llama.cpp's own ``llama-bench`` is built (``make llama-tools``), it measures, as llama.cpp measures itself:
prompt processing of the context from empty (``-p C``) and generation at that depth (``-n N -d C``), each with flash
attention on and off (``-fa on,off``: which is faster depends on the machine and the model), its own ``swa_full =
false``, and each row records llama.cpp's build and the CPU it saw; ``bench`` compares against the faster setting.

Otherwise the binding (``llama-cpp-python``) does: each measurement runs in a child process (this file run as a
script: no torch imported) so that its peak memory is its own and its threads do not share the parent's: the model is
loaded from the GGUF at its own bit width, a context of random token ids is evaluated in batches, then ``warmup +
new_tokens`` greedy tokens are decoded one ``eval`` at a time and each step is timed on the wall clock. It needs the
optional ``llama-cpp-python`` binding (``pip install 'sparsegen[llamacpp]'``, or ``make llamacpp``: it builds
llama.cpp from source, with two parallel jobs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

INSTALL = ("llama.cpp rows need llama.cpp's own llama-bench, built from source once (about 15 minutes on 2 cores): "
           "make llama-tools, or set LLAMA_BENCH=PATH (or the llama-cpp-python binding: make llamacpp)")


SERVER_INSTALL = ("the llama.cpp server baseline needs llama.cpp's `llama-server`: `make llama-server` builds it from "
                  "the llama.cpp sources llama-cpp-python ships (two parallel jobs), or set LLAMA_SERVER=PATH")


PERPLEXITY_INSTALL = ("ppl --baseline llama.cpp needs llama.cpp's `llama-perplexity`: `make llama-tools` builds it "
                      "from "
                      "the llama.cpp sources llama-cpp-python ships (two parallel jobs), or set LLAMA_PERPLEXITY=PATH")


def available() -> bool:
    return bench_binary() is not None or find_spec("llama_cpp") is not None


def tool(name: str) -> Path | None:
    """One of llama.cpp's programs (``llama-bench``, ``llama-server``, ``llama-perplexity``): ``$LLAMA_BENCH`` (and
    so on), else the program beside this Python or on PATH (None: not built)."""
    found = os.environ.get(name.upper().replace("-", "_")) or shutil.which(name, path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    return Path(found) if found and Path(found).is_file() else None


def bench_binary() -> Path | None:
    return tool("llama-bench")


BENCH_REPETITIONS = 1  # llama-bench runs of each test after its own warm-up run (bench --repeats repeats turns: each
# prompt test re-encodes the whole context, 8K tokens a minute on 2 cores)


def measure_with_llama_bench(gguf: Path, context: int, new_tokens: int, threads: int,
                             repetitions: int = BENCH_REPETITIONS) -> list[dict]:
    """llama.cpp's rows at ``context`` (batch 1), one per flash-attention setting, from ``llama-bench``: the prompt
    from empty, then ``new_tokens`` generated at depth ``context``; each row's peak RSS is the child's own."""
    binary = bench_binary()
    if binary is None:
        raise ValueError(INSTALL)
    common = [str(binary), "-m", str(gguf), "-t", str(threads), "-fa", "on,off", "-r", str(repetitions), "-o", "json"]
    prompt, peak_prompt = _llama_bench(common + ["-p", str(context), "-n", "0", "-d", "0"])
    steps, peak_steps = _llama_bench(common + ["-p", "0", "-n", str(new_tokens), "-d", str(context)])
    rows = []
    for flash in (True, False):
        pp = next(r for r in prompt if bool(r["flash_attn"]) == flash)
        tg = next(r for r in steps if bool(r["flash_attn"]) == flash)
        seconds = sorted(1 / t for t in tg["samples_ts"])  # (each repetition's mean step)
        rows.append({
            "policy": "llama.cpp", "context": context, "batch": 1, "budget": None, "flash_attn": flash,
            "swa_full": False, "engine": f"llama-bench build {tg['build_number']} ({tg['build_commit']})",
            "cpu_info": tg["cpu_info"], "weights": gguf.name, "threads": tg["n_threads"],
            "prefill_seconds": context / pp["avg_ts"], "prefill_tokens_per_s": pp["avg_ts"],
            "ms_per_token": 1000 / tg["avg_ts"], "ms_per_token_p90": 1000 * seconds[-1], "tokens_per_s": tg["avg_ts"],
            "tokens_per_s_stddev": tg["stddev_ts"], "timed_tokens": new_tokens * len(seconds), "repeats": len(seconds),
            "kv_tokens": context + new_tokens, "peak_memory_bytes": max(peak_prompt, peak_steps),
            "peak_memory_method": "child process VmHWM", "host_syncs_per_token": None, "graph_breaks": None,
        })
    return rows


def _llama_bench(command: list[str]) -> tuple[list[dict], int]:
    """llama-bench's JSON rows and the child's peak RSS in bytes (its ``VmHWM``, read until it exits)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child, peak = subprocess.Popen(command, stdout=out, stderr=err, text=True), 0
        while child.poll() is None:
            peak = max(peak, _high_water(child.pid))
            time.sleep(0.05)
        if child.returncode:
            err.seek(0)
            raise RuntimeError(f"llama-bench failed ({child.returncode}): {err.read().strip()[-500:]}")
        out.seek(0)
        return json.loads(out.read()), peak


def _high_water(pid: int) -> int:
    """A live process's RSS high-water mark (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def server_binary() -> Path:
    found = tool("llama-server")
    if found is None:
        raise ValueError(SERVER_INSTALL)
    return found


def perplexity(gguf: Path, text: Path, ctx: int, threads: int, chunks: int | None = None) -> dict:
    """llama.cpp's own ``llama-perplexity`` on ``text``: windows of ``ctx`` tokens of the whole file, each window's
    first token replaced by BOS where the model adds one, the second half of each window scored."""
    binary = tool("llama-perplexity")
    if binary is None:
        raise ValueError(PERPLEXITY_INSTALL)
    command = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-t", str(threads),
               "--chunks", str(chunks or -1)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", done.stderr + done.stdout)
    if done.returncode or not found:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    windows = re.search(r"over (\d+) chunks, n_ctx=(\d+)", done.stderr)
    version = re.search(r"version: (.+)", subprocess.run([str(binary), "--version"], capture_output=True,
                                                          text=True).stderr)
    return {"engine": f"llama-perplexity {version[1].strip() if version else ''}".strip(),
            "weights": gguf.name, "ppl": float(found[1]), "ppl_stderr": float(found[2]), "ctx": ctx,
            "windows": int(windows[1]) if windows else None,
            "tokens": int(windows[1]) * (ctx - ctx // 2 - 1) if windows else None,
            "seconds": round(time.perf_counter() - started, 1)}


def server_kv_bytes(log: str) -> int:
    """The K/V bytes a ``llama-server`` allocated, from its start-up log (the ``KV buffer size`` lines: one per
    cache, two for a model with sliding-window layers)."""
    sizes = re.findall(r"KV buffer size =\s*([0-9.]+) MiB", log)
    if not sizes:
        raise RuntimeError(f"llama-server's log names no KV buffer size:\n{log[-1500:]}")
    return int(sum(float(size) for size in sizes) * 2**20)


def measure(gguf: Path, context: int, new_tokens: int, warmup: int, threads: int, seed: int = 0,
            batch: int = 512) -> dict:
    """One llama.cpp row (batch 1) for ``context`` tokens of context, from a child process."""
    if not available():
        raise ValueError(INSTALL)
    command = [sys.executable, __file__, str(gguf), "--context", str(context),  # (not -m: no torch in the child)
               "--new-tokens", str(new_tokens), "--warmup", str(warmup), "--threads", str(threads),
               "--seed", str(seed), "--batch", str(batch)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama.cpp failed on {gguf.name} at context {context}: {done.stderr.strip()[-500:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {**row, **_step_stats(row["step_seconds"])}


@dataclass(frozen=True)
class Baseline:
    """llama.cpp's rows for one bench model, measured in the run's own turns (``bench --repeats``: after each turn's
    policies, at each context), so that the machine's drifts hit both engines alike: by ``llama-bench`` where it is
    built (a row per flash-attention setting), else by the binding (one row, the binding's settings)."""

    gguf: Path
    model: str  # the label of the rows it sits beside
    new_tokens: int
    warmup: int
    threads: int
    seed: int = 0

    def measure(self, context: int) -> list[dict]:
        if bench_binary() is not None:
            rows = measure_with_llama_bench(self.gguf, context, self.new_tokens, self.threads)
        else:
            rows = [measure(self.gguf, context, self.new_tokens, self.warmup, self.threads, self.seed)]
        return [{"model": self.model, **row} for row in rows]

    @staticmethod
    def pool(turns: list[list[dict]]) -> list[dict]:
        """One row per setting from repeated measurements at one context: statistics over all their steps (the
        binding's), or the median turn's speeds (llama-bench's, each already a mean over its repetitions)."""
        pooled = []
        for rows in zip(*turns):
            rows = list(rows)
            if len(rows) == 1:
                pooled.append(rows[0])
                continue
            prefill = statistics.median(r["prefill_seconds"] for r in rows)
            if "step_seconds" in rows[0]:
                speed = _step_stats([s for r in rows for s in r["step_seconds"]])
            else:
                ms = statistics.median(r["ms_per_token"] for r in rows)
                speed = {"ms_per_token": ms, "tokens_per_s": 1000 / ms}
            pooled.append({**rows[0], **speed, "prefill_seconds": prefill,
                           "prefill_tokens_per_s": rows[0]["context"] / prefill,
                           "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows), "repeats": len(rows)})
        return pooled


def _step_stats(seconds: list[float]) -> dict:
    """A row's step statistics, as bench gives its own (computed in the parent: the child has no torch)."""
    from sparsegen.bench.stats import percentile

    median = statistics.median(seconds)
    return {"step_seconds": seconds, "ms_per_token": median * 1000, "ms_per_token_p90": percentile(seconds, 0.9) * 1000,
            "tokens_per_s": 1 / median, "timed_tokens": len(seconds)}


def _run(gguf: str, context: int, new_tokens: int, warmup: int, threads: int, seed: int, batch: int) -> dict:
    import numpy as np
    from llama_cpp import Llama, __version__

    llm = Llama(model_path=gguf, n_ctx=context + warmup + new_tokens + 8, n_batch=batch, n_threads=threads,
                n_threads_batch=threads, seed=seed, verbose=False)
    vocab = llm.n_vocab()

    def greedy() -> int:  # the last evaluated token's logits, as llama.cpp left them
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))

    ids = np.random.default_rng(seed).integers(0, vocab, context).tolist()
    started = time.perf_counter()
    llm.eval(ids)
    prefill_seconds = time.perf_counter() - started
    token, seconds = greedy(), []
    for step in range(warmup + new_tokens):
        started = time.perf_counter()
        llm.eval([token])
        token = greedy()
        if step >= warmup:
            seconds.append(time.perf_counter() - started)
    return {
        "policy": "llama.cpp", "context": context, "batch": 1, "budget": None, "engine": f"llama.cpp ({__version__})",
        "weights": Path(gguf).name, "threads": threads, "prefill_seconds": prefill_seconds,
        "prefill_tokens_per_s": context / prefill_seconds, "step_seconds": seconds,
        "kv_tokens": context + warmup + new_tokens,
        "peak_memory_bytes": _peak_rss(), "peak_memory_method": "child process VmHWM",
        "host_syncs_per_token": None, "graph_breaks": None,
    }


def _peak_rss() -> int:
    """This process's own RSS high-water mark (``ru_maxrss`` would carry the parent's across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    for name, default in (("context", 512), ("new-tokens", 64), ("warmup", 4), ("threads", 2), ("seed", 0),
                          ("batch", 512)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    print(json.dumps(_run(args.gguf, args.context, args.new_tokens, args.warmup, args.threads, args.seed,
                          args.batch)))


if __name__ == "__main__":
    main()
