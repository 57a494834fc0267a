"""Streaming perplexity (the StreamingLLM protocol): every token predicted with exactly the cache a policy holds.

Several independent streams (e.g. several books) run as one batch, one token per step, so the cost per
token falls with the batch. ``recompute`` is the sliding-window-with-recomputation baseline: each token
is predicted by re-encoding the last ``window`` tokens from scratch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sparsegen.data import text_files
from sparsegen.engine.step import forward
from sparsegen.kv import Policy, PolicySpec
from sparsegen.kv.spec import as_spec
from sparsegen.memory import current_rss
from sparsegen.models.spec import kv_bytes_per_token


def read_tokens(path: str | Path, tokenizer, max_tokens: int, block_chars: int = 1 << 18) -> np.ndarray:
    """The first ``max_tokens`` tokens of a text file, read and tokenized block by block (paragraph bounds)."""
    tokens: list[int] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        carry = ""
        while len(tokens) < max_tokens:
            block = f.read(block_chars)
            text = carry + block
            if block:
                cut = text.rfind("\n\n")
                cut = cut + 2 if cut > 0 else len(text)
                text, carry = text[:cut], text[cut:]
            if text:
                tokens.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if not block:
                break
    return np.asarray(tokens[:max_tokens], dtype=np.int64)


def make_streams(path: str | Path, tokenizer, total_tokens: int, streams: int | None = None,
                 bos_id: int | None = None) -> torch.Tensor:
    """``[n, length]`` token rows: one per file (or one file cut into ``streams`` parts), BOS first if given.

    ``total_tokens`` is split evenly over the rows; every row has the same length.
    """
    files = text_files(path)
    n = streams or min(len(files), 4)
    per_row = math.ceil(total_tokens / n)
    if len(files) >= n:
        rows = [read_tokens(f, tokenizer, per_row) for f in files[:n]]
    else:
        whole = np.concatenate([read_tokens(f, tokenizer, per_row * n) for f in files])
        rows = [whole[i * per_row:(i + 1) * per_row] for i in range(n)]
    length = min(len(r) for r in rows)
    if length < 2:
        raise ValueError(f"{path} gives fewer than 2 tokens per stream")
    data = torch.from_numpy(np.stack([r[:length] for r in rows]))
    if bos_id is not None:
        data = torch.cat([torch.full((n, 1), bos_id), data], dim=1)
    return data


@dataclass
class StreamResult:
    label: str
    nll: torch.Tensor  # [streams, predicted tokens], fp64
    kv_tokens: list[int] = field(default_factory=list)  # held per layer (max), sampled every `every` steps
    kv_bytes: list[int] = field(default_factory=list)
    rss_bytes: list[int] = field(default_factory=list)  # the process's resident memory at the same samples
    elapsed: list[float] = field(default_factory=list)  # seconds since the start at the same samples
    every: int = 1
    seconds: float = 0.0
    cache: dict = field(default_factory=dict)

    def summary(self, segment: int) -> dict:
        per_position = self.nll.mean(0)
        segments = [
            {"start": s, "end": min(s + segment, len(per_position)),
             "ppl": math.exp(per_position[s:s + segment].mean().item())}
            for s in range(0, len(per_position), segment)
        ]
        return {
            "label": self.label,
            "ppl": math.exp(self.nll.mean().item()),
            "tokens": self.nll.numel(),
            "streams": self.nll.shape[0],
            "kv_tokens_peak": self.cache.get("kv_tokens_peak", max(self.kv_tokens, default=0)),
            "kv_bytes_peak": self.cache.get("kv_bytes_peak", max(self.kv_bytes, default=0)),
            "seconds": round(self.seconds, 2),
            "tokens_per_s": round(self.nll.numel() / self.seconds, 1) if self.seconds else None,
            "segments": segments,
            "cache": self.cache,
            "trace": {"every": self.every, "kv_bytes": self.kv_bytes, "rss_bytes": self.rss_bytes,
                      "seconds": [round(t, 2) for t in self.elapsed]},
        }


@torch.inference_mode()
def stream_nll(model, data: torch.Tensor, policy: PolicySpec | Policy, every: int = 256, chunk: int = 256,
               label: str | None = None, progress: bool = True) -> StreamResult:
    """NLL of every next token of ``data`` ``[streams, length]`` fed through a cache under ``policy`` (a fractional
    budget is of ``length``).

    Every policy is fed ``chunk`` tokens per call, which computes exactly what one token per call would: under
    order policies (full, window, streaming) each query sees only its own window; under attention policies (H2O)
    the cache replays the per-token evictions inside each layer (``EvictionCache(stepwise=True)``).
    """
    device = next(model.parameters()).device
    data = data.to(device)
    streams, length = data.shape
    cache = as_spec(policy).cache(model, length, chunk_size=chunk, stepwise=True)
    nll = torch.empty(streams, length - 1, dtype=torch.float64)
    quantization = cache.quantization
    result = StreamResult(label or cache.policy.name + (f"+kv{quantization.bits}" if quantization else ""), nll,
                          every=every)
    bar = tqdm(total=length - 1, desc=result.label, unit="tok", disable=not progress, mininterval=1.0)
    t0 = time.perf_counter()
    next_sample = 0
    for start in range(0, length - 1, chunk):
        end = min(start + chunk, length - 1)
        position = torch.arange(start, end, device=device)[None].expand(streams, -1)
        logits = forward(model, cache, data[:, start:end], position)
        nll[:, start:end] = F.cross_entropy(logits.float().transpose(1, 2), data[:, start + 1:end + 1],
                                            reduction="none").double().cpu()
        while next_sample < end:
            held = max(cache.held_tokens())
            result.kv_tokens.append(held)
            result.kv_bytes.append(cache.held_bytes())
            result.rss_bytes.append(current_rss() or 0)
            result.elapsed.append(time.perf_counter() - t0)
            next_sample += every
        bar.update(end - start)
        bar.set_postfix(tok_s=f"{streams * end / (time.perf_counter() - t0):,.0f}", kv=max(cache.held_tokens()))
    bar.close()
    result.seconds = time.perf_counter() - t0
    result.cache = cache.stats()
    return result


@torch.inference_mode()
def recompute_nll(model, data: torch.Tensor, window: int, batch_size: int = 16, every: int = 256,
                  progress: bool = True) -> StreamResult:
    """Sliding window with re-computation: token t+1 predicted from the last ``window`` tokens, encoded afresh."""
    device = next(model.parameters()).device
    data = data.to(device)
    streams, length = data.shape
    nll = torch.empty(streams, length - 1, dtype=torch.float64)
    bytes_per_token = kv_bytes_per_token(model.config, next(model.parameters()).element_size())
    result = StreamResult(f"recompute-{window}", nll, every=every)
    bar = tqdm(total=length - 1, desc=result.label, unit="step", disable=not progress, mininterval=1.0)
    t0 = time.perf_counter()
    for start in range(0, length - 1, batch_size):
        targets = list(range(start, min(start + batch_size, length - 1)))
        short = [t for t in targets if t + 1 < window]
        full = [t for t in targets if t + 1 >= window]
        for t in short:  # the first windows are shorter than `window`: encode them as they are
            logits = model(input_ids=data[:, : t + 1], logits_to_keep=1).logits[:, -1]
            nll[:, t] = F.cross_entropy(logits.float(), data[:, t + 1], reduction="none").double().cpu()
        if full:  # equal-length windows of every stream for several targets: one batched forward
            index = torch.tensor(full, device=device)[:, None] + torch.arange(1 - window, 1, device=device)
            windows = data[:, index].reshape(-1, window)
            logits = model(input_ids=windows, logits_to_keep=1).logits[:, -1].view(streams, len(full), -1)
            after = data[:, torch.tensor(full, device=device) + 1]
            nll[:, full] = F.cross_entropy(logits.float().transpose(1, 2), after, reduction="none").double().cpu()
        for t in targets:
            if t % every == 0:
                held = min(t + 1, window)
                result.kv_tokens.append(held)
                result.kv_bytes.append(held * bytes_per_token * streams)
                result.rss_bytes.append(current_rss() or 0)
                result.elapsed.append(time.perf_counter() - t0)
        bar.update(len(targets))
        bar.set_postfix(tok_s=f"{streams * (targets[-1] + 1) / (time.perf_counter() - t0):,.0f}")
    bar.close()
    result.seconds = time.perf_counter() - t0
    result.cache = {"policy": "recompute", "window": window}
    return result
