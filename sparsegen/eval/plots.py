"""Figures for the evaluation commands (matplotlib, headless)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_stream(summaries: list[dict], traces: list[tuple[list[int], int]], path: str | Path, title: str = "") -> None:
    """Log-perplexity per segment vs tokens (one line per policy) above KV memory vs tokens."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=[3, 2])
    for summary, (kv_bytes, every) in zip(summaries, traces):
        xs = [(s["start"] + s["end"]) / 2 for s in summary["segments"]]
        top.plot(xs, [math.log(s["ppl"]) for s in summary["segments"]], label=f"{summary['label']} (PPL {summary['ppl']:.1f})")
        bottom.plot([i * every for i in range(len(kv_bytes))], [b / 2**20 for b in kv_bytes], label=summary["label"])
    top.set_ylabel("log PPL per segment")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    if title:
        top.set_title(title, fontsize=10)
    bottom.set_ylabel("KV cache held (MiB)")
    bottom.set_xlabel("tokens into the stream")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
