"""llama.cpp on the same GGUF, timed as ``bench`` times sparsegen: the baseline rows of ``bench --baseline llama.cpp``.

Each measurement runs in a child process (this file run as a script: no torch imported) so that its peak memory is
its own and its threads do not share the parent's: the model is loaded from the GGUF at its own bit width, a context of
random token ids is evaluated in batches, then ``warmup + new_tokens`` greedy tokens are decoded one ``eval`` at a
time and each step is timed on the wall clock. It needs the optional ``llama-cpp-python`` binding (``pip install
'sparsegen[llamacpp]'``, or ``make llamacpp``: it builds llama.cpp from source, with two parallel jobs).
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
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

INSTALL = ("llama.cpp rows need the llama-cpp-python binding, built from source once (about 20 minutes on 2 cores): "
           "make llamacpp, or CMAKE_BUILD_PARALLEL_LEVEL=2 pip install 'sparsegen[llamacpp]'")


SERVER_INSTALL = ("the llama.cpp server baseline needs llama.cpp's `llama-server`: `make llama-server` builds it from "
                  "the llama.cpp sources llama-cpp-python ships (two parallel jobs), or set LLAMA_SERVER=PATH")


def available() -> bool:
    return find_spec("llama_cpp") is not None


def server_binary() -> Path:
    """``$LLAMA_SERVER``, else ``llama-server`` beside this Python or on PATH."""
    found = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if not found or not Path(found).is_file():
        raise ValueError(SERVER_INSTALL)
    return Path(found)


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
    policies, at each context), so that the machine's drifts hit both engines alike."""

    gguf: Path
    model: str  # the label of the rows it sits beside
    new_tokens: int
    warmup: int
    threads: int
    seed: int = 0

    def measure(self, context: int) -> dict:
        return {"model": self.model, **measure(self.gguf, context, self.new_tokens, self.warmup, self.threads,
                                               self.seed)}

    @staticmethod
    def pool(rows: list[dict]) -> dict:
        """One row from repeated measurements at one context: statistics over all their steps."""
        if len(rows) == 1:
            return rows[0]
        prefill = statistics.median(r["prefill_seconds"] for r in rows)
        return {**rows[0], **_step_stats([s for r in rows for s in r["step_seconds"]]), "prefill_seconds": prefill,
                "prefill_tokens_per_s": rows[0]["context"] / prefill,
                "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows), "repeats": len(rows)}


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
        "peak_memory_bytes": _peak_rss(), "peak_memory_method": "child process VmHWM", "host_syncs_per_token": None, "graph_breaks": None,
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
