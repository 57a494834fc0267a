"""The reference model's tables (docs/results-reference.md) from the JSON that examples/experiments/reference/
streamingllm.toml, h2o.toml and pruning.toml write to docs/results/."""

import json
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results")


def policies(path):
    data = json.loads(path.read_text())
    return data.get("policies", [data]) if isinstance(data.get("policies", []), list) else data["policies"]


sweep = sorted(root.glob("stream_sinks*_b256.json"), key=lambda p: int(p.stem.split("sinks")[1].split("_")[0]))
if sweep:
    print("| sinks + recent (budget 256) | PPL | PPL, last segment | tokens | tokens/s |\n|---|---|---|---|---|")
    for path in sweep:
        r = policies(path)[0]
        sinks = r["cache"]["sinks"]
        print(f"| {sinks} + {256 - sinks} | {r['ppl']:.2f} | {r['segments'][-1]['ppl']:.2f} | {r['tokens']:,} "
              f"| {r['tokens_per_s']:,.0f} |")
for name in ("stream_full_16k.json", "stream_recompute_8k.json"):
    path = root / name
    if path.exists():
        print(f"\n{name}:\n\n| policy | PPL | PPL, last segment | KV peak | tokens/s |\n|---|---|---|---|---|")
        for r in policies(path):
            print(f"| {r['label']} | {r['ppl']:.2f} | {r['segments'][-1]['ppl']:.2f} | {r['kv_tokens_peak']:,} "
                  f"| {r['tokens_per_s']:,.0f} |")
for pct in (20, 10):
    ppl, fid = root / f"h2o_ppl_{pct}pct.json", root / f"h2o_fidelity_{pct}pct.json"
    if ppl.exists() and fid.exists():
        scores = {f["policy"]: f for f in policies(fid)}
        print(f"\nH2O, {pct}% budget:\n\n| policy | PPL | ROUGE-L | tokens to divergence | KL(full‖policy) |\n"
              "|---|---|---|---|---|")
        for r in policies(ppl):
            f = scores.get(r["label"])
            extra = f"{f['rouge_l']:.3f} | {f['tokens_to_divergence']:.1f} | {f['kl']:.4f}" if f else "1 | 64 | 0"
            print(f"| {r['label']} | {r['ppl']:.2f} | {extra} |")

pruning = root / "pruning"
if (pruning / "dense_wiki.json").exists():
    print("\n| model | wiki.test.raw PPL | books/test PPL | zeros in pruned layers | pruning s |\n"
          "|---|---|---|---|---|")
    tags = (["dense"] + [f"{m}_{a}" for m in ("magnitude", "wanda", "sparsegpt") for a in ("0.5", "4of8", "2of4")]
            + [f"{m}_neurons{a}" for m in ("magnitude", "wanda") for a in ("0.25", "0.5")]
            + ["wanda_neurons0.25_heads0.5"])
    for tag in tags:
        if not (pruning / f"{tag}_books.json").exists():
            continue
        wiki, books = (json.loads((pruning / f"{tag}_{t}.json").read_text())["ppl"] for t in ("wiki", "books"))
        sparsity = pruning / f"{tag}_sparsity.json"
        info = json.loads(sparsity.read_text()) if sparsity.exists() else None
        zeros = (f"{info['achieved']:.4f}" if "achieved" in info else f"{info['removed']:.1%} of params removed") \
            if info else "-"
        seconds = f"{info['seconds']:.1f}" if info else "-"
        print(f"| {tag.replace('of', ':')} | {wiki:,.1f} | {books:,.2f} | {zeros} | {seconds} |")
