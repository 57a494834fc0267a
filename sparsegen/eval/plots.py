"""Figures for the evaluation commands (matplotlib, headless)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_stream(summaries: list[dict], traces: list[tuple[list[int], int]], path: str | Path, title: str = "",
                rss: list[list[int]] | None = None) -> None:
    """Log-perplexity per segment vs tokens (one line per policy) above KV memory vs tokens; with ``rss`` (the
    process's resident bytes at the same samples as each trace), that too, dashed, on a log scale."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=[3, 2])
    for n, (summary, (kv_bytes, every)) in enumerate(zip(summaries, traces)):
        xs = [(s["start"] + s["end"]) / 2 for s in summary["segments"]]
        top.plot(xs, [math.log(s["ppl"]) for s in summary["segments"]], label=f"{summary['label']} (PPL "
                                                                              f"{summary['ppl']:.1f})")
        steps = [i * every for i in range(len(kv_bytes))]
        bottom.plot(steps, [b / 2**20 for b in kv_bytes], color=f"C{n}", label=f"{summary['label']}: KV held")
        if rss and any(rss[n]):  # zeros where the platform reports no RSS
            bottom.plot(steps[: len(rss[n])], [b / 2**20 for b in rss[n]], color=f"C{n}", ls="--",
                        label=f"{summary['label']}: process RSS")
    top.set_ylabel("log PPL per segment")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    if title:
        top.set_title(title, fontsize=10)
    bottom.set_ylabel("MiB" if rss else "KV cache held (MiB)")
    if rss:
        bottom.set_yscale("log")
        bottom.legend(fontsize=8)
    bottom.set_xlabel("tokens into the stream")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_passkey(results: dict[str, dict], path: str | Path) -> None:
    """One accuracy heatmap (context length x needle depth) per policy."""
    import numpy as np

    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results) + 1, 3.2), squeeze=False)
    for ax, (label, result) in zip(axes[0], results.items()):
        grid = np.array([[c["accuracy"] for c in result["cells"] if c["length"] == n] for n in result["lengths"]])
        image = ax.imshow(grid.T, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(result["lengths"])), [str(n) for n in result["lengths"]], fontsize=7)
        ax.set_yticks(range(len(result["depths"])), [f"{d:.0%}" for d in result["depths"]], fontsize=7)
        ax.set_xlabel("context tokens")
        ax.set_title(f"{label} ({result['accuracy']:.0%})", fontsize=9)
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(image, ax=axes[0].tolist(), label="accuracy")
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the colorbar's layout leaves the y label outside the figure
    plt.close(fig)


def plot_ruler(rows: list[dict], path: str | Path) -> None:
    """RULER's needle tasks as ``plot_passkey``'s heat maps: the mean score over the needle tasks per (length, depth),
    one map per policy and protocol."""
    import numpy as np

    grouped: dict[str, dict[tuple[int, float], list[float]]] = {}
    for row in rows:
        for depth, value in (row["depths"] or {}).items():
            cell = grouped.setdefault(f"{row['policy']} ({row['protocol']})", {})
            cell.setdefault((row["length"], float(depth)), []).append(value)
    if not grouped:
        raise ValueError("no needle task was run: a RULER heat map needs one of the niah_* tasks")
    results = {}
    for label, cells in grouped.items():
        lengths, depths = sorted({n for n, _ in cells}), sorted({d for _, d in cells})
        scores = [{"length": n, "depth": d, "accuracy": float(np.mean(cells.get((n, d), [np.nan])))}
                  for n in lengths for d in depths]
        results[label] = {"lengths": lengths, "depths": depths, "cells": scores,
                          "accuracy": float(np.nanmean([c["accuracy"] for c in scores]))}
    plot_passkey(results, path)


def plot_turns(runs: dict[str, list[dict]], path: str | Path, title: str = "") -> None:
    """Per-turn latency (top) and KV memory held and process RSS (bottom) of chat runs, one line per run."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for label, turns in runs.items():
        xs = [t["turn"] for t in turns]
        top.plot(xs, [1000 * t["seconds"] / max(1, t["new_tokens"] + t["prompt_tokens"]) for t in turns],
                 label=label, lw=0.8)
        bottom.plot(xs, [t["kv_bytes"] / 2**20 for t in turns], label=f"{label}: KV held", lw=1.2)
        bottom.plot(xs, [(t["rss_bytes"] or 0) / 2**20 for t in turns], label=f"{label}: process RSS", lw=0.8, ls="--")
    top.set_ylabel("ms per token fed or generated")
    top.legend()
    bottom.set_ylabel("MiB")
    bottom.set_xlabel("turn")
    bottom.set_yscale("log")
    bottom.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_load(report: dict, path: str | Path, title: str = "") -> None:
    """Server memory (process RSS and K/V bytes held, with the K/V bound) after each turn of a load run, or every few
    conversations of a run that starts more than it runs at once."""
    fig, ax = plt.subplots(figsize=(8, 4))
    by_turn = bool(report["memory"])  # else sampled every few conversations
    points = report["memory"] if by_turn else report.get("samples", [])
    x = [m["turn"] if by_turn else m["conversations"] for m in points]
    ax.plot(x, [m["rss_bytes"] / 2**20 for m in points], label="server RSS")
    ax.plot(x, [m["kv_bytes"] / 2**20 for m in points], label="K/V allocated")
    if report.get("kv_bytes_bound"):
        ax.axhline(report["kv_bytes_bound"] / 2**20, color="gray", ls="--", lw=0.8, label="K/V bound (start-up)")
    ax.set_xlabel("turns completed by every session" if by_turn else "conversations completed")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.legend()
    concurrency = report.get("concurrency", report["sessions"])
    ax.set_title(title or (f"{report['sessions']} concurrent sessions" if concurrency == report["sessions"] else
                           f"{report['sessions']} sessions, {concurrency} at a time"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(rows: list[dict], path: str | Path, measures: dict[str, str],
               policy_label: Callable[[dict], str] = lambda row: row["policy"]) -> None:
    """A sweep's results: one panel per model × task × length, its measure (``measures[task]``) against the budget,
    a line per policy (``policy_label``: a row's name for it) and KV bit width; ``full`` (no budget) a dashed level."""
    panels = sorted({(r["model"], r["task"], r["length"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (model, task, length) in zip(axes[0], panels):
        mine = [r for r in rows if (r["model"], r["task"], r["length"]) == (model, task, length)]
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in mine:
            label = policy_label(r) + (f" kv{r['kv_bits']}" if r["kv_bits"] else "")
            lines.setdefault(label, []).append((r["budget"], r["metrics"][measures[task]]))
        for n, (label, points) in enumerate(sorted(lines.items())):
            if all(budget is None for budget, _ in points):
                ax.axhline(points[-1][1], color=f"C{n}", ls="--", label=label)
            else:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", color=f"C{n}", label=label)
        ax.set_xlabel("budget (tokens, or share of the length)")
        ax.set_ylabel(measures[task] if measures[task] == task else f"{task}: {measures[task]}")
        ax.set_title(f"{model}, {task} @ {length}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
