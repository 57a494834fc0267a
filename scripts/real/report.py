"""Markdown tables and plots from what scripts/real/*.sh wrote under docs/results/MODEL/ (missing runs are skipped).

usage: python scripts/real/report.py smollm2 [gemma3-270m ...] > tables.md
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from sparsegen.eval.plots import plot_stream
from sparsegen.prompt import PromptPrefix

MiB = 2**20


def read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def span(result: dict, start: int = 0, end: float = math.inf) -> float:
    """PPL over the segments that lie in [start, end) tokens (equal-length segments)."""
    inside = [s["ppl"] for s in result["segments"] if s["start"] >= start and s["end"] <= end]
    return math.exp(sum(math.log(p) for p in inside) / len(inside)) if inside else float("nan")


def streaming(root: Path, model: str, trained: int) -> str:
    out = [f"### StreamingLLM on {model}\n"]
    rows, curves = [], []
    for name in ["full"] + [f"{p}-{b}" for b in (256, 1024) for p in ("window", "streaming", "h2o", "streaming-h2o")]:
        r = read(root / f"{name}.json")
        if r is None:
            continue
        label = name if name == "full" else f"{name.rsplit('-', 1)[0]}, {name.rsplit('-', 1)[1]}"
        rows.append([label, f"{r['ppl']:.2f}", f"{span(r, end=trained):.2f}", f"{span(r, trained):.2f}",
                     f"{r['kv_tokens_peak']:,}", f"{r['kv_bytes_peak'] / MiB:.1f}", f"{r['tokens_per_s']:,.0f}"])
        curves.append((label, r))
    if rows:
        first = read(root / "full.json") or curves[0][1]
        out.append(f"{first['streams']} books streamed side by side, {first['tokens'] // first['streams']:,} tokens "
                   f"each; PPL after {trained:,} = tokens past the trained length.\n")
        out.append(table(["policy, budget", "PPL", f"PPL up to {trained:,}", f"PPL after {trained:,}",
                          "KV tokens peak", "KV MiB peak", "tokens/s"], rows))
        plot_curves(curves, root / "policies.png", f"{model}: streaming perplexity per 1,000 tokens, and KV held")
        out.append(f"![policies]({model}/streaming/policies.png)\n")
    sweep = []
    for budget in (256, 1024):
        cells = []
        for sinks in (0, 1, 2, 4, 8):
            name = {0: f"window-{budget}", 4: f"streaming-{budget}"}.get(sinks, f"sinks{sinks}-{budget}")
            r = read(root / f"{name}.json")
            cells.append(f"{r['ppl']:.2f} / {span(r, trained):.2f}" if r else "-")
        sweep.append([budget] + cells)
    if any(c != "-" for row in sweep for c in row[1:]):
        out.append("\nSink sweep (PPL over the stream / after the trained length):\n")
        out.append(table(["budget", "0 sinks (window)", "1", "2", "4", "8"], sweep))
    recompute = read(root / "recompute-256.json")
    if recompute:
        same = {p: read(root / f"{p}-256-short.json") for p in ("window", "streaming")}
        others = "".join(f"; {p} {r['ppl']:.2f} at {r['tokens_per_s']:,.0f}" for p, r in same.items() if r)
        out.append(f"\nSliding window with re-computation (window 256, one stream of {recompute['tokens']:,} tokens): "
                   f"PPL {recompute['ppl']:.2f} at {recompute['tokens_per_s']:,.1f} tokens/s{others} on the same "
                   f"tokens.\n")
    for window, name in ((256, "latency-recompute"), (1024, "latency-recompute-1024")):
        latency = read(root / f"{name}.json")
        ms = {row["policy"]: row for row in latency["rows"]} if latency else {}
        if {"streaming", "recompute"} <= set(ms):
            streaming_ms, recompute_ms = ms["streaming"]["ms_per_token"], ms["recompute"]["ms_per_token"]
            out.append(f"\nDecode latency at the same window ({window:,}) after a {ms['streaming']['context']:,}-token "
                       f"context: streaming {streaming_ms:.1f} ms/token, recompute {recompute_ms:.1f} ms/token "
                       f"(**{recompute_ms / streaming_ms:.1f}×**).\n")
    million = read(root / "million.json")
    if million:
        trace = million["trace"]
        rss = [b / MiB for b in trace["rss_bytes"] if b]
        plot_stream([million], [(trace["kv_bytes"], trace["every"])], root / "million.png",
                    f"{model}: {million['streams']} streams of {million['tokens'] // million['streams']:,} books/test "
                    f"tokens through streaming ({million['cache']['sinks']} sinks, budget {million['cache']['budget']})",
                    rss=[trace["rss_bytes"]])
        out.append(f"\nOne million tokens: {million['streams']} streams, {million['tokens']:,} tokens predicted in "
                   f"{million['seconds'] / 60:.0f} min ({million['tokens_per_s']:,.0f} tokens/s); PPL "
                   f"{million['ppl']:.2f}; KV held {max(trace['kv_bytes']) / MiB:.1f} MiB throughout; process RSS "
                   f"{min(rss):,.0f}–{max(rss):,.0f} MiB.\n")
    return "\n".join(out)


def plot_curves(curves: list[tuple[str, dict]], path: Path, title: str) -> None:
    """sparsegen's stream plot, from the JSON: the KV trace where the run wrote one; a run from before traces
    existed drawn as what it held (full growing linearly to its peak, a bounded policy flat at its peak)."""
    summaries, traces = [], []
    for label, r in curves:
        summaries.append({**r, "label": label})
        trace = r.get("trace")
        if trace:
            traces.append((trace["kv_bytes"], trace["every"]))
        else:
            length, peak, samples = r["tokens"] // r["streams"], r["kv_bytes_peak"], 20
            linear = r["cache"].get("budget") is None
            traces.append(([peak * i / samples if linear else peak for i in range(samples + 1)], length / samples))
    plot_stream(summaries, traces, path, title)


def h2o(root: Path, model: str) -> str:
    full = read(root / "ppl-full.json")
    if full is None:
        return ""
    out = [f"### H2O on {model}\n", f"{full['streams']} streams, {full['tokens'] // full['streams']:,} tokens "
           f"predicted in each; full cache PPL "
           f"**{full['ppl']:.2f}**. Fidelity: 8 prompts of half that length from Dracula, 64 greedy tokens, against "
           f"the full cache (budget a fraction of the prompt).\n"]
    rows = []
    for pct in (50, 20, 10):
        fidelity = read(root / f"fidelity-{pct}pct.json")
        scores = {f["policy"]: f for f in fidelity["policies"]} if fidelity else {}
        for policy in ("h2o", "streaming-h2o", "window", "streaming"):
            r, f = read(root / f"ppl-{policy}-{pct}pct.json"), scores.get(policy)
            if f is None:  # scripts/real/policies.sh writes one fidelity file per policy
                alone = read(root.parent / "policies" / f"fidelity-{policy}-{pct}pct.json")
                f = alone["policies"][0] if alone else None
            if r is None:
                continue
            rows.append([f"{pct}%", policy, f"{r['ppl']:.2f}", f"{r['ppl'] / full['ppl'] - 1:+.1%}",
                         f"{f['rouge_l']:.3f}" if f else "-", f"{f['tokens_to_divergence']:.1f}" if f else "-",
                         f"{f['kl']:.3f}" if f else "-"])
    out.append(table(["budget", "policy", "PPL", "vs full", "ROUGE-L", "tokens to divergence", "KL(full‖policy)"],
                     rows))
    return "\n".join(out)


PRUNED = (["dense"] + [f"{m}_{a}" for m in ("magnitude", "wanda", "sparsegpt") for a in ("0.5", "4of8", "2of4")]
          + [f"{m}_neurons{a}" for m in ("magnitude", "wanda") for a in ("0.25", "0.5")])


def pruning(root: Path, model: str) -> str:
    rows = []
    for tag in PRUNED:
        wiki, books = read(root / f"{tag}_wiki.json"), read(root / f"{tag}_books.json")
        if wiki is None or books is None:
            continue
        info = read(root / f"{tag}_sparsity.json")
        if info is None:
            amount, seconds = "-", "-"
        else:
            amount = f"{info['achieved']:.3f}" if "achieved" in info else f"{info['removed']:.1%} of parameters"
            seconds = f"{info['seconds']:.0f}"
        rows.append([tag.replace("of", ":").replace("_", " "), f"{wiki['ppl']:.2f}", f"{books['ppl']:.2f}", amount,
                     seconds])
    if not rows:
        return ""
    dense = read(root / "dense_wiki.json")
    return (f"### Pruning {model}\n\n128 calibration sequences of 512 tokens from books/train; perplexity over "
            f"{dense['windows']} windows of {dense['ctx']:,} tokens.\n\n"
            + table(["model", "wiki.test.raw PPL", "books/test PPL", "zeros in pruned linears", "pruning s"], rows))


def contextual(root: Path, model: str) -> str:
    dense = read(root / "ppl-dense.json")
    if dense is None:
        return ""
    rows = [["dense", "-", f"{dense['ppl']:.2f}", "-"]]
    for pct in (25, 40, 50, 65):
        for suffix, targets in (("", "all linears"), ("-mlp", "MLP")):
            r, fit = read(root / f"ppl-teal{pct}{suffix}.json"), read(root / f"teal{pct}{suffix}.fit.json")
            if r is None:
                continue
            achieved = sum(fit["achieved_on_calibration"].values()) / len(fit["achieved_on_calibration"])
            rows.append([f"TEAL {pct}%", f"{targets} ({achieved:.0%})", f"{r['ppl']:.2f}",
                         f"{r['ppl'] / dense['ppl'] - 1:+.1%}"])
    for tag in ("dejavu50", "dejavu75", "dejavu50-heads25"):
        r, fit = read(root / f"ppl-{tag}.json"), read(root / f"{tag}.fit.json")
        if r is None:
            continue
        mlp = [layer["mlp"] for layer in fit["report"]]
        what = f"MLP {sum(m['sparsity'] for m in mlp) / len(mlp):.0%}"
        if fit["heads_skipped"]:
            what += f", heads {fit['heads_skipped']:.0%}"
        rows.append(["Deja Vu", what, f"{r['ppl']:.2f}", f"{r['ppl'] / dense['ppl'] - 1:+.1%}"])
    out = [f"### Contextual sparsity on {model}\n", f"Perplexity over {dense['windows']} windows of "
           f"{dense['ctx']:,} tokens of books/test (TEAL: sparsity reached on the calibration text).\n",
           table(["method", "sparsified", "PPL", "vs dense"], rows)]
    recall = []
    for tag in ("dejavu50", "dejavu75", "dejavu50-heads25"):
        fit = read(root / f"{tag}.fit.json")
        if fit is None:
            continue
        for kind in ("mlp", "heads"):
            layers = [layer[kind] for layer in fit["report"] if kind in layer]
            if layers:
                mean = lambda key: sum(layer[key] for layer in layers) / len(layers)  # noqa: E731
                recall.append([tag, kind, f"{mean('k'):.0f} of {layers[0]['units']}", f"{mean('recall'):.3f}",
                               f"{min(layer['recall'] for layer in layers):.3f}", f"{mean('mass_recall'):.3f}"])
    if recall:
        out.append("\nDeja Vu predictors, a layer ahead, on held-out calibration windows (mean over layers):\n")
        out.append(table(["plan", "units", "K kept", "recall", "worst layer", "mass recall"], recall))
    bench = read(root / "bench.json")
    if bench:
        rows = [[Path(row["model"].split(" + ")[1]).name if " + " in row["model"] else "dense", f"{row['ms_per_token']:.2f}",
                 f"{row.get('mlp_ms_per_token') or float('nan'):.2f}"] for row in bench["rows"]]
        out.append("\nBatch-1 decode after a 512-token context (ms/token, whole step and MLP blocks):\n")
        out.append(table(["plan", "ms/token", "MLP ms/token"], rows))
    return "\n".join(out)


def soft_prompts(root: Path) -> list[tuple[str, str]]:
    """(file suffix, row title) for every soft prompt trained, described from its own metadata."""
    found = []
    for path in root.glob("soft-*.safetensors"):
        info = PromptPrefix.load(path).info
        loss = "next-token" if info["loss"] == "next_token" else "KL to dense"
        title = f"+ soft prompt ({loss}; {info['tokens']} tokens, {info['steps']} steps, lr {info['lr']:g})"
        found.append(((info["steps"], info["tokens"], loss != "next-token"), f"-{path.stem}", title))
    return [(suffix, title) for _, suffix, title in sorted(found)]


def prompt(root: Path, model: str) -> str:
    dense, wiki_dense = read(root / "ppl-dense-books.json"), read(root / "ppl-dense-wiki.json")
    if dense is None or wiki_dense is None:
        return ""
    rows = []
    names = {"wanda50-int4": "Wanda 50% + int4", "sgpt50-int8": "SparseGPT 50% + int8", "wanda24-int4": "2:4 + int4"}
    for name, title in names.items():
        base_books, base_wiki = read(root / f"ppl-{name}-books.json"), read(root / f"ppl-{name}-wiki.json")
        if base_books is None:
            continue
        for suffix, how in [("", "compressed"), ("-hard", "+ hard prompt")] + soft_prompts(root):
            books, wiki = read(root / f"ppl-{name}{suffix}-books.json"), read(root / f"ppl-{name}{suffix}-wiki.json")
            if books is None:
                continue

            def cell(r, base, reference):
                if r is None:
                    return "-"
                if not suffix:
                    return f"{r['ppl']:.2f}"
                gap = base["ppl"] - reference["ppl"]
                return f"{r['ppl']:.2f} ({(base['ppl'] - r['ppl']) / gap:+.0%})"
            rows.append([title, how, cell(books, base_books, dense), cell(wiki, base_wiki, wiki_dense)])
    return (f"### Compress, then prompt on {model}\n\nPerplexity over {dense['windows']} windows of {dense['ctx']} "
            f"tokens; in brackets the share of the compression's gap recovered. Dense: books {dense['ppl']:.2f}, "
            f"wiki {wiki_dense['ppl']:.2f}. The soft prompts are trained on Wanda 50% + int4 only.\n\n"
            + table(["compression", "", "books/test PPL", "wiki.test.raw PPL"], rows))


def passkey(root: Path, model: str) -> str:
    """One table per grid that passkey.sh wrote (full.json, full-TAG.json, ...)."""
    tags = sorted(path.stem[len("full"):] for path in root.glob("full*.json"))
    return "\n".join(passkey_grid(root, model, tag) for tag in tags)


def passkey_grid(root: Path, model: str, tag: str) -> str:
    results = {p: read(root / f"{p}{tag}.json") for p in ("full", "streaming", "h2o")}
    results = {p: r for p, r in results.items() if r}
    if not results:
        return ""
    rows = []
    for policy, r in results.items():
        cells = r["policies"][policy]
        per_length = {n: [c["accuracy"] for c in cells["cells"] if c["length"] == n] for n in cells["lengths"]}
        budget = cells.get("budget") or "-"
        rows.append([policy, budget] + [f"{sum(a) / len(a):.0%}" for a in per_length.values()]
                    + [f"{cells['accuracy']:.0%}"])
    first = next(iter(results))
    grid = results[first]["policies"][first]
    depths = ", ".join(f"{d:.0%}" for d in grid["depths"])
    prompt_text = results[first]["prompt"].replace("\n", "\\n")
    return (f"### Pass-key retrieval on {model}\n\nAccuracy over depths {depths} ({len(grid['depths'])} depths × "
            f"{grid['trials']} keys per length). Prompt: `{prompt_text}`\n\n"
            + table(["policy", "budget"] + [f"{n:,}" for n in grid["lengths"]] + ["all"], rows))


POLICY_LIBRARY = ("h2o", "streaming-h2o", "scissorhands", "tova", "adakv", "pyramid", "streaming", "snapkv", "lagkv",
                  "keydiff", "window", "knorm", "random")


def plot_policies(root: Path, model: str, ppl_root: Path, full: dict) -> None:
    """policies.png: at a 20% budget, each policy's PPL change and pass-key accuracy, with and without 4-bit KV; and
    PPL against the budget where several budgets were run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def value(path: Path, read_value):
        r = read(path)
        return None if r is None else read_value(r)

    names = [p for p in POLICY_LIBRARY if (ppl_root / f"ppl-{p}-20pct.json").exists()
             or (root / f"passkey-{p}-20pct.json").exists()]
    if not names:
        return
    curves = {}
    for policy in POLICY_LIBRARY:
        points = [(pct, value(ppl_root / f"ppl-{policy}-{pct}pct.json", lambda r: r["ppl"])) for pct in (10, 20, 50)]
        points = [(pct, v) for pct, v in points if v is not None]
        if len(points) > 1:
            curves[policy] = points
    fig, axes = plt.subplots(1, 3 if curves else 2, figsize=(15 if curves else 10, 4.5))
    width = 0.4
    for offset, tag, label, color in ((-width / 2, "", "as computed", "C0"), (width / 2, "-kv4", "4-bit KV", "C1")):
        change = [value(ppl_root / f"ppl-{p}-20pct{tag}.json", lambda r: r["ppl"] / full["ppl"] - 1) for p in names]
        keys = [value(root / f"passkey-{p}-20pct{tag}.json",
                      lambda r: next(iter(r["policies"].values()))["accuracy"]) for p in names]
        x = [i + offset for i in range(len(names))]
        axes[0].bar([i for i, c in zip(x, change) if c is not None], [100 * c for c in change if c is not None],
                    width, label=label, color=color)
        axes[1].bar([i for i, k in zip(x, keys) if k is not None], [100 * k for k in keys if k is not None], width,
                    label=label, color=color)
    axes[0].set(yscale="log", ylabel="streaming PPL over the full cache, %", title="PPL at a 20% budget")
    axes[1].set(ylabel="pass-key accuracy, %", title="pass-key, 2,048 tokens, 20% budget")
    for ax in axes[:2]:
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    if curves:
        for policy, points in curves.items():
            axes[2].plot(*zip(*points), marker="o", label=policy)
        axes[2].axhline(full["ppl"], color="black", linestyle="--", label="full")
        axes[2].set(xlabel="KV budget, % of the stream", ylabel="streaming PPL", yscale="log",
                    title="PPL against budget")
        axes[2].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{model}: the policy library")
    fig.tight_layout()
    fig.savefig(root / "policies.png", dpi=110)
    plt.close(fig)


def policies(root: Path, model: str) -> str:
    """The policy-library comparison (scripts/real/policies.sh): one row per policy, columns per budget and KV bits;
    and a plot of PPL against budget."""
    ppl_root = root.parent / "h2o"
    full = read(ppl_root / "ppl-full.json")
    if full is None or not root.exists():
        return ""
    bench = {f"{pct}pct{tag}": {row["policy"]: row for row in json.loads(path.read_text())["rows"]}
             for pct in (50, 20, 10) for tag in ("", "-kv4") if (path := root / f"bench-{pct}pct{tag}.json").exists()}

    def ppl(name):
        r = read(ppl_root / f"ppl-{name}.json")
        return "-" if r is None else f"{r['ppl'] / full['ppl'] - 1:+.1%}"

    def fidelity(name, key, digits):
        r = read(root / f"fidelity-{name}.json")
        return "-" if r is None else f"{r['policies'][0][key]:.{digits}f}"

    def passkey(name):
        r = read(root / f"passkey-{name}.json")
        return "-" if r is None else f"{next(iter(r['policies'].values()))['accuracy']:.0%}"

    def speed(policy, name):
        row = bench.get(name, {}).get(policy)
        return "-" if row is None or "ms_per_token" not in row else \
            f"{row['ms_per_token']:.1f} / {row['peak_kv_bytes'] / MiB:.1f}"

    rows = []
    for policy in POLICY_LIBRARY:
        rows.append([policy] + [ppl(f"{policy}-{pct}pct") for pct in (50, 20, 10)] + [ppl(f"{policy}-20pct-kv4")]
                    + [fidelity(f"{policy}-20pct{tag}", key, digits) for key, digits in (("rouge_l", 3), ("kl", 3))
                       for tag in ("", "-kv4")]
                    + [passkey(f"{policy}-20pct{tag}") for tag in ("", "-kv4")]
                    + [speed(policy, f"20pct{tag}") for tag in ("", "-kv4")])
    rows.append(["full", "0", "0", "0", ppl("full-kv4"), "1", fidelity("full-kv4", "rouge_l", 3), "0",
                 fidelity("full-kv4", "kl", 3), passkey("full"), passkey("full-kv4"), speed("full", "20pct"), speed("full", "20pct-kv4")])
    plot_policies(root, model, ppl_root, full)
    header = ["policy", "PPL 50%", "PPL 20%", "PPL 10%", "PPL 20% +4-bit KV", "ROUGE-L 20%", "+4-bit",
              "KL 20%", "+4-bit", "pass-key 20%", "+4-bit", "ms/token / KV MiB 20%", "+4-bit"]
    by_budget = [[policy] + [fidelity(f"{policy}-{pct}pct", key, 3) for key in ("rouge_l", "kl") for pct in (50, 20, 10)]
                 for policy in POLICY_LIBRARY]
    quantized = [[policy] + [ppl(f"{policy}-{pct}pct-kv4") for pct in (50, 20, 10)]
                 + [fidelity(f"{policy}-{pct}pct-kv4", key, 3) for key in ("rouge_l", "kl") for pct in (50, 20, 10)]
                 + [passkey(f"{policy}-{pct}pct-kv4") for pct in (50, 20, 10)] for policy in POLICY_LIBRARY]
    quantized.append(["full"] + [ppl("full-kv4")] * 3 + [fidelity("full-kv4", "rouge_l", 3)] * 3
                     + [fidelity("full-kv4", "kl", 3)] * 3 + [passkey("full-kv4")] * 3)
    retrieval_and_speed = [[policy] + [passkey(f"{policy}-{pct}pct") for pct in (50, 20, 10)]
                           + [speed(policy, f"{pct}pct{tag}") for tag in ("", "-kv4") for pct in (50, 20, 10)]
                           for policy in POLICY_LIBRARY]
    retrieval_and_speed.append(["full"] + [passkey("full")] * 3
                               + [speed("full", f"{pct}pct{tag}") for tag in ("", "-kv4") for pct in (50, 20, 10)])
    return (f"### The policy library on {model}\n\nPPL: change over the full cache ({full['ppl']:.2f}), 8 streams "
            f"of 2,048 books/test tokens, budget a share of the stream. Fidelity (ROUGE-L, KL(full‖policy)): 8 "
            f"Dracula prompts of 1,024 tokens, 64 greedy tokens. Pass-key: 2,048 tokens, depths 0–100%, 4 keys "
            f"each. Decode: batch 1 after a synthetic 2,048-token prefill.\n\n" + table(header, rows)
            + "\n\nFidelity against the full cache at every budget:\n\n"
            + table(["policy", "ROUGE-L 50%", "20%", "10%", "KL 50%", "20%", "10%"], by_budget)
            + "\n\nWith 4-bit KV at every budget (PPL against the float full cache; fidelity against the float full "
            "cache's continuations):\n\n"
            + table(["policy", "PPL 50%", "20%", "10%", "ROUGE-L 50%", "20%", "10%", "KL 50%", "20%", "10%",
                     "pass-key 50%", "20%", "10%"], quantized)
            + "\n\nPass-key and decode (ms/token / KV MiB) at every budget:\n\n"
            + table(["policy", "pass-key 50%", "20%", "10%", "decode 50%", "20%", "10%", "4-bit KV 50%", "20%", "10%"],
                    retrieval_and_speed))


TRAINED = {"smollm2": 8192, "gemma3-270m": 32768}

if __name__ == "__main__":
    for model in sys.argv[1:] or ["smollm2"]:
        base = Path("docs/results") / model
        for part in (streaming(base / "streaming", model, TRAINED.get(model, 8192)), h2o(base / "h2o", model),
                     policies(base / "policies", model),
                     passkey(base / "passkey", model), pruning(base / "pruning", model),
                     contextual(base / "contextual", model), prompt(base / "prompt", model)):
            if part:
                print(part)
