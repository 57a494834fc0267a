"""Benchmark rows as a printed table, ratios between policies, and a plot (ms/token and peak memory vs context)."""

from __future__ import annotations

from pathlib import Path

COLUMNS = (  # header, width, row -> text
    ("policy", 17, lambda r: label(r)),
    ("context", 8, lambda r: f"{r['context']:,}"),
    ("batch", 6, lambda r: str(r["batch"])),
    ("prefill s", 10, lambda r: _num(r.get("prefill_seconds"), ".2f")),
    ("ms/tok", 11, lambda r: _num(r.get("ms_per_token"), ",.2f")),
    ("p90", 11, lambda r: _num(r.get("ms_per_token_p90"), ",.2f")),
    ("MLP ms", 9, lambda r: _num(r.get("mlp_ms_per_token"), ",.2f")),
    ("tok/s", 9, lambda r: _num(r.get("tokens_per_s"), ",.1f")),
    ("KV MiB", 9, lambda r: _num(_mib(r.get("peak_kv_bytes")), ",.1f")),
    ("peak MiB", 9, lambda r: _num(_mib(r.get("peak_memory_bytes")), ",.0f")),
    ("roofline", 9, lambda r: _num(r.get("roofline_fraction"), ".1%")),
    ("GB/s", 7, lambda r: _num(r.get("bandwidth_gb_s") if "roofline_fraction" in r else None, ",.1f")),
    ("syncs/tok", 10, lambda r: _num(r.get("host_syncs_per_token"), ",.0f")),
    ("accepted", 9, lambda r: _num(r.get("acceptance_rate"), ".0%")),
    ("max batch", 10, lambda r: _num(r.get("max_batch_at_limit"), ",d")),
)


def label(row: dict) -> str:
    """A row's name in the table: its policy, and llama.cpp's flash-attention setting where it was measured."""
    flash = row.get("flash_attn")
    return row["policy"] if flash is None else f"{row['policy']} fa-{'on' if flash else 'off'}"


def _mib(value):
    return None if value is None else value / 2**20


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def header() -> str:
    return "".join(f"{name:>{width}}" if i else f"{name:<{width}}" for i, (name, width, _) in enumerate(COLUMNS))


def format_row(row: dict) -> str:
    if "skipped" in row:
        return f"{row['policy']:<17}{row['context']:>8,}{row['batch']:>6}   skipped: {row['skipped']}"
    return "".join(f"{fmt(row):>{width}}" if i else f"{fmt(row):<{width}}" for i, (_, width, fmt) in enumerate(COLUMNS))


def speedups(rows: list[dict], baseline: str) -> list[tuple[str, int, int, float]]:
    """``(policy, context, batch, baseline ms / policy ms)`` for every measured row that has a baseline beside it."""
    base = {(r["context"], r["batch"]): r["ms_per_token"] for r in rows
            if r["policy"] == baseline and "ms_per_token" in r}
    return [(r["policy"], r["context"], r["batch"], base[(r["context"], r["batch"])] / r["ms_per_token"])
            for r in rows if r["policy"] != baseline and "ms_per_token" in r and (r["context"], r["batch"]) in base]


def _ms(rows: list[dict]) -> dict[tuple[str, int, int], float]:
    return {(r["policy"], r["context"], r["batch"]): r["ms_per_token"] for r in rows if "ms_per_token" in r}

# (context, batch): the speed-up over the full cache self-speculation is asked for there (issues 36 and 85)
SPECULATION_GOALS = {(8192, 8): 1.5, (8192, 1): 1.5, (32768, 1): 2.0}


def goals(rows: list[dict]) -> list[str]:
    """The issue's performance goals, as ratios of this run's own rows (only those the run measured)."""
    ms, lines = _ms(rows), []
    for (policy, context, batch), value in ms.items():
        if policy == "streaming" and ("recompute", context, batch) in ms:
            lines.append(f"streaming vs recompute (window {_budget(rows, 'recompute')}), {context:,} x {batch}: "
                         f"{ms[('recompute', context, batch)] / value:.1f}x faster per token (goal >= 25x)")
    longest = max((r["context"] for r in rows if "ms_per_token" in r), default=None)
    for policy in ("streaming", "h2o"):
        for batch in sorted({r["batch"] for r in rows}):
            if (policy, longest, batch) in ms and ("full", longest, batch) in ms:
                kv = {r["peak_kv_bytes"] for r in rows if r["policy"] == policy and r["batch"] == batch
                      and "peak_kv_bytes" in r}
                step_bytes = {r["policy"]: r["bytes_per_step"] for r in rows if r["context"] == longest
                              and r["batch"] == batch and "bytes_per_step" in r}
                lines.append(f"{policy} vs full at {longest:,} x {batch}: "
                             f"{ms[('full', longest, batch)] / ms[(policy, longest, batch)]:.1f}x faster "
                             f"(goal >= 6x; bytes read per step allow {step_bytes['full'] / step_bytes[policy]:.1f}x)"
                             + (f"; KV peak {'flat' if len(kv) == 1 else 'NOT flat'} over contexts"
                                if len({r["context"] for r in rows}) > 1 else ""))
    for (policy, context, batch), value in ms.items():
        if policy == "h2o" and ("window", context, batch) in ms:
            lines.append(f"h2o vs window, {context:,} x {batch}: {value / ms[('window', context, batch)] - 1:+.1%} "
                         f"per token (goal <= +5%)")
    for r in rows:
        full = ms.get(("full", r["context"], r["batch"]))
        if r["policy"].startswith("speculative") and "ms_per_token" in r and full and r["rows_per_round"]:
            ratio = full / r["ms_per_token"]
            goal = SPECULATION_GOALS.get((r["context"], r["batch"]))
            # (what a round spent against the full steps its tokens would have taken: why it pays or not)
            lines.append(f"{r['policy']} vs full at {r['context']:,} x {r['batch']}: {ratio:.2f}x the tokens/s"
                         + (f" (goal >= {goal}x)" if goal else "")
                         + f", lossless; {r['acceptance_rate']:.0%} of drafts accepted, {r['tokens_per_step']:.2f} "
                         f"tokens per full-cache step, {r['rows_per_round']:.1f} of {r['batch']} rows still generating "
                         f"a round; a round: {r['mean_draft_length']:.1f} draft steps of {r['draft_ms']:.1f} ms "
                         f"({r['draft_ms'] / full:.2f} of a full step) and a verification of {r['verify_ms']:.1f} ms "
                         f"({r['verify_ms'] / full:.1f} full steps); the KV cache is {r['kv_share']:.0%} of a full "
                         f"step's bytes")
    return lines


def model_speedups(rows: list[dict]) -> list[str]:
    """With several models in one run (e.g. dense and structurally pruned): each one's speed-up over the first."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    if len(models) < 2:
        return []
    base = {(r["policy"], r["context"], r["batch"]): r["ms_per_token"] for r in rows
            if r["model"] == models[0] and "ms_per_token" in r}
    lines = []
    for model in models[1:]:
        ratios = [f"{r['policy']} {r['context']:,}x{r['batch']} {base[key] / r['ms_per_token']:.2f}x"
                  for r in rows if r["model"] == model and "ms_per_token" in r
                  and (key := (r["policy"], r["context"], r["batch"])) in base]
        lines.append(f"speed-up of {model} over {models[0]} (ms/token): " + "; ".join(ratios))
        mlp = {key: r["mlp_ms_per_token"] for r in rows if r["model"] == models[0] and r.get("mlp_ms_per_token")
               for key in [(r["policy"], r["context"], r["batch"])]}
        mlp_ratios = [f"{r['policy']} {r['context']:,}x{r['batch']} {mlp[key] / r['mlp_ms_per_token']:.2f}x"
                      for r in rows if r["model"] == model and r.get("mlp_ms_per_token")
                      and (key := (r["policy"], r["context"], r["batch"])) in mlp]
        if mlp_ratios:
            lines.append(f"MLP speed-up of {model} over {models[0]} (MLP + predictor ms per step): "
                         + "; ".join(mlp_ratios))
    return lines


def _budget(rows: list[dict], policy: str):
    return next((r["budget"] for r in rows if r["policy"] == policy), None)


def markdown(rows: list[dict]) -> str:
    """The measured rows as a Markdown table (for docs)."""
    lines = ["| policy | context | batch | ms/token (median) | p90 | tokens/s | KV peak MiB | peak memory MiB | "
             "roofline |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms_per_token" not in r:
            lines.append(f"| {r['policy']} | {r['context']:,} | {r['batch']} | skipped: {r['skipped']} | | | | | |")
            continue
        lines.append(f"| {r['policy']} | {r['context']:,} | {r['batch']} | {r['ms_per_token']:.2f} | "
                     f"{_num(r['ms_per_token_p90'], '.2f')} | {r['tokens_per_s']:,.1f} | "
                     f"{_mib(r['peak_kv_bytes']):,.1f} | "
                     f"{_num(_mib(r.get('peak_memory_bytes')), ',.0f')} | {_num(r.get('roofline_fraction'), '.1%')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "ms_per_token" in r]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    several = len({r["model"] for r in measured}) > 1

    def series(r: dict) -> str:
        return f"{r['model']}: {r['policy']}" if several else r["policy"]

    policies = list(dict.fromkeys(series(r) for r in measured))
    colors = {p: f"C{i % 10}" for i, p in enumerate(policies)}
    batches = sorted({r["batch"] for r in measured})
    styles = {b: ("-o", "--s", "-.^", ":v")[i % 4] for i, b in enumerate(batches)}
    for batch in batches:
        for policy in policies:
            points = sorted(((r["context"], r) for r in measured if series(r) == policy and r["batch"] == batch),
                            key=lambda point: point[0])
            if not points:
                continue
            contexts = [c for c, _ in points]
            label = f"{policy}" + (f" (batch {batch})" if len(batches) > 1 else "")
            ax_time.plot(contexts, [r["ms_per_token"] for _, r in points], styles[batch], color=colors[policy],
                         label=label)
            memory = [(c, r["peak_memory_bytes"]) for c, r in points if r.get("peak_memory_bytes")]
            if memory:
                ax_mem.plot([c for c, _ in memory], [m / 2**20 for _, m in memory], styles[batch],
                            color=colors[policy], label=label)
            ax_mem.plot(contexts, [r["peak_kv_bytes"] / 2**20 for _, r in points], ":", color=colors[policy],
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
