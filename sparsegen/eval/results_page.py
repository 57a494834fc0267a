"""The tables of ``docs/results.md``, generated from the JSON that ``examples/experiments/*.toml`` write under
``docs/results/MODEL/``, so no number on that page is typed by hand.

The page marks each generated table with ``<!-- results: NAME -->`` … ``<!-- /results -->``;
``sparsegen sweep report --doc docs/results.md`` rewrites every marked block from the JSON, and ``--check`` fails
where the page and the JSON disagree (a number edited by hand, a rerun not reported). The prose around the blocks
stays the author's. ``--plots`` redraws the figures the page shows.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

MiB = 2**20
TRAINED = {"smollm2": 8192, "gemma3-270m": 32768}  # trained context: the stream tables split their PPL there
POLICY_LIBRARY = ("h2o", "streaming-h2o", "scissorhands", "tova", "adakv", "pyramid", "streaming", "snapkv", "lagkv",
                  "keydiff", "window", "knorm", "random")
PRUNED = (["dense"] + [f"{m}_{a}" for m in ("magnitude", "wanda", "sparsegpt") for a in ("0.5", "4of8", "2of4")]
          + [f"{m}_neurons{a}" for m in ("magnitude", "wanda") for a in ("0.25", "0.5")])
STREAM_RUNS = ["full"] + [f"{p}-{b}" for b in (256, 1024) for p in ("window", "streaming", "h2o", "streaming-h2o")]
BLOCK = re.compile(r"(<!-- results: (?P<name>[\w./-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def number(value: float) -> str:
    """A perplexity or a time: two decimals with thousands separators, or a short exponent past 100,000."""
    if abs(value) < 1e5:
        return f"{value:,.2f}"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def span(result: dict, start: int = 0, end: float = math.inf) -> float:
    """PPL over the segments that lie in [start, end) tokens (equal-length segments)."""
    inside = [s["ppl"] for s in result["segments"] if s["start"] >= start and s["end"] <= end]
    return math.exp(sum(math.log(p) for p in inside) / len(inside)) if inside else float("nan")


def streaming(root: Path, model: str) -> dict[str, str]:
    """``streaming.toml``: every policy streamed past the trained length, and the sink sweep."""
    trained, blocks, rows = TRAINED.get(model, 8192), {}, []
    for name in STREAM_RUNS:
        r = read(root / f"{name}.json")
        if r is not None:
            label = name if name == "full" else f"{name.rsplit('-', 1)[0]}, {int(name.rsplit('-', 1)[1]):,}"
            rows.append([label, number(r["ppl"]), number(span(r, end=trained)), number(span(r, trained)),
                         f"{r['kv_tokens_peak']:,}", f"{r['kv_bytes_peak'] / MiB:,.1f}", f"{r['tokens_per_s']:,.0f}"])
    if rows:
        blocks[f"{model}/streaming"] = table(["policy, budget", "PPL", f"PPL up to {trained:,}",
                                              f"PPL after {trained:,}", "KV tokens peak", "KV MiB peak", "tokens/s"],
                                             rows)
    sweep = []
    for budget in (256, 1024):
        cells = []
        for sinks in (0, 1, 2, 4, 8):
            r = read(root / ({0: f"window-{budget}", 4: f"streaming-{budget}"}.get(sinks, f"sinks{sinks}-{budget}")
                             + ".json"))
            cells.append(f"{number(r['ppl'])} / {number(span(r, trained))}" if r else "-")
        sweep.append([f"{budget:,}"] + cells)
    if any(cell != "-" for row in sweep for cell in row[1:]):
        blocks[f"{model}/streaming-sinks"] = table(["budget", "0 sinks (window)", "1", "2", "4", "8"], sweep)
    return blocks


def plot_streaming(root: Path, model: str) -> None:
    """``policies.png`` (each policy's PPL per 1,000 tokens and the KV it held) and ``million.png``."""
    from sparsegen.eval.plots import plot_stream

    summaries, traces = [], []
    for name in STREAM_RUNS:
        r = read(root / f"{name}.json")
        if r is None:
            continue
        summaries.append({**r, "label": name})
        if r.get("trace"):
            traces.append((r["trace"]["kv_bytes"], r["trace"]["every"]))
        else:  # a run from before traces: full growing linearly to its peak, a bounded policy flat at its peak
            length, peak, samples = r["tokens"] // r["streams"], r["kv_bytes_peak"], 20
            linear = r["cache"].get("budget") is None
            traces.append(([peak * i / samples if linear else peak for i in range(samples + 1)], length / samples))
    if summaries:
        plot_stream(summaries, traces, root / "policies.png",
                    f"{model}: streaming perplexity per 1,000 tokens, and KV held")
    million = read(root / "million.json")
    if million:
        trace = million["trace"]
        plot_stream([million], [(trace["kv_bytes"], trace["every"])], root / "million.png",
                    f"{model}: {million['streams']} streams of {million['tokens'] // million['streams']:,} books/test "
                    f"tokens through streaming ({million['cache']['sinks']} sinks, "
                    f"budget {million['cache']['budget']})",
                    rss=[trace["rss_bytes"]])


def h2o(root: Path, model: str) -> dict[str, str]:
    """``h2o.toml``: streaming PPL and fidelity of the four policies the H2O paper compares, at 50/20/10%."""
    full = read(root / "ppl-full.json")
    if full is None:
        return {}
    rows = []
    for pct in (50, 20, 10):
        fidelity = read(root / f"fidelity-{pct}pct.json")
        scores = {f["policy"]: f for f in fidelity["policies"]} if fidelity else {}
        for policy in ("h2o", "streaming-h2o", "window", "streaming"):
            r, f = read(root / f"ppl-{policy}-{pct}pct.json"), scores.get(policy)
            if f is None:  # policies.toml writes one fidelity file per policy
                alone = read(root.parent / "policies" / f"fidelity-{policy}-{pct}pct.json")
                f = alone["policies"][0] if alone else None
            if r is not None:
                rows.append([f"{pct}%", policy, number(r["ppl"]), f"{r['ppl'] / full['ppl'] - 1:+,.1%}",
                             f"{f['rouge_l']:.3f}" if f else "-", f"{f['tokens_to_divergence']:.1f}" if f else "-",
                             f"{f['kl']:.3f}" if f else "-"])
    return {f"{model}/h2o": table(["budget", "policy", "PPL", "vs full", "ROUGE-L", "tokens to divergence",
                                   "KL(full‖policy)"], rows)}


def pruned_label(tag: str) -> str:
    method, amount = tag.split("_", 1)
    if amount.startswith("neurons"):
        return f"{method}, {float(amount[len('neurons'):]):.0%} of MLP neurons"
    return f"{method} {amount.replace('of', ':')}" if "of" in amount else f"{method} {float(amount):.0%}"


def pruning(root: Path, model: str) -> dict[str, str]:
    """``pruning.toml``: every method and pattern, PPL on two texts, zeros reached and seconds taken."""
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
            seconds = f"{info['seconds']:,.1f}" if info["seconds"] < 1 else f"{info['seconds']:,.0f}"
        rows.append(["dense" if tag == "dense" else pruned_label(tag), number(wiki["ppl"]), number(books["ppl"]),
                     amount, seconds])
    if not rows:
        return {}
    return {f"{model}/pruning": table(["model", "wiki.test.raw PPL", "books/test PPL", "zeros in pruned linears",
                                       "pruning s"], rows)}


def contextual(root: Path, model: str) -> dict[str, str]:
    """``contextual.toml``: TEAL and Deja Vu plans' PPL, the predictors' recall, and decode time per plan."""
    dense = read(root / "ppl-dense.json")
    if dense is None:
        return {}
    rows = [["dense", "-", number(dense["ppl"]), "-"]]
    for pct in (25, 40, 50, 65):
        for suffix, targets in (("", "all linears"), ("-mlp", "MLP")):
            r, fit = read(root / f"ppl-teal{pct}{suffix}.json"), read(root / f"teal{pct}{suffix}.fit.json")
            if r is not None:
                achieved = sum(fit["achieved_on_calibration"].values()) / len(fit["achieved_on_calibration"])
                rows.append([f"TEAL {pct}%", f"{targets} ({achieved:.0%})", number(r["ppl"]),
                             f"{r['ppl'] / dense['ppl'] - 1:+,.1%}"])
    recall = []
    for tag in ("dejavu50", "dejavu75", "dejavu50-heads25"):
        r, fit = read(root / f"ppl-{tag}.json"), read(root / f"{tag}.fit.json")
        if r is None or fit is None:
            continue
        mlp = [layer["mlp"] for layer in fit["report"]]
        what = f"MLP {sum(m['sparsity'] for m in mlp) / len(mlp):.0%}"
        if fit["heads_skipped"]:
            what += f", heads {fit['heads_skipped']:.0%}"
        rows.append(["Deja Vu", what, number(r["ppl"]), f"{r['ppl'] / dense['ppl'] - 1:+,.1%}"])
        for kind, units in (("mlp", "MLP neurons"), ("heads", "heads")):
            layers = [layer[kind] for layer in fit["report"] if kind in layer]
            if layers:
                def mean(key: str) -> float:
                    return sum(layer[key] for layer in layers) / len(layers)
                recall.append([tag, units, f"{mean('k'):,.0f} of {layers[0]['units']:,}", f"{mean('recall'):.3f}",
                               f"{min(layer['recall'] for layer in layers):.3f}", f"{mean('mass_recall'):.3f}"])
    blocks = {f"{model}/contextual": table(["method", "sparsified", "PPL", "vs dense"], rows)}
    if recall:
        blocks[f"{model}/contextual-recall"] = table(["Deja Vu plan", "units", "K kept", "recall", "worst layer",
                                                      "mass recall"], recall)
    bench = read(root / "bench.json")
    if bench:
        blocks[f"{model}/contextual-decode"] = table(["plan", "ms/token", "MLP ms/token"], [
            [Path(row["model"].split(" + ")[1]).name if " + " in row["model"] else "dense",
             f"{row['ms_per_token']:.2f}", f"{row.get('mlp_ms_per_token') or float('nan'):.2f}"]
            for row in bench["rows"]])
    return blocks


def soft_prompts(root: Path) -> list[tuple[str, str]]:
    """(file suffix, row title) for every soft prompt trained, described from its own metadata."""
    from sparsegen.prompt import PromptPrefix

    found = []
    for path in root.glob("soft-*.safetensors"):
        info = PromptPrefix.load(path).info
        loss = "next-token" if info["loss"] == "next_token" else "KL to dense"
        title = f"+ soft prompt ({loss}; {info['tokens']} tokens, {info['steps']} steps, lr {info['lr']:g})"
        found.append(((info["steps"], info["tokens"], loss != "next-token"), f"-{path.stem}", title))
    return [(suffix, title) for _, suffix, title in sorted(found)]


def prompt(root: Path, model: str) -> dict[str, str]:
    """``prompt.toml``: compressed models, with a hard prompt and with each soft prompt (share of the gap
    recovered)."""
    dense, wiki_dense = read(root / "ppl-dense-books.json"), read(root / "ppl-dense-wiki.json")
    if dense is None or wiki_dense is None:
        return {}
    rows = []
    names = {"wanda50-int4": "Wanda 50% + int4", "sgpt50-int8": "SparseGPT 50% + int8", "wanda24-int4": "2:4 + int4"}
    prompts = [("", "compressed"), ("-hard", "+ hard prompt")] + soft_prompts(root)
    for name, title in names.items():
        base_books, base_wiki = read(root / f"ppl-{name}-books.json"), read(root / f"ppl-{name}-wiki.json")
        for suffix, how in prompts if base_books is not None else []:
            books, wiki = read(root / f"ppl-{name}{suffix}-books.json"), read(root / f"ppl-{name}{suffix}-wiki.json")
            if books is None:
                continue

            def cell(r: dict | None, base: dict, reference: dict) -> str:
                if r is None:
                    return "-"
                if not suffix:
                    return number(r["ppl"])
                return f"{number(r['ppl'])} ({(base['ppl'] - r['ppl']) / (base['ppl'] - reference['ppl']):+.0%})"
            rows.append([title, how, cell(books, base_books, dense), cell(wiki, base_wiki, wiki_dense)])
    return {f"{model}/prompt": table(["compression", "", "books/test PPL", "wiki.test.raw PPL"], rows)}


def passkey(root: Path, model: str) -> dict[str, str]:
    """``passkey.toml``: one table per grid (``full.json``, ``full-TAG.json``, …): accuracy per length."""
    blocks = {}
    for tag in sorted(path.stem[len("full"):] for path in root.glob("full*.json")):
        results = {p: r for p in ("full", "streaming", "h2o") if (r := read(root / f"{p}{tag}.json"))}
        rows = []
        for policy, r in results.items():
            cells = r["policies"][policy]
            per_length = {n: [c["accuracy"] for c in cells["cells"] if c["length"] == n] for n in cells["lengths"]}
            budget = f"{cells['budget']:,}" if cells.get("budget") else "-"
            rows.append([policy, budget] + [f"{sum(a) / len(a):.0%}" for a in per_length.values()]
                        + [f"{cells['accuracy']:.0%}"])
        lengths = results["full" if "full" in results else next(iter(results))]["policies"]
        lengths = next(iter(lengths.values()))["lengths"]
        blocks[f"{model}/passkey{tag}"] = table(["policy", "budget"] + [f"{n:,}" for n in lengths] + ["all"], rows)
    return blocks


def policies(root: Path, model: str) -> dict[str, str]:
    """``policies.toml``: every policy at 50/20/10% with and without 4-bit K/V — PPL change, fidelity, pass-key,
    decode time and K/V held."""
    ppl_root = root.parent / "h2o"
    full = read(ppl_root / "ppl-full.json")
    if full is None or not root.exists():
        return {}
    bench = {f"{pct}pct{tag}": {row["policy"]: row for row in json.loads(path.read_text())["rows"]}
             for pct in (50, 20, 10) for tag in ("", "-kv4") if (path := root / f"bench-{pct}pct{tag}.json").exists()}

    def ppl(name: str) -> str:
        r = read(ppl_root / f"ppl-{name}.json")
        return "-" if r is None else f"{r['ppl'] / full['ppl'] - 1:+,.1%}"

    def fidelity(name: str, key: str) -> str:
        r = read(root / f"fidelity-{name}.json")
        return "-" if r is None else f"{r['policies'][0][key]:.3f}"

    def passkey_(name: str) -> str:
        r = read(root / f"passkey-{name}.json")
        return "-" if r is None else f"{next(iter(r['policies'].values()))['accuracy']:.0%}"

    def speed(policy: str, name: str) -> str:
        row = bench.get(name, {}).get(policy)
        return "-" if row is None or "ms_per_token" not in row else \
            f"{row['ms_per_token']:.1f} / {row['peak_kv_bytes'] / MiB:.1f}"

    pcts, kv = (50, 20, 10), ("", "-kv4")
    summary = [[p] + [ppl(f"{p}-{pct}pct") for pct in pcts] + [ppl(f"{p}-20pct-kv4")]
               + [fidelity(f"{p}-20pct{tag}", key) for key in ("rouge_l", "kl") for tag in kv]
               + [passkey_(f"{p}-20pct{tag}") for tag in kv] + [speed(p, f"20pct{tag}") for tag in kv]
               for p in POLICY_LIBRARY]
    summary.append(["full", "0", "0", "0", ppl("full-kv4"), "1", fidelity("full-kv4", "rouge_l"), "0",
                    fidelity("full-kv4", "kl"), passkey_("full"), passkey_("full-kv4"), speed("full", "20pct"),
                    speed("full", "20pct-kv4")])
    by_budget = [[p] + [fidelity(f"{p}-{pct}pct", key) for key in ("rouge_l", "kl") for pct in pcts]
                 for p in POLICY_LIBRARY]
    quantized = [[p] + [ppl(f"{p}-{pct}pct-kv4") for pct in pcts]
                 + [fidelity(f"{p}-{pct}pct-kv4", key) for key in ("rouge_l", "kl") for pct in pcts]
                 + [passkey_(f"{p}-{pct}pct-kv4") for pct in pcts] for p in POLICY_LIBRARY]
    quantized.append(["full"] + [ppl("full-kv4")] * 3 + [fidelity("full-kv4", "rouge_l")] * 3
                     + [fidelity("full-kv4", "kl")] * 3 + [passkey_("full-kv4")] * 3)
    retrieval = [[p] + [passkey_(f"{p}-{pct}pct") for pct in pcts]
                 + [speed(p, f"{pct}pct{tag}") for tag in kv for pct in pcts] for p in POLICY_LIBRARY]
    retrieval.append(["full"] + [passkey_("full")] * 3
                     + [speed("full", f"{pct}pct{tag}") for tag in kv for pct in pcts])
    return {
        f"{model}/policies": table(["policy", "PPL 50%", "PPL 20%", "PPL 10%", "PPL 20% +4-bit KV", "ROUGE-L 20%",
                                    "+4-bit", "KL 20%", "+4-bit", "pass-key 20%", "+4-bit", "ms/token / KV MiB 20%",
                                    "+4-bit"], summary),
        f"{model}/policies-fidelity": table(["policy", "ROUGE-L 50%", "20%", "10%", "KL 50%", "20%", "10%"],
                                            by_budget),
        f"{model}/policies-kv4": table(["policy", "PPL 50%", "20%", "10%", "ROUGE-L 50%", "20%", "10%", "KL 50%",
                                        "20%", "10%", "pass-key 50%", "20%", "10%"], quantized),
        f"{model}/policies-passkey-decode": table(["policy", "pass-key 50%", "20%", "10%", "decode 50%", "20%", "10%",
                                                   "4-bit KV 50%", "20%", "10%"], retrieval)}


def plot_policies(root: Path, model: str) -> None:
    """``policies.png``: at a 20% budget, each policy's PPL change and pass-key accuracy, with and without 4-bit KV;
    and PPL against the budget where several budgets were run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ppl_root = root.parent / "h2o"
    full = read(ppl_root / "ppl-full.json")

    def value(path: Path, read_value: Callable[[dict], float]) -> float | None:
        r = read(path)
        return None if r is None else read_value(r)

    names = [p for p in POLICY_LIBRARY if (ppl_root / f"ppl-{p}-20pct.json").exists()
             or (root / f"passkey-{p}-20pct.json").exists()]
    if full is None or not names:
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


def ruler(root: Path, model: str) -> dict[str, str]:
    """``sparsegen ruler`` runs (``ruler-*.json``) and sweep cells (``sweep-*.json``): a row per policy, budget,
    protocol, length and sample count, each task's score, and the average where every task was run."""
    from sparsegen.eval.ruler import TASKS, policy_label

    def key(length: int, policy: str, budget: float | None, protocol: str, samples: int, shown: str = "") -> tuple:
        """A row's identity, in table order: by length, the full cache first (a run of it alone has no budget),
        then larger budgets first. ``shown``: the policy as the table names it (default ``policy``)."""
        budget = 1.0 if policy == "full" else budget
        label = "all" if policy == "full" else f"{budget:.0%}"
        return length, policy != "full", -budget, shown or policy, label, protocol, samples

    scores: dict[tuple, dict[str, float]] = {}
    for path in sorted(root.glob("ruler-*.json")):
        r = read(path)
        for row in r["rows"]:
            row_key = key(row["length"], row["policy"], r["budget_arg"], row["protocol"], r["samples_per_task"],
                          policy_label(row))
            scores.setdefault(row_key, {})[row["task"]] = row["score"]
    for path in sorted(root.glob("sweep-*.json")):
        r = read(path)
        cell_key = key(int(r["length"]), r["policy"], float(r["budget"]), r["options"]["protocol"],
                       r["options"]["samples"])
        scores.setdefault(cell_key, {}).update(r["metrics"]["tasks"])
    rows = []
    for (length, _, _, policy, budget, protocol, samples), by_task in sorted(scores.items()):
        average = f"{sum(by_task.values()) / len(TASKS):.2f}" if set(by_task) == set(TASKS) else "-"
        rows.append([policy, budget, protocol, f"{length:,}", samples]
                    + [f"{by_task[t]:.2f}" if t in by_task else "-" for t in TASKS] + [average])
    return {f"{model}/ruler": table(["policy", "budget", "protocol", "length", "samples"] + list(TASKS)
                                    + ["average"], rows)} if rows else {}


# folder under docs/results/MODEL/ -> its tables
SECTIONS = {"streaming": streaming, "h2o": h2o, "policies": policies, "passkey": passkey, "pruning": pruning,
            "contextual": contextual, "prompt": prompt, "ruler": ruler}


def blocks(root: Path) -> dict[str, str]:
    """Every table the JSON under ``root`` (one folder per model) gives, by block name (``MODEL/TABLE``)."""
    found = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for section, make in SECTIONS.items():
            if (folder / section).is_dir():
                found.update(make(folder / section, folder.name))
    return found


def plot(root: Path) -> None:
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if (folder / "streaming").is_dir():
            plot_streaming(folder / "streaming", folder.name)
        if (folder / "policies").is_dir():
            plot_policies(folder / "policies", folder.name)


def regenerate(page: Path, root: Path) -> tuple[str, list[str]]:
    """The page with every marked block rewritten from the JSON under ``root``, and the names of the blocks that
    changed. A marked block the JSON cannot give is an error naming it (a renamed block or a missing result)."""
    text, tables, changed = page.read_text(), blocks(root), []
    unknown = sorted({m["name"] for m in BLOCK.finditer(text)} - set(tables))
    if unknown:
        raise ValueError(f"{page} marks blocks that the results under {root} do not give: {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(tables))}); rerun their experiment or fix the marker")

    def replace(match: re.Match) -> str:
        body = tables[match["name"]] + "\n"
        if body != match["body"]:
            changed.append(match["name"])
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(replace, text), changed
