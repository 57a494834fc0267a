"""A compiled server's graphs compiled before its first request: what ``sparsegen serve`` runs before ``/health``."""

from __future__ import annotations

from sparsegen.engine.scheduler import Engine
from sparsegen.engine.session import Sampling
from sparsegen.engine.step import COMPILES


def warm_up(engine: Engine, rows: int = 3, tokens: int = 4) -> dict:
    """Compile, before any request, the decode step's graphs that traffic meets, so that no reply waits on a
    compile: throwaway replies of one prompt decode alone (a session's own cache), then ``rows`` of them
    stacked, finishing one after another (the batched cache at ``rows`` down to 2 rows: the stacked batch's first
    graph has a variable batch size, since a batch of one was seen before, and every later size takes it; the last
    row decodes alone again, in its own cache's graph). Two graphs. An unbounded policy's
    slots are fixed only with ``max_context`` (its sessions then allocate it at once); without, each larger
    allocation of a growing conversation is a graph of its own, compiled when first met. Their caches and the
    counters are given back; returns ``{"compiles", "seconds"}`` (``COMPILES``' count and seconds it added)."""
    if not engine.decode.compiled:
        return {"compiles": 0, "seconds": 0.0}
    counters, (count, seconds) = dict(engine.counters), (COMPILES.count, COMPILES.seconds)
    rows = max(1, min(rows, engine.max_batch))
    vocab = engine.model.config.vocab_size  # (any text: ordinary tokens from the middle of the vocabulary)
    prompt = engine.tokenizer.decode([(vocab // 2 + i) % vocab for i in range(8)])
    for group in ([tokens], [tokens + 2 * row for row in range(rows)] if rows > 1 else []):
        jobs = [engine.begin(engine.session(None), Sampling(max_tokens=n, ignore_eos=True), prompt=prompt)
                for n in group]
        while not all(job.done for job in jobs):
            engine.step(jobs)
        for job in jobs:
            engine.settle(job)
        failed = next((job.error for job in jobs if job.error), None)
        if failed is not None:
            raise RuntimeError(f"the decode step failed while warming up: {failed}")
    engine.counters.clear()
    engine.counters.update(counters)
    return {"compiles": COMPILES.count - count, "seconds": COMPILES.seconds - seconds}
