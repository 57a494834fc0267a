"""The memory-bandwidth roofline of decode: each step reads every weight once plus the KV it attends to.

At batch ``b`` a step makes ``b`` tokens, so the fastest possible decode is
``b * bandwidth / (weight_bytes + b * kv_tokens * kv_bytes_per_token)`` tokens per second.
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: str | torch.device = "cpu", megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a large copy (read + write counted), best of ``repeats``."""
    device = torch.device(device)
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every parameter and saved buffer (packed int4/int8 weights and their
    scales are buffers) except embedding tables, of which a step reads one row per token (an input embedding tied to
    the output layer is read whole, once)."""
    from sparsegen.quant.fast import BlockEmbedding

    output = model.get_output_embeddings()
    read_whole = {t.data_ptr() for t in weights(output)} if output is not None else set()
    tables = [t for m in model.modules() for t in ([m.weight] if isinstance(m, torch.nn.Embedding) else
                                                   [m.codes, m.scales] if isinstance(m, BlockEmbedding) else [])]
    lookups = {t.data_ptr() for t in tables} - read_whole
    stored = list(weights(model))  # (held while counted: a freed temporary's address could come back)
    once = {t.data_ptr(): t.numel() * t.element_size() for t in stored}  # (a tied head's table: once)
    return sum(size for pointer, size in once.items() if pointer not in lookups)


def weights(model: torch.nn.Module):
    """The parameters and the saved (persistent) buffers: what a checkpoint stores, rotary tables left out; and what
    a module stores outside tensors it owns (``stored_tensors()``: FBGEMM's packed weights)."""
    yield from model.parameters()
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield buffer
        if hasattr(module, "stored_tensors"):
            yield from module.stored_tensors()


def decode_bytes(weight_bytes: int, kv_tokens: float, kv_bytes_per_token: int, batch: int) -> float:
    """Bytes one decode step must read: the weights once, and each sequence's attended KV."""
    return weight_bytes + batch * kv_tokens * kv_bytes_per_token


def roofline_tokens_per_s(bandwidth: float, bytes_per_step: float, batch: int) -> float:
    return batch * bandwidth / bytes_per_step
