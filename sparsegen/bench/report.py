"""Benchmark rows as a printed table, ratios between policies, and a plot (ms/token and peak memory vs context)."""

from __future__ import annotations

from pathlib import Path

COLUMNS = (  # header, width, row -> text
    ("policy", 14, lambda r: r["policy"]),
    ("context", 8, lambda r: f"{r['context']:,}"),
    ("batch", 6, lambda r: str(r["batch"])),
    ("prefill s", 10, lambda r: _num(r.get("prefill_seconds"), ".2f")),
    ("ms/tok", 9, lambda r: _num(r.get("ms_per_token"), ".2f")),
    ("p90", 8, lambda r: _num(r.get("ms_per_token_p90"), ".2f")),
    ("tok/s", 9, lambda r: _num(r.get("tokens_per_s"), ",.1f")),
    ("KV MiB", 9, lambda r: _num(_mib(r.get("peak_kv_bytes")), ",.1f")),
    ("peak MiB", 9, lambda r: _num(_mib(r.get("peak_memory_bytes")), ",.0f")),
    ("roofline", 9, lambda r: _num(r.get("roofline_fraction"), ".1%")),
    ("max batch", 10, lambda r: _num(r.get("max_batch_at_limit"), ",d")),
)


def _mib(value):
    return None if value is None else value / 2**20


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def header() -> str:
    return "".join(f"{name:>{width}}" if i else f"{name:<{width}}" for i, (name, width, _) in enumerate(COLUMNS))


def format_row(row: dict) -> str:
    if "skipped" in row:
        return f"{row['policy']:<14}{row['context']:>8,}{row['batch']:>6}   skipped: {row['skipped']}"
    return "".join(f"{fmt(row):>{width}}" if i else f"{fmt(row):<{width}}" for i, (_, width, fmt) in enumerate(COLUMNS))


def speedups(rows: list[dict], baseline: str) -> list[tuple[str, int, int, float]]:
    """``(policy, context, batch, baseline ms / policy ms)`` for every measured row that has a baseline beside it."""
    base = {(r["context"], r["batch"]): r["ms_per_token"] for r in rows
            if r["policy"] == baseline and "ms_per_token" in r}
    return [(r["policy"], r["context"], r["batch"], base[(r["context"], r["batch"])] / r["ms_per_token"])
            for r in rows if r["policy"] != baseline and "ms_per_token" in r and (r["context"], r["batch"]) in base]


def plot(rows: list[dict], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "ms_per_token" in r]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = sorted({(r["policy"], r["batch"]) for r in measured}, key=lambda s: (s[1], s[0]))
    batches = sorted({b for _, b in series})
    for policy, batch in series:
        points = sorted((r["context"], r) for r in measured if r["policy"] == policy and r["batch"] == batch)
        contexts = [c for c, _ in points]
        style = "-o" if batch == batches[0] else "--s"
        label = f"{policy} (batch {batch})"
        ax_time.plot(contexts, [r["ms_per_token"] for _, r in points], style, label=label)
        memory = [(c, r["peak_memory_bytes"]) for c, r in points if r.get("peak_memory_bytes")]
        if memory:
            ax_mem.plot([c for c, _ in memory], [m / 2**20 for _, m in memory], style, label=label)
        ax_mem.plot(contexts, [r["peak_kv_bytes"] / 2**20 for _, r in points], ":", color=ax_time.lines[-1].get_color(),
                    alpha=0.6)
    for ax, ylabel in ((ax_time, "decode ms per token"), (ax_mem, "peak memory, MiB (dotted: KV cache)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
