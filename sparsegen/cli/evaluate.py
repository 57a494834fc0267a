"""Quality against the full cache: perplexity, fidelity, sink statistics; the reference model."""

from __future__ import annotations

import argparse
import json

from sparsegen.cli.common import budget_args, load_model, model_args, policy_specs
from sparsegen.kv.policies import POLICIES
from sparsegen.kv.quantized import held_kv_description


def cmd_ppl(args: argparse.Namespace) -> None:
    from sparsegen.data import data_dir, leading_bos

    if args.stream == args.windows:
        raise ValueError("give exactly one of --stream and --windows")
    if args.windows and args.kv_bits is not None:
        raise ValueError("--windows runs the model without a cache; --kv-bits applies to --stream")
    if args.baseline and not args.windows:
        raise ValueError("--baseline llama.cpp compares window perplexity as llama-perplexity computes it: add "
                         "--windows")
    model, tokenizer = load_model(args)
    text = args.text or data_dir() / "books" / "test"
    bos = leading_bos(tokenizer)
    meta = {"model": args.model, "text": str(text), "mode": "stream" if args.stream else "windows"}
    if args.windows:
        from sparsegen.data import tokenize_files
        from sparsegen.eval.perplexity import window_perplexity
        from sparsegen.models.anatomy import pinned_tokens

        ctx = args.ctx or model.config.max_position_embeddings - pinned_tokens(model)  # the prompt's positions too
        if args.baseline:
            report = _beside_llama_cpp(args, model, tokenizer, text, ctx, bos, meta)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=2)
            return
        result = window_perplexity(model, tokenize_files(text, tokenizer), ctx, bos, max_windows=args.max_windows)
        report = {**meta, **result, "ctx": ctx, "kv_tokens_peak": ctx, "segments": []}
        print(f"PPL {report['ppl']:.3f} over {report['tokens']:,} tokens ({report['windows']} windows of {ctx})")
    else:
        report = _stream_report(args, model, tokenizer, text, bos, meta)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def _beside_llama_cpp(args, model, tokenizer, text, ctx, bos, meta) -> dict:
    """sparsegen and llama.cpp's ``llama-perplexity`` on the same GGUF and the same text, scored alike (the second
    half of each window: ``second_half_perplexity``)."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from sparsegen.bench import llamacpp
    from sparsegen.data import read_texts
    from sparsegen.eval.perplexity import second_half_perplexity
    from sparsegen.models.anatomy import weights_of
    from sparsegen.models.gguf import gguf_file

    gguf = gguf_file(args.model)  # (not a GGUF model: fails before anything runs)
    whole = "\n\n".join(read_texts(text))
    import torch

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
    tokens = np.array(([bos] if bos is not None else []) + ids, dtype=np.int64)
    ours = second_half_perplexity(model, tokens, ctx, bos, max_windows=args.max_windows)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "text.txt"
        path.write_text(whole, encoding="utf-8")
        theirs = llamacpp.perplexity(gguf, path, ctx, threads, args.max_windows)
    report = {**meta, "protocol": "llama-perplexity (windows of ctx, the second half scored)", "ctx": ctx,
              "sparsegen": {**ours, "weights": weights_of(model), "text_tokens": len(tokens)},
              "llama_cpp": theirs, "ppl_vs_llama_cpp": ours["ppl"] / theirs["ppl"]}
    print(f"sparsegen [{weights_of(model)}]: PPL {ours['ppl']:.4f} over {ours['tokens']:,} tokens "
          f"({ours['windows']} windows of {ctx}, the second half scored)")
    print(f"{theirs['engine']} [{gguf.name}]: PPL {theirs['ppl']:.4f} +/- {theirs['ppl_stderr']:.4f} over "
          f"{theirs['windows']} windows; sparsegen / llama.cpp = {report['ppl_vs_llama_cpp']:.4f}")
    return report


def _stream_report(args, model, tokenizer, text, bos, meta) -> dict:
    import csv

    from sparsegen.eval.stream import make_streams, recompute_nll, stream_nll

    data = make_streams(text, tokenizer, args.max_tokens, args.streams, bos)
    results = []
    for name, policy in policy_specs(args, besides=("recompute",)).items():
        if name == "recompute":
            if not isinstance(args.budget, int):
                raise ValueError("recompute needs --budget as a token count (its window)")
            results.append(recompute_nll(model, data, args.budget, every=args.every))
            continue
        results.append(stream_nll(model, data, policy, every=args.every, chunk=args.chunk))
    summaries = [r.summary(args.segment) for r in results]
    print(f"{data.shape[0]} streams x {data.shape[1] - 1:,} predicted tokens")
    print(f"{'policy':<16}{'PPL':>10}{'KV peak':>9}{'tokens/s':>10}")
    for s in summaries:
        print(f"{s['label']:<16}{s['ppl']:>10.3f}{s['kv_tokens_peak']:>9,}{s['tokens_per_s']:>10,.0f}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["policy", "start", "end", "ppl"])
            for s in summaries:
                writer.writerows([s["label"], seg["start"], seg["end"], seg["ppl"]] for seg in s["segments"])
    if args.plot:
        from sparsegen.eval.plots import plot_stream

        plot_stream(summaries, [(r.kv_bytes, r.every) for r in results], args.plot,
                    title=f"{args.model}: {data.shape[0]} streams from {text}", rss=[r.rss_bytes for r in results])
    if len(summaries) == 1:
        return {**meta, **summaries[0]}
    return {**meta, "policies": summaries}


def cmd_fidelity(args: argparse.Namespace) -> None:
    from sparsegen.data import data_dir, leading_bos
    from sparsegen.eval.fidelity import cut_prompts, fidelity
    from sparsegen.eval.stream import read_tokens
    model, tokenizer = load_model(args)
    text = args.text or data_dir() / "books" / "test" / "dracula.txt"
    bos = leading_bos(tokenizer)
    tokens = read_tokens(text, tokenizer, max(200_000, args.prompts * args.prompt_tokens))
    prompts = cut_prompts(tokens, args.prompts, args.prompt_tokens, bos)
    report = {"model": args.model, "text": str(text), "policies": []}
    print(f"{args.prompts} prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy")
    print(f"{'policy':<16}{'budget':>8}{'ROUGE-L':>9}{'tokens to divergence':>22}{'KL(full||policy)':>18}")
    for name, policy in policy_specs(args).items():
        result = {**policy.build(args.prompt_tokens).describe(),
                  **held_kv_description(model, policy.kv_bits),
                  **fidelity(model, tokenizer, prompts, policy, args.new_tokens, args.chunk_size)}
        report["policies"].append(result)
        print(f"{name:<16}{str(result['budget']):>8}{result['rouge_l']:>9.3f}{result['tokens_to_divergence']:>22.1f}"
              f"{result['kl']:>18.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def cmd_sinks(args: argparse.Namespace) -> None:
    from sparsegen.data import data_dir, tokenize_files
    from sparsegen.eval.sinks import sink_statistics
    from sparsegen.models import load

    model, tokenizer = load(args.model, device=args.device, dtype=args.dtype, attn_implementation="eager")
    text = args.text or data_dir() / "books" / "test"
    bos = None if args.no_bos else tokenizer.bos_token_id
    stats = sink_statistics(model, tokenize_files(text, tokenizer), bos, length=args.length,
                            window=args.window, sinks=args.sinks, max_windows=args.windows)
    print(json.dumps(stats, indent=2))


def cmd_train_reference(args: argparse.Namespace) -> None:
    import torch

    from sparsegen.models.loading import CHECKPOINTS
    from sparsegen.reference.report import write_report
    from sparsegen.reference.train import train_reference

    out = args.out or CHECKPOINTS / args.preset
    record = train_reference(
        out, preset=args.preset, work_dir=args.work, device=args.device, compile=not args.no_compile,
        threads=args.threads, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        checkpoint_every=args.checkpoint_every, stop_after=args.stop_after, hidden_size=args.hidden_size,
        layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, intermediate_size=args.intermediate_size,
        context=args.context,
    )
    if record is None:
        print(f"stopped after {args.stop_after} steps; run the same command again to resume")
        return
    print(json.dumps(record, indent=2))
    if not args.no_report:
        torch.set_num_threads(args.threads or torch.get_num_threads())
        print(json.dumps(write_report(out, device=args.device), indent=2))


def add_parsers(sub) -> None:
    p = sub.add_parser("ppl", help="perplexity: streaming through a KV policy (--stream) or in windows (--windows)")
    model_args(p, run=True)
    p.add_argument("--text", default=None, help="text file or folder (default ../shared/data/books/test)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", action="store_true", help="one token at a time through the policy's cache")
    mode.add_argument("--windows", action="store_true", help="non-overlapping windows of --ctx tokens, dense")
    p.add_argument("--policy", action="append", default=None,
                   help=f"{', '.join(POLICIES)} or recompute; repeat to compare (default full)")
    budget_args(p, "KV tokens per layer (recompute: its window)")
    p.add_argument("--max-tokens", type=int, default=20000, help="tokens predicted, over all streams (default 20000)")
    p.add_argument("--streams", type=int, default=None, help="independent streams in one batch (default: files, up to "
                                                             "4)")
    p.add_argument("--segment", type=int, default=1024, help="tokens per reported segment (default 1024)")
    p.add_argument("--every", type=int, default=256, help="tokens between KV-memory samples (default 256)")
    p.add_argument("--chunk", type=int, default=256,
                   help="tokens per forward call; every policy computes exactly what one token per call would "
                        "(default 256)")
    p.add_argument("--ctx", type=int, default=None, help="--windows: window length (default: the model's)")
    p.add_argument("--max-windows", type=int, default=None, help="--windows: at most this many windows")
    p.add_argument("--baseline", choices=["llama.cpp"], default=None,
                   help="--windows on a GGUF model: llama.cpp's own llama-perplexity (make llama-tools) on the same "
                        "file and text, both scored as it scores (each window's second half), side by side")
    p.add_argument("--threads", type=int, default=None, help="--baseline: both engines' CPU threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--csv", default=None, help="write per-segment PPL as CSV to this file")
    p.add_argument("--plot", default=None, help="write log-PPL and KV memory vs tokens as a PNG")
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("fidelity", help="a policy against the full cache: ROUGE-L, tokens to divergence, KL")
    model_args(p, run=True)
    p.add_argument("--text", default=None, help="text file to cut prompts from (default books/test/dracula.txt)")
    p.add_argument("--policy", action="append", required=True, help="policy to compare with full; repeat for several")
    budget_args(p, "KV tokens, or a fraction of the prompt length (0.2)")
    p.add_argument("--prompts", type=int, default=16, help="number of prompts (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=400, help="tokens per prompt (default 400)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.set_defaults(func=cmd_fidelity)

    p = sub.add_parser("sinks", help="attention-sink statistics: attention mass on token 0, and PPL with/without the "
                                     "first tokens")
    model_args(p, positional=True)
    p.add_argument("--text", default=None, help="text file or folder (default ../shared/data/books/test)")
    p.add_argument("--length", type=int, default=256, help="window length (default 256)")
    p.add_argument("--window", type=int, default=64, help="local attention window (default 64)")
    p.add_argument("--sinks", type=int, default=4, help="first tokens kept in the sink pattern (default 4)")
    p.add_argument("--windows", type=int, default=128, help="number of text windows (default 128)")
    p.add_argument("--no-bos", action="store_true", help="do not start windows with the BOS token")
    p.set_defaults(func=cmd_sinks)
    p = sub.add_parser("train-reference", help="train the bundled reference model from ../shared/data/books/train")
    p.add_argument("--preset", default="reference", choices=["reference", "reference-relu", "reference-large"],
                   help="reference (SwiGLU), reference-relu (ReLU gate, for contextual sparsity), reference-large")
    p.add_argument("--out", default=None, help="checkpoint folder (default: the package's bundled folder)")
    p.add_argument("--work", default=None, help="training state, log and tokenizer (default runs/PRESET); resumes "
                                                "from it")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    for size in ("hidden-size", "layers", "heads", "kv-heads", "intermediate-size", "context"):
        p.add_argument(f"--{size}", type=int, default=None, help="override the preset's model size")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between resumable training states")
    p.add_argument("--stop-after", type=int, default=None, help="end this run after N steps (state saved; rerun to "
                                                                "resume)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--no-report", action="store_true", help="skip the perplexity and sink evaluation after training")
    p.set_defaults(func=cmd_train_reference)
