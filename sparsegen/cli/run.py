"""Commands that run a model over a prompt: info, generate, compare, compress (a context, once), fit-scorer, inspect."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sparsegen.cli.common import (
    budget_arg,
    calibration_tokens,
    check_draft_model,
    compile_arg,
    load_draft_model,
    load_model,
    model_args,
    policy_args,
    policy_spec,
    read_prompt,
    speculative_args,
)


def cmd_info(args: argparse.Namespace) -> None:
    from sparsegen.models import model_spec

    spec = model_spec(args.model, dtype=args.dtype).to_dict()
    if args.json:
        print(json.dumps(spec, indent=2))
        return
    width = max(map(len, spec))
    for key, value in spec.items():
        print(f"{key:<{width}}  {value:,}" if isinstance(value, int) else f"{key:<{width}}  {value}")


def cmd_generate(args: argparse.Namespace) -> None:
    from sparsegen.engine.generate import generate
    from sparsegen.engine.speculative import draft_length

    prompt = read_prompt(args)
    draft_tokens = draft_length(args.draft_tokens)
    check_draft_model(args)
    model, tokenizer = load_model(args)
    draft_model = load_draft_model(args, tokenizer)
    context = None
    if args.context is not None:
        from sparsegen.engine.context import CompressedContext

        context = CompressedContext.load(args.context, model)
    stream = None
    if not args.json:
        if args.prompt is not None:
            print(prompt, end="", flush=True)
        stream = lambda text: print(text, end="", flush=True)  # noqa: E731
    result = generate(
        model, tokenizer, None if context else prompt, policy_spec(args), max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        chunk_size=args.chunk_size, on_text=stream, speculative=args.speculative, draft_tokens=draft_tokens,
        draft_model=draft_model, compile=args.compile, context=context,
        question=prompt if context else None,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        stats = result.to_dict()
        drafted = (f"; drafts from {args.speculative}: {stats['acceptance_rate']:.0%} accepted, "
                   f"{stats['tokens_per_step']:.2f} tokens per full-cache step") if args.speculative else ""
        policy = context.meta["policy"]["policy"] if context else args.policy
        print(f"\n[{policy}: {stats['prompt_tokens']} prompt + {stats['new_tokens']} new tokens, "
              f"KV peak {stats['kv_tokens_peak']} tokens / {stats['kv_bytes_peak'] / 2**20:.2f} MiB, "
              f"{stats['seconds']:.2f} s{drafted}]", file=sys.stderr)


def cmd_compress(args: argparse.Namespace) -> None:
    from sparsegen.engine.generate import compress

    with open(args.context_file, encoding="utf-8", errors="replace") as f:
        text = f.read()
    model, tokenizer = load_model(args)
    t0 = time.perf_counter()
    context = compress(model, tokenizer, text, policy_spec(args), chunk_size=args.chunk_size)
    seconds = time.perf_counter() - t0
    path = context.save(args.out)
    summary = {**context.describe(), "seconds": round(seconds, 3), "file": str(path),
               "file_bytes": path.stat().st_size}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{path}: {summary['context_tokens']:,} context tokens held as {summary['kv_tokens']:,} per layer under "
              f"{args.policy} ({summary['kv_bytes'] / 2**20:,.2f} MiB of K/V, {seconds:.1f} s); ask it with "
              f"`sparsegen generate --model {args.model} --context {path} --prompt QUESTION`")


def cmd_fit_scorer(args: argparse.Namespace) -> None:
    from sparsegen.engine.scorer import fit_scorer, save_scorer

    if args.held_out < 1 or args.nsamples < 1:
        raise ValueError("--nsamples and --held-out are at least 1 window each")
    model, tokenizer = load_model(args)
    args.nsamples += args.held_out
    ids, calib = calibration_tokens(args, tokenizer, "train")
    t0 = time.perf_counter()
    weights, report = fit_scorer(model, ids[:-args.held_out], ids[-args.held_out:], ridge=args.ridge,
                                 chunk_size=args.chunk_size)
    report.update(calibration=str(calib), seconds=round(time.perf_counter() - t0, 1))
    path = save_scorer(args.out, model, weights, report, name=args.model)
    print(json.dumps({**report, "file": str(path)}, indent=2) if args.json else
          f"{path}: fit on {report['windows']} windows of {report['tokens']} tokens in {report['seconds']} s; on "
          f"{report['held_out']} held-out windows it keeps {report['kept_agreement']:.0%} of what KVzip keeps at 30% "
          f"(per layer {min(report['kept_agreement_by_layer'].values()):.0%}-"
          f"{max(report['kept_agreement_by_layer'].values()):.0%}; every layer ranked together "
          f"{report['kept_agreement_across_layers']:.0%}); use it with --policy kvzap (or kvzap-global) "
          f"--scorer {path}")


def cmd_inspect(args: argparse.Namespace) -> None:
    from sparsegen.eval.inspect import inspect, plot_grid, write_html

    text = read_prompt(args)
    model, tokenizer = load_model(args)
    data = inspect(model, tokenizer, text, args.policies, args.budget, question=args.question, answer=args.answer,
                   protocol=args.protocol, kv_bits=args.kv_bits, chunk_size=args.chunk_size,
                   max_new_tokens=args.max_new_tokens, model_name=args.model)
    pairs, mass = data["layers"] * data["heads"], [m for m in data["sink_mass"] if m is not None]
    print(f"{args.model}: {data['prompt_tokens']:,} prompt tokens, budget {args.budget}, {data['layers']} layers x "
          f"{data['heads']} KV heads; attention on the first {data['sinks']} tokens: {min(mass):.0%}-{max(mass):.0%} "
          f"by layer" + (f" ({len(mass)} global layers; sliding-window layers keep their window)"
                         if len(mass) < len(data["sink_mass"]) else ""))
    print("| policy | tokens held per head | prompt tokens held by some head | answer tokens held | reply |")
    print("|---|---|---|---|---|")
    for name, row in data["policies"].items():
        some = sum(1 for c in row["count"] if c) / data["prompt_tokens"]
        kept = "-" if row["answer_kept"] is None else f"{row['answer_kept']:.0%} of {pairs} heads"
        print(f"| {name} | {row['kv_tokens']:,} | {some:.0%} | {kept} | {row['reply']!r} |")
    for flag, write in (("html", write_html), ("png", plot_grid)):
        if getattr(args, flag):
            print(f"wrote {write(data, getattr(args, flag))}")
    if args.json:
        Path(args.json).write_text(json.dumps(data))
        print(f"wrote {args.json}")


def cmd_compare(args: argparse.Namespace) -> None:
    import textwrap

    from sparsegen.engine.generate import compare
    from sparsegen.engine.speculative import draft_length

    prompt = read_prompt(args)
    draft_tokens = draft_length(args.draft_tokens)
    model, tokenizer = load_model(args)
    draft_model = load_draft_model(args, tokenizer)
    rows = list(compare(model, tokenizer, prompt, args.policies.split(","), args.budget, args.max_new_tokens,
                        args.chunk_size, draft_tokens, draft_model, args.compile).items())
    if args.json:
        print(json.dumps(dict(rows), indent=2))
        return
    print(f"prompt: {rows[0][1]['prompt_tokens']} tokens; {args.max_new_tokens} new tokens, greedy; budget "
          f"{args.budget}")
    width = max(14, *(len(name) + 2 for name, _ in rows))
    print(f"{'policy':<{width}}{'KV held':>9}{'KV peak':>9}{'peak MiB':>10}{'seconds':>9}{'accepted':>10}")
    for name, r in rows:
        accepted = f"{r['acceptance_rate']:.0%}" if r.get("acceptance_rate") is not None else "-"
        print(f"{name:<{width}}{r['cache']['kv_tokens']:>9,}{r['kv_tokens_peak']:>9,}"
              f"{r['kv_bytes_peak'] / 2**20:>10.3f}{r['seconds']:>9.2f}{accepted:>10}")
    print("(tokens per layer; the peak includes one prefill chunk; speculative rows hold the full cache and also a "
          "draft cache)")
    for name, r in rows:
        text = " ".join(r["text"].split())
        print(f"\n--- {name} ---\n" + textwrap.fill(text, 100))


def add_parsers(sub) -> None:
    p = sub.add_parser("info", help="architecture, size and KV-cache cost of a model")
    model_args(p, positional=True)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="continue a prompt under a KV-cache policy")
    model_args(p, run=True)
    compile_arg(p)
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--prompt-file", default=None, help="read the prompt from a file (any length: it is prefilled in "
                                                       "chunks)")
    policy_args(p)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object (text, new_tokens, kv_tokens_peak, ...)")
    p.add_argument("--context", default=None, metavar="FILE.safetensors",
                   help="start from a context compressed by `sparsegen compress` (it carries its policy); the prompt "
                        "is the question")
    speculative_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("inspect", help="which tokens of a prompt each KV policy keeps, per layer and head: a table, "
                                       "a self-contained HTML page (--html), a PNG grid (--png), JSON")
    model_args(p, run=True)
    p.add_argument("--prompt", default=None, help="the text")
    p.add_argument("--prompt-file", default=None, help="read the text from a file")
    p.add_argument("--policies", default="window,streaming,h2o,snapkv", help="comma-separated (default "
                   "window,streaming,h2o,snapkv)")
    p.add_argument("--budget", type=budget_arg, default=256, help="KV tokens kept per layer, or a share (default 256)")
    p.add_argument("--question", default=None, help="asked after the text; each policy answers it")
    p.add_argument("--answer", default=None, help="the text the question needs: its tokens are marked")
    p.add_argument("--protocol", choices=["stream", "context"], default="stream")
    p.add_argument("--kv-bits", type=int, choices=[32, 16, 8, 4, 2], default=None)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens of each policy's answer (default 16)")
    p.add_argument("--html", default=None, metavar="OUT.html", help="a self-contained page (no network)")
    p.add_argument("--png", default=None, metavar="OUT.png", help="the layer x head grid of each policy")
    p.add_argument("--json", default=None, metavar="OUT.json", help="what sparsegen.inspect returns")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("compress", help="compress a context once under a KV policy (kvpress's protocol) and save it, "
                                        "to ask it many questions")
    model_args(p, run=True)
    p.add_argument("--context-file", required=True, help="the context's text")
    policy_args(p)
    p.add_argument("--out", required=True, metavar="FILE.safetensors", help="where to save the compressed context")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_compress)

    p = sub.add_parser("fit-scorer", help="fit kvzap's learned KV scorer: KVzip's reconstruction scores on "
                                          "calibration text, predicted per layer and KV head from each token's K/V")
    model_args(p, run=True)
    p.add_argument("--calib", default=None, help="calibration text file or folder (default ../shared/data/books/train)")
    p.add_argument("--nsamples", type=int, default=8, help="windows fit on (default 8)")
    p.add_argument("--held-out", type=int, default=2, help="more windows, to measure the fit on (default 2)")
    p.add_argument("--seqlen", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--ridge", type=float, default=1e-2, help="ridge penalty, relative to the features' scale")
    p.add_argument("--chunk-size", type=int, default=512, help="KVzip's reconstruction chunk (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, metavar="FILE.safetensors", help="where to write the scorer")
    p.add_argument("--json", action="store_true", help="print the fit's report (agreement per layer) as JSON")
    p.set_defaults(func=cmd_fit_scorer)

    p = sub.add_parser("compare", help="the same prompt under several KV policies: memory, time and text side by side")
    model_args(p, run=True)
    compile_arg(p)
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--policies", default="full,window,streaming,h2o",
                   help="comma-separated (default full,window,streaming,h2o); POLICY+kv4 holds that cache in 4 bits "
                        "(16, 8, 4, 2); speculative:POLICY[:BUDGET] decodes losslessly under the full cache, drafting "
                        "from POLICY")
    p.add_argument("--budget", type=budget_arg, default="128",
                   help="KV budget for every policy but full (tokens or a fraction)")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--json", action="store_true")
    speculative_args(p, with_policy=False)
    p.set_defaults(func=cmd_compare)
