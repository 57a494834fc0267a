"""The ``sparsegen`` command line: a thin layer over the library."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sparsegen.kv.policies import POLICIES


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _model_args(p: argparse.ArgumentParser, positional: bool = False, more: str = "", run: bool = False) -> None:
    if positional:
        p.add_argument("model", help="hub id, local checkpoint folder, or 'reference'")
    else:
        p.add_argument("--model", default="reference",
                       help=f"hub id, local checkpoint folder, or 'reference' (default){more}")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--dtype", default=None, help="auto, float32, float16, bfloat16 (default: float32 on CPU, the checkpoint's on GPU)")
    if run:
        _weights_arg(p)
        p.add_argument("--contextual", default=None, metavar="DIR",
                       help="run with the contextual sparsity fit into DIR by `sparsegen contextual fit`")
        _prompt_args(p)


def _compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true",
                   help="run the decode step through torch.compile (one graph: model, cache update, eviction); the "
                        "first step compiles (tens of seconds on a CPU), and again when the batch or slots change")


def _weights_arg(p: argparse.ArgumentParser, several: bool = False) -> None:
    p.add_argument("--weights", default="fp32", metavar="fp32|int8|int4|gguf" + ("[,...]" if several else ""),
                   help="store the decoder's linears and LM head in 8 or 4 bits for PyTorch's CPU weight-only kernels "
                        "(a quarter / an eighth of the fp32 bytes a token reads; round to nearest); gguf: each linear "
                        "at the bit width its GGUF file has (4-bit types at 4, the others at 8)"
                        + ("; several, comma-separated, are measured in turn and compared" if several else "")
                        + " (default fp32: as loaded)")


def _gguf_plan(model_name: str, weights: str) -> dict | None:
    """``--weights gguf``: each linear's bit width in the model's GGUF file."""
    if weights != "gguf":
        return None
    from sparsegen.models.gguf import gguf_file
    from sparsegen.quant.fast import gguf_plan

    return gguf_plan(gguf_file(model_name))


def _prompt_args(p: argparse.ArgumentParser) -> None:
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--soft-prompt", default=None, metavar="FILE",
                        help="put the soft prompt trained by `sparsegen prompt-tune` before every sequence (its tokens "
                             "are never evicted)")
    prompt.add_argument("--hard-prompt", default=None, metavar="TEXT",
                        help="put this text before every sequence, pinned in the cache like a soft prompt")


def attach_prompt(args: argparse.Namespace, model, tokenizer) -> None:
    """``--soft-prompt FILE`` / ``--hard-prompt TEXT``: the model sees the prompt before every sequence."""
    from sparsegen.prompt import PromptPrefix, attach

    if getattr(args, "soft_prompt", None):
        attach(model, PromptPrefix.load(args.soft_prompt))
    elif getattr(args, "hard_prompt", None):
        if tokenizer is None:
            raise ValueError("--hard-prompt needs a model with a tokenizer (random: models have none)")
        attach(model, PromptPrefix.from_text(model, tokenizer, args.hard_prompt))


def budget_arg(text: str) -> int | float:
    """An argparse type: a KV budget (tokens, or a fraction of the input)."""
    from sparsegen.kv.policies import parse_budget

    try:
        return parse_budget(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _budget_args(p: argparse.ArgumentParser, budget_help: str) -> None:
    p.add_argument("--budget", type=budget_arg, default=None, help=budget_help)
    p.add_argument("--sinks", type=int, default=None, help="first tokens always kept (streaming: 4)")
    p.add_argument("--recent", type=int, default=None, help="most recent tokens always kept (h2o: half the budget)")
    p.add_argument("--heavy", type=int, default=None, help="heavy-hitter tokens kept (h2o: half the budget)")
    p.add_argument("--history", type=int, default=None,
                   help="scissorhands: count only the latest this many queries' votes (default: all)")
    p.add_argument("--positions", choices=["original", "rolling"], default=None,
                   help="RoPE positions of cached keys (default: rolling for streaming*, original otherwise)")
    p.add_argument("--kv-bits", type=int, choices=[8, 4, 2], default=None,
                   help="hold the cached keys and values in this many bits (KIVI-style: keys per channel, values per "
                        "token), under any policy (default: as the model computes them)")
    p.add_argument("--kv-residual", type=int, default=32,
                   help="with --kv-bits: the newest tokens also kept in full precision (default 32)")


def _kv_bits(args: argparse.Namespace):
    """``--kv-bits``/``--kv-residual`` as a ``KVQuantization``, or None."""
    from sparsegen.kv import KVQuantization

    return None if args.kv_bits is None else KVQuantization(args.kv_bits, args.kv_residual)


def _policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="full", help=f"{', '.join(POLICIES)} (default full)")
    _budget_args(p, "KV tokens kept per layer, or a fraction of the input length (0.2)")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk, tokens (default 512)")


def _speculative_args(p: argparse.ArgumentParser, with_policy: bool = True, with_draft_model: bool = True) -> None:
    spec = p.add_argument_group("lossless speculative decoding (the full cache verifies what a small cache drafts)")
    if with_policy:
        spec.add_argument("--speculative", default=None, metavar="POLICY[:BUDGET]",
                          help="draft with the model over a cache under this policy, e.g. streaming:512 or h2o:0.1; "
                               "the output is the full cache's (--policy stays full)")
    spec.add_argument("--draft-tokens", default="4", metavar="K|auto",
                      help="tokens drafted per round (1-16), or auto: chosen from the measured acceptance and step "
                           "costs (default 4)")
    if with_draft_model:
        spec.add_argument("--draft-model", default=None, metavar="MODEL",
                          help="draft with this model instead (same tokenizer), e.g. a pruned + int4 copy of --model")


def load_draft_model(args: argparse.Namespace, tokenizer):
    """``--draft-model``, checked to share ``tokenizer``'s vocabulary; None without it."""
    if args.draft_model is None:
        return None
    from sparsegen.models import load

    model, draft_tokenizer = load(args.draft_model, device=args.device, dtype=args.dtype)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"--draft-model {args.draft_model} has another tokenizer than --model {args.model}: draft "
                         "with a compressed copy of the same model")
    return model


def _calibration_args(p: argparse.ArgumentParser, who: str = "") -> None:
    """Layer-by-layer calibration (prune, quantize): which text, how many windows, how long, how many per forward."""
    p.add_argument("--calib", default=None, help=f"{who}calibration text file or folder (default ../shared/data/books/train)")
    p.add_argument("--nsamples", type=int, default=128, help="calibration sequences (default 128)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="calibration sequences per forward (default 8)")


def _conversation_args(p: argparse.ArgumentParser, speculative: bool = True) -> None:
    if speculative:
        _speculative_args(p)
    p.add_argument("--policy", default="streaming", help=f"{', '.join(POLICIES)} (default streaming)")
    _budget_args(p, "KV tokens kept per conversation (default 1024)")
    p.set_defaults(budget="1024")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk, tokens (default 512)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per reply at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def _policies(args: argparse.Namespace, input_length: int | None = None):
    """``(name, factory)`` for each ``--policy``; with several, each takes only the splits that apply to it."""
    from sparsegen.kv import make_policy
    from sparsegen.kv.policies import policy_class
    from sparsegen.kv.policy import policy_options

    names = args.policy or ["full"]
    for name in names:
        splits = {k: getattr(args, k) for k in ("sinks", "recent", "heavy", "history")
                  if len(names) == 1 or k in policy_options(policy_class(name))}

        def make(length=input_length, name=name, splits=splits):
            return make_policy(name, None if name == "full" else args.budget, input_length=length, **splits)

        yield name, make


def load_model(args: argparse.Namespace):
    from sparsegen.models import load

    model, tokenizer = load(args.model, device=args.device, dtype=args.dtype)
    if getattr(args, "weights", "fp32") != "fp32":
        from sparsegen.quant.fast import quantize_weights

        quantize_weights(model, args.weights, _gguf_plan(args.model, args.weights))
    if getattr(args, "contextual", None):
        from sparsegen.contextual import Contextual, attach

        attach(model, Contextual.load(args.contextual))
    attach_prompt(args, model, tokenizer)
    return model, tokenizer


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
    from sparsegen.generation import generate
    from sparsegen.speculative import draft_length

    prompt = _read_prompt(args)
    draft_tokens = draft_length(args.draft_tokens)
    if args.draft_model is not None and args.speculative is None:
        raise ValueError("--draft-model drafts for --speculative: give --speculative too, e.g. streaming:512")
    model, tokenizer = load_model(args)
    draft_model = load_draft_model(args, tokenizer)
    context = None
    if args.context is not None:
        from sparsegen.kv import CompressedContext

        context = CompressedContext.load(args.context, model)
    stream = None
    if not args.json:
        if args.prompt is not None:
            print(prompt, end="", flush=True)
        stream = lambda text: print(text, end="", flush=True)  # noqa: E731
    result = generate(
        model, tokenizer, None if context else prompt, policy=args.policy, budget=args.budget, sinks=args.sinks,
        recent=args.recent, heavy=args.heavy, history=args.history, positions=args.positions,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        chunk_size=args.chunk_size, on_text=stream, speculative=args.speculative, draft_tokens=draft_tokens,
        draft_model=draft_model, kv_bits=_kv_bits(args), compile=args.compile, context=context,
        question=prompt if context else None,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        stats = result.to_dict()
        drafted = (f"; drafts from {args.speculative}: {stats['acceptance_rate']:.0%} accepted, "
                   f"{stats['tokens_per_step']:.2f} tokens per full-cache step") if args.speculative else ""
        print(f"\n[{args.policy}: {stats['prompt_tokens']} prompt + {stats['new_tokens']} new tokens, "
              f"KV peak {stats['kv_tokens_peak']} tokens / {stats['kv_bytes_peak'] / 2**20:.2f} MiB, "
              f"{stats['seconds']:.2f} s{drafted}]", file=sys.stderr)


def cmd_compress(args: argparse.Namespace) -> None:
    from sparsegen.generation import compress

    with open(args.context_file, encoding="utf-8", errors="replace") as f:
        text = f.read()
    model, tokenizer = load_model(args)
    t0 = time.perf_counter()
    context = compress(model, tokenizer, text, policy=args.policy, budget=args.budget, sinks=args.sinks,
                       recent=args.recent, heavy=args.heavy, history=args.history, positions=args.positions,
                       kv_bits=_kv_bits(args), chunk_size=args.chunk_size)
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


def cmd_inspect(args: argparse.Namespace) -> None:
    from sparsegen.eval.inspect import inspect, plot_grid, write_html

    text = _read_prompt(args)
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


def _read_prompt(args: argparse.Namespace) -> str:
    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of --prompt and --prompt-file")
    if args.prompt is not None:
        return args.prompt
    with open(args.prompt_file, encoding="utf-8", errors="replace") as f:
        return f.read()


def cmd_compare(args: argparse.Namespace) -> None:
    import textwrap

    from sparsegen.generation import compare
    from sparsegen.speculative import draft_length

    prompt = _read_prompt(args)
    draft_tokens = draft_length(args.draft_tokens)
    model, tokenizer = load_model(args)
    draft_model = load_draft_model(args, tokenizer)
    rows = list(compare(model, tokenizer, prompt, args.policies.split(","), args.budget, args.max_new_tokens,
                        args.chunk_size, draft_tokens, draft_model).items())
    if args.json:
        print(json.dumps(dict(rows), indent=2))
        return
    print(f"prompt: {rows[0][1]['prompt_tokens']} tokens; {args.max_new_tokens} new tokens, greedy; budget {args.budget}")
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


def cmd_ppl(args: argparse.Namespace) -> None:
    from sparsegen.data import data_dir, leading_bos

    if args.stream == args.windows:
        raise ValueError("give exactly one of --stream and --windows")
    if args.windows and args.kv_bits is not None:
        raise ValueError("--windows runs the model without a cache; --kv-bits applies to --stream")
    model, tokenizer = load_model(args)
    text = args.text or data_dir() / "books" / "test"
    bos = leading_bos(tokenizer)
    meta = {"model": args.model, "text": str(text), "mode": "stream" if args.stream else "windows"}
    if args.windows:
        from sparsegen.data import tokenize_files
        from sparsegen.eval.perplexity import window_perplexity

        from sparsegen.models.anatomy import pinned_tokens

        ctx = args.ctx or model.config.max_position_embeddings - pinned_tokens(model)  # the prompt's positions too
        result = window_perplexity(model, tokenize_files(text, tokenizer), ctx, bos, max_windows=args.max_windows)
        report = {**meta, **result, "ctx": ctx, "kv_tokens_peak": ctx, "segments": []}
        print(f"PPL {report['ppl']:.3f} over {report['tokens']:,} tokens ({report['windows']} windows of {ctx})")
    else:
        report = _stream_report(args, model, tokenizer, text, bos, meta)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def _stream_report(args, model, tokenizer, text, bos, meta) -> dict:
    import csv

    from sparsegen.eval.stream import make_streams, recompute_nll, stream_nll

    data = make_streams(text, tokenizer, args.max_tokens, args.streams, bos)
    results = []
    for name, make in _policies(args, input_length=data.shape[1]):
        if name == "recompute":
            if not isinstance(args.budget, int):
                raise ValueError("recompute needs --budget as a token count (its window)")
            results.append(recompute_nll(model, data, args.budget, every=args.every))
            continue
        policy = make()
        results.append(stream_nll(model, data, policy, positions=args.positions, every=args.every, chunk=args.chunk,
                                  kv_bits=_kv_bits(args)))
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
    quantization = _kv_bits(args)
    for name, make in _policies(args, input_length=args.prompt_tokens):
        result = {**make().describe(), **(quantization.describe() if quantization else {}),
                  **fidelity(model, tokenizer, prompts, make, args.new_tokens, args.positions, args.chunk_size,
                             kv_bits=quantization)}
        report["policies"].append(result)
        print(f"{name:<16}{str(result['budget']):>8}{result['rouge_l']:>9.3f}{result['tokens_to_divergence']:>22.1f}"
              f"{result['kl']:>18.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def cmd_passkey(args: argparse.Namespace) -> None:
    from sparsegen.data import data_dir
    from sparsegen.eval.passkey import describe_prompt, passkey_accuracy
    from sparsegen.eval.stream import read_tokens
    model, tokenizer = load_model(args)
    chat = args.chat if args.chat is not None else bool(getattr(tokenizer, "chat_template", None))
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{args.model} has no chat template; drop --chat")
    text = args.text or data_dir() / "books" / "test" / "great_expectations.txt"
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    filler = read_tokens(text, tokenizer, 4 * max(lengths))
    quantization = _kv_bits(args)
    results = {}
    for name, make in _policies(args):
        results[name] = {**make().describe(), **(quantization.describe() if quantization else {}), **passkey_accuracy(
            model, tokenizer, filler, lengths, depths, make, args.trials, args.seed, args.chunk_size, args.positions,
            chat=chat, kv_bits=quantization, protocol=args.protocol)}
        print(f"{name}: accuracy {results[name]['accuracy']:.1%}")
        for length in lengths:
            row = [c["accuracy"] for c in results[name]["cells"] if c["length"] == length]
            print(f"  {length:>7} tokens: " + " ".join(f"{a:4.0%}" for a in row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "text": str(text), "prompt": describe_prompt(tokenizer, chat),
                       "policies": results}, f, indent=2)
    if args.plot:
        from sparsegen.eval.plots import plot_passkey

        plot_passkey(results, args.plot)


def cmd_ruler(args: argparse.Namespace) -> None:
    from pathlib import Path

    from sparsegen.data import data_dir
    from sparsegen.eval import ruler

    model, tokenizer = load_model(args)
    chat = args.chat if args.chat is not None else bool(getattr(tokenizer, "chat_template", None))
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{args.model} has no chat template; drop --chat")
    haystack = args.haystack or data_dir() / "books" / "test" / "great_expectations.txt"
    tasks = args.tasks.split(",") if args.tasks else list(ruler.TASKS)
    unknown = [t for t in tasks if t not in ruler.TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {', '.join(unknown)}; choose from {', '.join(ruler.TASKS)}")
    protocols = args.protocol.split(",")
    if any(p not in ("stream", "context") for p in protocols):
        raise ValueError(f"--protocol takes stream, context or both (stream,context), got {args.protocol!r}")
    args.policy = args.policies.split(",")
    lengths = [int(x) for x in args.length.split(",")]
    depths = [float(x) for x in args.depths.split(",")] if args.depths else None

    def show(row: dict) -> None:
        print(f"{row['policy']:>14} {row['protocol']:>7} {row['length']:>6} {row['task']:>16}: {row['score']:.3f} "
              f"(K/V peak {row['kv_tokens_peak']:,} tokens; prompts up to {row['prompt_tokens']:,})", flush=True)

    report = ruler.run(model, tokenizer, Path(haystack).read_text(encoding="utf-8", errors="replace"),
                       dict(_policies(args)), lengths, tasks, args.samples, tuple(protocols), chat, depths,
                       args.seed, args.chunk_size, args.positions, _kv_bits(args), args.max_new_tokens,
                       on_row=show)
    print()
    print(ruler.markdown(report["rows"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "haystack": str(haystack), "chat": chat, "samples_per_task": args.samples,
                       "budget_arg": args.budget, "kv_bits": args.kv_bits, **report}, f, indent=2)
    if args.plot:
        from sparsegen.eval.plots import plot_ruler

        plot_ruler(report["rows"], args.plot)


def cmd_lm_eval(args: argparse.Namespace) -> None:
    try:
        from sparsegen.eval import harness
    except ImportError as err:
        raise ValueError(f"sparsegen lm-eval needs lm-eval: pip install 'sparsegen[lmeval]' ({err})") from None
    harness.main(args.lm_eval_args)


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


def _bytes(text: str) -> int:
    """``24GiB``, ``80GB``, ``512MiB`` or a plain number of bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    lowered = text.strip().lower()
    for unit, scale in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * scale)
    if not lowered.rstrip("b").isdigit():
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 24GiB, 80GB or 512MiB")
    return int(lowered.rstrip("b"))


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} takes comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{what} takes positive whole numbers, got {text!r}")
    return values


def cmd_bench(args: argparse.Namespace) -> None:
    import torch

    from sparsegen.bench import decode, report
    from sparsegen.bench.roofline import measure_bandwidth
    from sparsegen.contextual import Contextual, attach, detach
    from sparsegen.models import load
    from sparsegen.models.loading import check_device, load_config, resolve_dtype
    from sparsegen.models.synthetic import is_random, random_model
    from sparsegen.speculative import Speculation, draft_length, draft_policy

    contexts, batches = _int_list(args.contexts, "contexts"), _int_list(args.batch, "batch")
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    if args.baseline == "llama.cpp":
        from sparsegen.bench import llamacpp
        from sparsegen.models.gguf import gguf_file

        if not llamacpp.available():
            raise ValueError(llamacpp.INSTALL)
        ggufs = {m.strip(): gguf_file(m.strip()) for m in args.model.split(",") if m.strip()}  # fails before loading
    if not isinstance(args.budget, int) and any(n not in ("dense", "full") and not n.startswith("speculative:")
                                                for n in names):
        raise ValueError("--budget (a token count) is needed for every policy but dense and full (recompute: its "
                         "window)")
    if args.threads:
        torch.set_num_threads(args.threads)
    policies = []
    args.policy = [n for n in names if n not in decode.BASELINES and not n.startswith("speculative:")]
    factories = dict(_policies(args)) if args.policy else {}
    draft_tokens = draft_length(args.draft_tokens)
    for name in names:
        if name == "dense":
            policies.append((name, lambda: None))
        elif name == "recompute":
            policies.append((name, lambda: args.budget))
        elif name.startswith("speculative:"):
            spec = name.removeprefix("speculative:")
            policies.append((name, lambda spec=spec: Speculation(draft_policy(spec), draft_tokens)))
        else:
            policies.append((name, factories[name]))
    for _, make in policies:
        make()  # bad budgets and splits fail here, before any model is built
    device = check_device(args.device)
    bandwidth = measure_bandwidth(device)
    rows, env = [], None
    names_of_models = [m.strip() for m in args.model.split(",") if m.strip()]
    variants = [v.strip() for v in (args.contextual or "none").split(",") if v.strip()]
    plans = {v: Contextual.load(v) for v in variants if v != "none"}  # a bad folder fails before any model is built
    from sparsegen.quant.fast import WEIGHTS, quantize_weights

    weight_modes = [w.strip() for w in args.weights.split(",") if w.strip()]
    baselines: dict[str, list[dict]] = {}  # llama.cpp's rows per model
    if not weight_modes or any(w not in WEIGHTS for w in weight_modes):
        raise ValueError(f"--weights takes {', '.join(WEIGHTS)} (comma-separated), got {args.weights!r}")
    for name, weights in [(n, w) for n in names_of_models for w in weight_modes]:
        tokenizer = None
        if is_random(name):
            config = load_config(name)
            model = random_model(config, device, resolve_dtype(args.dtype, config, device), args.seed)
        else:  # synthetic prefill needs no tokenizer (a checkpoint compressed from a random: shape has none)
            needs_tokenizer = args.prefill == "real" or args.hard_prompt is not None or args.text is not None
            model, tokenizer = load(name, device=device, dtype=args.dtype, tokenizer=needs_tokenizer)
        quantize_weights(model, weights, _gguf_plan(name, weights))
        attach_prompt(args, model, tokenizer)
        for variant in variants:
            label = name if variant == "none" else f"{name} + {variant}"
            label = label if len(weight_modes) == 1 and weights == "fp32" else f"{label} [{weights}]"
            if variant != "none":
                attach(model, plans[variant])
            measured, env = _bench_model(args, model, label, is_random(name), bandwidth, policies, contexts, batches,
                                         _bench_text(args, tokenizer, name))
            rows += measured
            if args.baseline == "llama.cpp" and variant == "none":
                if name not in baselines:  # llama.cpp once per model; every weights variant's ratio to it
                    baselines[name] = _llamacpp_rows(args, ggufs[name], label, contexts)
                    rows += baselines[name]
                _vs_llamacpp(measured, baselines[name], ggufs[name].name)
            detach(model)
        del model
    for line in report.model_speedups(rows):
        print(line)
    if args.markdown:
        print(report.markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=2)
    if args.plot:
        report.plot(rows, args.plot, title=f"{args.model} on {env['machine']}, {env['dtype']}")


def _llamacpp_rows(args: argparse.Namespace, gguf, label: str, contexts: list[int]) -> list[dict]:
    """llama.cpp's rows (batch 1) for ``contexts`` on ``gguf``, printed."""
    import torch

    from sparsegen.bench import llamacpp, report

    rows = []
    for context in contexts:
        row = {"model": label, **llamacpp.measure(gguf, context, args.new_tokens, args.warmup,
                                                  args.threads or torch.get_num_threads(), args.seed)}
        print(report.format_row(row), flush=True)
        rows.append(row)
    return rows


def _vs_llamacpp(measured: list[dict], baseline: list[dict], gguf_name: str) -> None:
    """Each measured row's tok/s over llama.cpp's at its context (``vs_llama_cpp``), printed."""
    base = {row["context"]: row["tokens_per_s"] for row in baseline}
    ratios = []
    for row in measured:
        if row.get("tokens_per_s") and row["batch"] == 1 and row["context"] in base:
            row["vs_llama_cpp"] = row["tokens_per_s"] / base[row["context"]]
            ratios.append(f"{row['policy']} {row['context']:,} {row['vs_llama_cpp']:.2f}x")
    print(f"tok/s of {measured[0]['model'] if measured else ''} over llama.cpp's ({gguf_name}, batch 1): "
          + "; ".join(ratios))


def _bench_text(args: argparse.Namespace, tokenizer, model_name: str):
    """``--text`` as token ids of the model's tokenizer (None without it)."""
    if args.text is None:
        return None
    if tokenizer is None:
        raise ValueError(f"--text needs a model with a tokenizer; {model_name} has none (random: shapes prefill "
                         "random token ids)")
    import numpy as np
    import torch

    from sparsegen.data import tokenize_files

    return torch.from_numpy(np.concatenate(tokenize_files(args.text, tokenizer)).astype(np.int64))


def _bench_model(args, model, label: str, random_weights: bool, bandwidth, policies, contexts,
                 batches, text_ids=None) -> tuple[list[dict], dict]:
    """Measure one model (or one contextual variant of it): print its table, ratios and goals."""
    from sparsegen.bench import decode, report

    setup = decode.Setup(
        model=model, model_name=label, random_weights=random_weights, new_tokens=args.new_tokens,
        warmup=args.warmup, chunk_size=args.chunk_size, prefill=args.prefill,
        recompute_tokens=args.recompute_tokens, memory_limit=_bytes(args.memory_limit) if args.memory_limit else None,
        bandwidth=bandwidth, compiled=args.compile, seed=args.seed, repeats=args.repeats, text_ids=text_ids,
        kv_bits=_kv_bits(args),
    )
    env = setup.environment()
    print(f"{env['model']}{' (random weights)' if env['random_weights'] else ''}: {env['dtype']} on "
          f"{env['machine']}; copy bandwidth {env['bandwidth_gb_s']} GB/s; prefill {env['prefill']}; "
          f"{'torch.compile' if args.compile else 'eager'}; {args.new_tokens} timed decode steps after "
          f"{args.warmup}{f', {args.repeats} times over' if args.repeats > 1 else ''}")
    print(report.header())
    measured = decode.run(setup, policies, contexts, batches,
                          on_row=lambda row: print(report.format_row(row), flush=True))
    names = [name for name, _ in policies]
    for baseline in ("full", "dense", "recompute"):
        if baseline in names:
            ratios = report.speedups(measured, baseline)
            if ratios:
                print(f"speed-up over {baseline} (its ms/token over the policy's): " + "; ".join(
                    f"{p} {c:,}x{b} {x:.1f}x" for p, c, b, x in ratios))
    for line in report.goals(measured):
        print("goal: " + line)
    return measured, env


def _calibration(args: argparse.Namespace, tokenizer, books: str):
    """``(ids, source)``: ``--nsamples`` windows of ``--seqlen`` tokens from ``--calib`` (default books/BOOKS)."""
    from sparsegen.data import data_dir, leading_bos, tokenize_files
    from sparsegen.models.calibration import calibration_ids

    source = args.calib or data_dir() / "books" / books
    ids = calibration_ids(tokenize_files(source, tokenizer), args.nsamples, args.seqlen, args.seed,
                          leading_bos(tokenizer))
    return ids, source


def cmd_prune(args: argparse.Namespace) -> None:
    from sparsegen.models.loading import resolve
    from sparsegen.output import check_output
    from sparsegen.pruning import PruneConfig, prune_model, save_pruned
    from sparsegen.pruning.methods import pruning_method

    config = PruneConfig(method=args.method, sparsity=args.sparsity, pattern=args.pattern, structured=args.structured,
                         per_row=args.per_row, nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed,
                         batch_size=args.batch_size)
    out = check_output(args.out, resolve(args.model), args.force)
    model, tokenizer = load_model(args)
    ids, calib = None, None
    if pruning_method(config.method).statistic is not None:
        ids, calib = _calibration(args, tokenizer, "train")
    report = {"model": args.model, "calibration": str(calib) if calib else None,
              **prune_model(model, config, ids)}
    save_pruned(model, tokenizer, out, report, overwrite=args.force)
    if config.amounts is not None:
        print(f"{config.method}, structured {config.structured}: {report['params_before']:,} -> "
              f"{report['params_after']:,} parameters ({report['removed']:.1%} removed); {report['seconds']:.1f} s; "
              f"saved to {out} (load it with sparsegen.load: the layer sizes are in config.json)")
        return
    print(f"{config.method}: {report['achieved']:.4f} of {report['pruned_params']:,} weights in "
          f"{len(report['layers'])} linear layers are zero (requested {report['requested']:.4f}); "
          f"{report['seconds']:.1f} s; saved to {out}")


def _engine(args: argparse.Namespace, model, tokenizer):
    from sparsegen.kv import make_policy
    from sparsegen.serve import Engine

    def policy():
        return make_policy(args.policy, None if args.policy == "full" else args.budget, sinks=args.sinks,
                           recent=args.recent, heavy=args.heavy, history=args.history)

    speculation = None
    if getattr(args, "speculative", None) is not None:
        from sparsegen.speculative import Speculation, draft_length, draft_policy

        draft_tokens, draft_model = draft_length(args.draft_tokens), load_draft_model(args, tokenizer)

        def speculation():
            return Speculation(draft_policy(args.speculative), draft_tokens, model=draft_model)
    elif getattr(args, "draft_model", None) is not None:
        raise ValueError("--draft-model drafts for --speculative: give --speculative too, e.g. streaming:512")
    return Engine(model, tokenizer, policy, positions=args.positions, chunk_size=args.chunk_size,
                  max_sessions=getattr(args, "max_sessions", 1), max_batch=getattr(args, "max_batch", 1),
                  speculation=speculation, kv_bits=_kv_bits(args), compile=args.compile,
                  kv_memory=_bytes(args.kv_memory) if getattr(args, "kv_memory", None) else None,
                  max_context=getattr(args, "max_context", None), idle_grace=getattr(args, "idle_grace", 2.0),
                  prefill_budget=getattr(args, "prefill_budget", None), contexts=_contexts(args, model))


def _contexts(args: argparse.Namespace, model) -> dict:
    """``--context NAME=FILE`` (repeated): compressed contexts by the name requests give."""
    from sparsegen.kv import CompressedContext

    contexts = {}
    for spec in getattr(args, "context", None) or []:
        name, _, path = spec.partition("=")
        if not name or not path or name in contexts:
            raise ValueError(f"--context takes NAME=FILE.safetensors, each name once, got {spec!r}")
        contexts[name] = CompressedContext.load(path, model)
    return contexts


def _sampling(args: argparse.Namespace):
    from sparsegen.serve import Sampling

    return Sampling(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def cmd_chat(args: argparse.Namespace) -> None:
    from sparsegen.serve.chat import chat

    model, tokenizer = load_model(args)
    engine = _engine(args, model, tokenizer)
    script = None
    if args.script:
        with open(args.script, encoding="utf-8") as f:
            script = [line for line in f.read().splitlines() if line.strip()]
    turns = chat(engine, _sampling(args), script, system=args.system)
    if turns:
        last = turns[-1]
        print(f"[{len(turns)} turns, {last['tokens_seen']:,} tokens seen; KV held {last['kv_tokens']:,} tokens "
              f"({last['kv_bytes'] / 2**20:.2f} MiB); last turn {last['seconds']:.2f} s]", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "policy": engine.make_policy().describe(), "turns": turns}, f, indent=2)
    if args.plot:
        from sparsegen.eval.plots import plot_turns

        plot_turns({f"{args.policy}": turns}, args.plot, title=f"{args.model}: {len(turns)} chat turns")


def cmd_serve(args: argparse.Namespace) -> None:
    import os

    from sparsegen.serve.server import Limits, build_app, kv_bound, run_server

    keys = list(args.api_key or [])
    if args.api_keys_file:
        with open(args.api_keys_file, encoding="utf-8") as f:
            keys += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"--api-keys-file {args.api_keys_file} holds no key")
    if not keys and os.environ.get("SPARSEGEN_API_KEY"):
        keys = [os.environ["SPARSEGEN_API_KEY"]]
    limits = Limits(max_sessions=args.max_sessions, max_batch=args.max_batch, max_queue=args.max_queue,
                    max_tokens=args.max_tokens_limit, max_prompt_tokens=args.max_prompt_tokens,
                    max_messages=args.max_messages, max_stop_chars=args.max_stop_chars,
                    max_request_bytes=args.max_request_bytes, api_keys=tuple(keys))
    if args.kv_memory is None and args.idle_grace != 2.0:
        raise ValueError("--idle-grace is how long an idle session is safe under --kv-memory: give --kv-memory too")
    defaults = _sampling(args)  # before loading: a bad flag fails at once
    if defaults.max_tokens > limits.max_tokens:
        raise ValueError(f"--max-new-tokens {defaults.max_tokens} is over --max-tokens-limit {limits.max_tokens}")
    model, tokenizer = load_model(args)
    engine = _engine(args, model, tokenizer)
    app = build_app(engine, limits, args.model, defaults)
    bound = kv_bound(engine, limits)
    policy = engine.make_policy().describe()
    memory = engine.memory
    held = (f"K/V memory capped at {bound / 2**20:,.1f} MiB: {memory.most_live} live sessions of "
            f"{memory.per_session / 2**20:,.1f} MiB each" if memory is not None else
            f"worst-case KV memory {bound / 2**20:.1f} MiB ({limits.max_sessions} sessions + {limits.max_batch} in "
            f"flight, each at most budget + {args.chunk_size} tokens)")
    print(f"sparsegen serve: {args.model}, {policy['policy']} budget {policy['budget']}; {held}; "
          f"http://{args.host}:{args.port}/v1"
          + (f" ({len(keys)} API keys)" if keys else " (no API key)"), flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        print("warning: listening beyond this machine with no --api-key", file=sys.stderr)
    status = run_server(app, args.host, args.port, args.log_level)
    if status:
        sys.exit(status)


def cmd_bench_serve(args: argparse.Namespace) -> None:
    import asyncio
    import os

    if args.spawn:
        return _bench_serve_spawn(args)
    args.max_tokens = 16 if args.max_tokens is None else args.max_tokens
    if args.model is not None or args.kv_memory is not None:
        raise ValueError("--model and --kv-memory are for --spawn (bench-serve otherwise loads the server at --url)")
    from sparsegen.bench.serve import run_load

    key = args.api_key or os.environ.get("SPARSEGEN_API_KEY")
    report = asyncio.run(run_load(args.url.rstrip("/"), args.sessions, args.turns, args.max_tokens,
                                  {"Authorization": f"Bearer {key}"} if key else None, hostile=args.hostile,
                                  concurrency=args.concurrency, chaos=args.chaos, duration=args.duration,
                                  sample_every=args.sample_every))
    memory, samples = report["memory"], report["samples"]
    print(f"{report['sessions']} sessions x {report['turns']} turns ({report['concurrency']} at a time): "
          f"{report['requests']} requests, {report['errors']} errors in {report['seconds']} s; time to first token "
          f"p50 {report['ttft_p50_s']} s, p99 {report['ttft_p99_s']} s; {report['tokens_per_s']} tokens/s generated; "
          f"{report['reencoded_sessions']:.0f} sessions re-encoded")
    if report["hostile"] is not None:
        print("hostile client meanwhile: " + ", ".join(f"{k} x{v}" for k, v in sorted(report["hostile"].items())))
    if report["chaos"] is not None:
        print(f"{args.chaos} chaos clients meanwhile: " + ", ".join(f"{k} x{v}" for k, v in
                                                                    sorted(report["chaos"].items()))
              + f"; {report['server_faults']} server faults")
    if memory:
        print(f"server RSS after turn 1 {memory[0]['rss_bytes'] / 2**20:.0f} MiB, after turn {memory[-1]['turn']} "
              f"{memory[-1]['rss_bytes'] / 2**20:.0f} MiB; K/V {memory[0]['kv_bytes'] / 2**20:.1f} -> "
              f"{memory[-1]['kv_bytes'] / 2**20:.1f} MiB (bound {report['kv_bytes_bound'] / 2**20:.1f} MiB)")
    if samples:  # at most 8 of them, evenly spread, the last included
        shown = samples[::-(-len(samples) // 8)]
        shown = shown if shown[-1] is samples[-1] else shown[:7] + samples[-1:]
        print("server RSS after " + ", ".join(f"{s['conversations']}: {s['rss_bytes'] / 2**20:.0f} MiB"
                                              for s in shown) + f" conversations (K/V {samples[-1]['kv_bytes'] / 2**20:.1f}"
              f" MiB held at the end)")
    print(f"health after: {report['health']}; engine rebuilds {report['engine_rebuilds']:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        from sparsegen.eval.plots import plot_load

        plot_load(report, args.plot)
    failed = report["errors"] or report["server_faults"] or report["health"].get("status") != "ok"
    if failed:
        print("bench-serve: FAILED: good replies failed, the server answered a fault with a 5xx, or it is not "
              "healthy", file=sys.stderr)
        sys.exit(1)


def _bench_serve_spawn(args: argparse.Namespace) -> None:
    from pathlib import Path

    from transformers import AutoTokenizer

    from sparsegen.bench import spawn
    from sparsegen.models.loading import resolve

    if args.model is None or args.kv_memory is None:
        raise ValueError("--spawn needs --model and --kv-memory, e.g. --model smollm2 --kv-memory 384MiB")
    setup = spawn.SpawnSetup(
        model=args.model, policies=[p for p in args.policies.split(",") if p],
        kv_memory=[_bytes(size) for size in args.kv_memory.split(",")], context=args.context,
        sessions=args.sessions, turns=args.turns, max_tokens=128 if args.max_tokens is None else args.max_tokens,
        chunk_size=args.chunk_size,
        text=Path(args.text) if args.text else None, threads=args.threads, extra=list(args.serve_arg))
    for spec in setup.policies:
        spawn.policy_flags(spec, setup.context)  # a bad policy fails before any server starts
    tokenizer = AutoTokenizer.from_pretrained(resolve(args.model))
    work = Path(args.json).with_suffix(".logs") if args.json else Path(".cache") / "bench-serve"
    print(f"{args.model}: {setup.sessions} conversations of {setup.context:,} tokens over {setup.turns} turns "
          f"({setup.max_tokens} tokens per reply) under each K/V cap; server logs in {work}", flush=True)
    rows = spawn.run(setup, tokenizer, work, on_row=lambda row: print(
        f"  {row['policy']} under {row['kv_memory_bytes'] / 2**20:,.0f} MiB: {row['sessions_admitted']} live, "
        f"{row['decode_tokens_per_s']} decode tok/s, {row['failed']} failed", flush=True))
    print(spawn.summary(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": {**vars(setup), "text": str(setup.text) if setup.text else None}, "rows": rows}, f,
                      indent=2)
    if args.plot:
        spawn.plot(rows, args.plot)
    if any(row["failed"] or row["server_errors"] for row in rows):
        print("bench-serve: FAILED: some requests failed", file=sys.stderr)
        sys.exit(1)


def cmd_sweep(args: argparse.Namespace) -> None:
    from pathlib import Path

    from sparsegen import sweep

    if args.file == "report":
        folder = args.folder or args.out
        if folder is None:
            raise ValueError("give the sweep's folder: sparsegen sweep report DIR")
        results = Path(folder) / "results.jsonl"
        if not results.exists():
            raise ValueError(f"{results} does not exist: run the sweep with --out {folder} first")
        print(sweep.report(results))
        return
    if args.folder is not None:
        raise ValueError(f"unexpected {args.folder!r}: run `sparsegen sweep FILE --out DIR`")
    plan = sweep.Sweep.load(args.file)
    out = Path(args.out or f"runs/sweep-{plan.name}")
    counts = sweep.run(plan, out, workers=args.workers, ray=args.ray, retries=args.retries)
    print(f"sweep {plan.name}: {counts['cells']} cells, {counts['skipped']} already done, {counts['done']} run now, "
          f"{counts['failed']} failed; results in {out / 'results.jsonl'} (`sparsegen sweep report {out}`)")
    if counts["failed"]:
        sys.exit(1)


def cmd_quantize(args: argparse.Namespace) -> None:
    from pathlib import Path

    from sparsegen.models.loading import resolve
    from sparsegen.output import check_output
    from sparsegen.pruning import save_pruned
    from sparsegen.quant import QuantizeConfig, quantize_model

    from sparsegen.models.synthetic import is_random, random_model

    config = QuantizeConfig(bits=args.bits, group_size=args.group_size, method=args.method, nsamples=args.nsamples,
                            seqlen=args.seqlen, seed=args.seed, batch_size=args.batch_size)
    source = None if is_random(args.model) else Path(resolve(args.model))
    out = check_output(args.out, source, args.force)
    if source is None:  # a model shape with random weights, to measure quantized decode speed at that size
        from sparsegen.models.loading import check_device, load_config, resolve_dtype

        if config.method != "rtn":
            raise ValueError(f"{args.model} has no tokenizer to calibrate GPTQ with; use --method rtn")
        device, shape = check_device(args.device), load_config(args.model)
        model = random_model(shape, device, resolve_dtype(args.dtype, shape, device), args.seed)
        tokenizer = None
    else:
        model, tokenizer = load_model(args)
    ids, calib = _calibration(args, tokenizer, "train") if config.method == "gptq" else (None, None)
    loaded = model.dtype
    report = {"model": args.model, "calibration": str(calib) if calib else None, **quantize_model(model, config, ids)}
    save_pruned(model, tokenizer, out, report, "quantization.json", overwrite=args.force)  # (a pruned source's
    # sparsity.json travels with it)
    before = sum(f.stat().st_size for f in source.glob("*.safetensors")) if source and source.exists() else None
    after = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    linear = report["linear_bytes_before"] / report["linear_bytes_after"]
    group = report["group_size"] or "row"
    chosen = " (the largest that divides every linear)" if config.group_size is None else ""
    print(f"{config.method} int{config.bits}, group {group}{chosen}: {len(report['layers'])} linear layers "
          f"{linear:.2f}x smaller than in {str(loaded).removeprefix('torch.')}; weights on disk "
          + (f"{before / 2**20:.2f} -> " if before else "") + f"{after / 2**20:.2f} MiB; {report['seconds']:.1f} s; "
          f"saved to {out}")


def cmd_prompt_tune(args: argparse.Namespace) -> None:
    from sparsegen.models import load
    from sparsegen.output import check_output
    from sparsegen.prompt import TuneConfig, tune_prompt

    config = TuneConfig(tokens=args.tokens, steps=args.steps, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                        init=args.init)
    out = check_output(args.out, overwrite=args.force, folder=False)
    model, tokenizer = load_model(args)
    teacher = None
    if args.teacher:
        teacher, teacher_tokenizer = load(args.teacher, device=args.device, dtype=args.dtype)
        if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"the teacher {args.teacher} has another tokenizer than {args.model}; distillation "
                             f"compares next-token distributions, so both must share one vocabulary")
    args.seqlen = args.seqlen or model.config.max_position_embeddings - args.tokens
    ids, calib = _calibration(args, tokenizer, "train")
    prefix = tune_prompt(model, ids, config, teacher)
    prefix.info.update(model=args.model, teacher=args.teacher, calibration=str(calib))
    prefix.save(out, overwrite=args.force)
    info = prefix.info
    print(f"{args.tokens}-token soft prompt, {args.steps} steps on {len(ids) - config.eval_windows} windows of "
          f"{args.seqlen} tokens ({info['loss']}); held-out loss {info['held_out_loss_without_prompt']:.4f} without "
          f"the prompt -> {info['held_out_loss_with_prompt']:.4f} with it; {info['seconds']} s; saved to {out}")


def cmd_contextual_stats(args: argparse.Namespace) -> None:
    from sparsegen.contextual.stats import contextual_statistics

    model, tokenizer = load_model(args)
    ids, calib = _calibration(args, tokenizer, "test")
    stats = {"model": args.model, "text": str(calib), **contextual_statistics(model, ids, args.mass)}
    print(f"{stats['tokens']:,} tokens from {calib}; sparsity = fraction a token can drop keeping {args.mass:.0%} "
          f"of the mass")
    print(f"{'layer':>5}{'MLP zeros':>11}{'MLP sparsity':>14}{'head sparsity':>15}{'cos(h, h_next)':>16}")
    for layer in stats["layers"]:
        heads, cosine = layer["head_sparsity"], layer["residual_cosine"]
        print(f"{layer['layer']:>5}{layer['mlp_zero_fraction']:>11.3f}{layer['mlp_sparsity']:>14.3f}"
              f"{'-' if heads is None else format(heads, '.3f'):>15}{'-' if cosine is None else format(cosine, '.3f'):>16}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stats, f, indent=2)


def cmd_contextual_fit(args: argparse.Namespace) -> None:
    from sparsegen.models.loading import resolve
    from sparsegen.models.synthetic import is_random, random_model
    from sparsegen.output import check_output

    out = check_output(args.out, None if is_random(args.model) else resolve(args.model), args.force)
    if args.method == "teal":
        if args.sparsity is None or args.top_k is not None or args.recall is not None or args.heads:
            raise ValueError("teal takes --sparsity only (the fraction of every linear's inputs dropped)")
        args.targets = args.targets or "all"
    elif args.method != "dejavu":
        raise ValueError(f"unknown method {args.method!r}; choose dejavu or teal")
    elif args.targets:
        raise ValueError("--targets is for teal; dejavu predicts MLP neurons (and heads with --heads)")
    else:
        from sparsegen.contextual.dejavu import DejaVuConfig

        config = DejaVuConfig(sparsity=args.sparsity, top_k=args.top_k, recall=args.recall, heads=args.heads,
                              rank=args.rank, epochs=args.epochs, seed=args.seed)
    args.nsamples = args.nsamples or (128 if args.method == "dejavu" else 32)
    if is_random(args.model):  # no tokenizer: random token ids (for speed measurements on model shapes)
        import torch

        from sparsegen.models.loading import check_device, load_config, resolve_dtype

        device = check_device(args.device)
        shape = load_config(args.model)
        model = random_model(shape, device, resolve_dtype(args.dtype, shape, device), args.seed)
        generator = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(model.config.vocab_size, (args.nsamples, args.seqlen), generator=generator)
        calib = "random token ids"
    else:
        model, tokenizer = load_model(args)
        ids, calib = _calibration(args, tokenizer, "train")
    started = time.perf_counter()
    if args.method == "teal":
        from sparsegen.contextual.teal import fit_teal

        plan = fit_teal(model, ids, args.sparsity, args.targets, batch_size=args.batch_size, seed=args.seed)
    else:
        from sparsegen.contextual.dejavu import fit_dejavu

        plan = fit_dejavu(model, ids, config, batch_size=args.batch_size)
    plan.info.update(model=args.model, calibration=str(calib), seconds=round(time.perf_counter() - started, 1))
    plan.save(out, overwrite=args.force)
    if args.method == "teal":
        achieved = plan.info["achieved_on_calibration"]
        print(f"teal ({args.targets}): {len(achieved)} linear inputs, target sparsity {args.sparsity}, achieved on calibration "
              f"{min(achieved.values()):.3f}-{max(achieved.values()):.3f}; {plan.info['seconds']} s; saved to {out}")
        return
    print(f"deja vu on {ids.numel():,} tokens ({plan.info['labels']}); per layer on held-out windows:")
    print(f"{'layer':>5}{'kind':>6}{'units':>7}{'K':>6}{'sparsity':>10}{'rank':>6}{'recall':>8}{'precision':>11}"
          f"{'mass':>7}")
    for layer in plan.info["report"]:
        for kind in ("mlp", "heads"):
            if kind in layer:
                r = layer[kind]
                print(f"{layer['layer']:>5}{kind:>6}{r['units']:>7}{r['k']:>6}{r['sparsity']:>10.3f}{r['rank']:>6}"
                      f"{r['recall']:>8.3f}{r['precision']:>11.3f}{r['mass_recall']:>7.3f}")
    print(f"{plan.info['seconds']} s; saved to {out}")


class Parser(argparse.ArgumentParser):
    """A usage mistake is one line (and the way to the help), like every other error a user can cause."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="sparsegen", description="Sparse, long-sequence inference for Hugging Face causal LMs.",
                    epilog="sparsegen --plugin FILE.py|MODULE COMMAND ...: import a file or module that registers a "
                           "policy, pruning method or model family first")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="architecture, size and KV-cache cost of a model")
    _model_args(p, positional=True)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="continue a prompt under a KV-cache policy")
    _model_args(p, run=True)
    _compile_arg(p)
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--prompt-file", default=None, help="read the prompt from a file (any length: it is prefilled in chunks)")
    _policy_args(p)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object (text, new_tokens, kv_tokens_peak, ...)")
    p.add_argument("--context", default=None, metavar="FILE.safetensors",
                   help="start from a context compressed by `sparsegen compress` (it carries its policy); the prompt "
                        "is the question")
    _speculative_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("inspect", help="which tokens of a prompt each KV policy keeps, per layer and head: a table, "
                                       "a self-contained HTML page (--html), a PNG grid (--png), JSON")
    _model_args(p, run=True)
    p.add_argument("--prompt", default=None, help="the text")
    p.add_argument("--prompt-file", default=None, help="read the text from a file")
    p.add_argument("--policies", default="window,streaming,h2o,snapkv", help="comma-separated (default "
                   "window,streaming,h2o,snapkv)")
    p.add_argument("--budget", type=budget_arg, default=256, help="KV tokens kept per layer, or a share (default 256)")
    p.add_argument("--question", default=None, help="asked after the text; each policy answers it")
    p.add_argument("--answer", default=None, help="the text the question needs: its tokens are marked")
    p.add_argument("--protocol", choices=["stream", "context"], default="stream")
    p.add_argument("--kv-bits", type=int, choices=[8, 4, 2], default=None)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens of each policy's answer (default 16)")
    p.add_argument("--html", default=None, metavar="OUT.html", help="a self-contained page (no network)")
    p.add_argument("--png", default=None, metavar="OUT.png", help="the layer x head grid of each policy")
    p.add_argument("--json", default=None, metavar="OUT.json", help="what sparsegen.inspect returns")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("compress", help="compress a context once under a KV policy (kvpress's protocol) and save it, "
                                        "to ask it many questions")
    _model_args(p, run=True)
    p.add_argument("--context-file", required=True, help="the context's text")
    _policy_args(p)
    p.add_argument("--out", required=True, metavar="FILE.safetensors", help="where to save the compressed context")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_compress)

    p = sub.add_parser("compare", help="the same prompt under several KV policies: memory, time and text side by side")
    _model_args(p, run=True)
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--policies", default="full,window,streaming,h2o",
                   help="comma-separated (default full,window,streaming,h2o); POLICY+kv4 holds that cache in 4 bits "
                        "(8, 4, 2); speculative:POLICY[:BUDGET] decodes losslessly under the full cache, drafting "
                        "from POLICY")
    p.add_argument("--budget", type=budget_arg, default="128",
                   help="KV budget for every policy but full (tokens or a fraction)")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--json", action="store_true")
    _speculative_args(p, with_policy=False)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("ppl", help="perplexity: streaming through a KV policy (--stream) or in windows (--windows)")
    _model_args(p, run=True)
    p.add_argument("--text", default=None, help="text file or folder (default ../shared/data/books/test)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", action="store_true", help="one token at a time through the policy's cache")
    mode.add_argument("--windows", action="store_true", help="non-overlapping windows of --ctx tokens, dense")
    p.add_argument("--policy", action="append", default=None,
                   help=f"{', '.join(POLICIES)} or recompute; repeat to compare (default full)")
    _budget_args(p, "KV tokens per layer (recompute: its window)")
    p.add_argument("--max-tokens", type=int, default=20000, help="tokens predicted, over all streams (default 20000)")
    p.add_argument("--streams", type=int, default=None, help="independent streams in one batch (default: files, up to 4)")
    p.add_argument("--segment", type=int, default=1024, help="tokens per reported segment (default 1024)")
    p.add_argument("--every", type=int, default=256, help="tokens between KV-memory samples (default 256)")
    p.add_argument("--chunk", type=int, default=256,
                   help="tokens per forward call; every policy computes exactly what one token per call would (default 256)")
    p.add_argument("--ctx", type=int, default=None, help="--windows: window length (default: the model's)")
    p.add_argument("--max-windows", type=int, default=None, help="--windows: at most this many windows")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--csv", default=None, help="write per-segment PPL as CSV to this file")
    p.add_argument("--plot", default=None, help="write log-PPL and KV memory vs tokens as a PNG")
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("fidelity", help="a policy against the full cache: ROUGE-L, tokens to divergence, KL")
    _model_args(p, run=True)
    p.add_argument("--text", default=None, help="text file to cut prompts from (default books/test/dracula.txt)")
    p.add_argument("--policy", action="append", required=True, help="policy to compare with full; repeat for several")
    _budget_args(p, "KV tokens, or a fraction of the prompt length (0.2)")
    p.add_argument("--prompts", type=int, default=16, help="number of prompts (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=400, help="tokens per prompt (default 400)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.set_defaults(func=cmd_fidelity)

    p = sub.add_parser("passkey", help="pass-key retrieval accuracy per context length and needle depth")
    _model_args(p, run=True)
    p.add_argument("--text", default=None, help="haystack text (default books/test/great_expectations.txt)")
    p.add_argument("--policy", action="append", default=None, help="policy; repeat for several (default full)")
    _budget_args(p, "KV tokens per layer (a token count)")
    p.add_argument("--lengths", default="256,512,1024,2048", help="context lengths, tokens (comma-separated)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths, 0-1 (comma-separated)")
    p.add_argument("--trials", type=int, default=5, help="keys per (length, depth) (default 5)")
    p.add_argument("--protocol", choices=["stream", "context"], default="stream",
                   help="stream: the prompt in chunks, evicting as it goes (default); context (kvpress's): all before "
                        "the question in one pass, compressed once, then the question")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="ask in the model's chat template (default: when the model has one)")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--plot", default=None, help="write accuracy heatmaps as a PNG")
    p.set_defaults(func=cmd_passkey)

    p = sub.add_parser("ruler", help="RULER's synthetic long-context tasks (needles, variable tracking, word "
                                     "extraction), generated from a haystack text, per policy and protocol")
    _model_args(p, run=True)
    p.add_argument("--haystack", default=None, metavar="FILE",
                   help="text the haystacks and word lists come from (default books/test/great_expectations.txt)")
    p.add_argument("--tasks", default=None, help="comma-separated RULER task names (default: all eleven)")
    p.add_argument("--length", default="4096", help="prompt lengths, tokens (comma-separated; default 4096)")
    p.add_argument("--samples", type=int, default=20, help="prompts per task and length (default 20)")
    p.add_argument("--policies", default="full", help="comma-separated KV policies (default full)")
    _budget_args(p, "KV tokens kept per layer, or a fraction of the context (0.5)")
    p.add_argument("--protocol", default="stream",
                   help="stream: the whole prompt in chunks, evicting as it goes; context (kvpress's): the context in "
                        "one pass, compressed once, then the question; or stream,context (default stream)")
    p.add_argument("--depths", default=None, help="needle depths 0-1 the samples cycle through (default 0,.25,.5,.75,1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer tokens (default RULER's per task)")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="ask in the model's chat template (default: when the model has one)")
    p.add_argument("--json", default=None, help="write the rows (with every answer) as JSON to this file")
    p.add_argument("--plot", default=None, help="write needle-depth x length heat maps per policy as a PNG")
    p.set_defaults(func=cmd_ruler)

    p = sub.add_parser("lm-eval", help="lm-evaluation-harness with sparsegen's model registered: --model sparsegen "
                                       "--model_args pretrained=M,policy=P,budget=B[,kv_bits=4] --tasks ...",
                       add_help=False)  # (main hands everything after lm-eval to lm-eval)

    p = sub.add_parser("bench", help="decode latency, throughput and memory per KV policy vs context, with roofline")
    _model_args(p, more="; or random:PRESET; several, comma-separated, are measured in turn and compared")
    _weights_arg(p, several=True)
    p.add_argument("--policies", default="full,window,streaming,h2o,streaming-h2o,recompute",
                   help="comma-separated; besides the KV policies: dense (transformers' DynamicCache) and recompute "
                        "(re-encode the last --budget tokens for every token)")
    p.add_argument("--contexts", default="1024,4096,16384,32768", help="context lengths before decoding")
    _budget_args(p, "KV tokens per layer for every policy but full/dense (recompute: its window)")
    p.add_argument("--new-tokens", type=int, default=128, help="timed decode steps (default 128)")
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps first (default 4)")
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated (default 1)")
    p.add_argument("--prefill", choices=["real", "synthetic"], default="real",
                   help="real: encode the context (timed); synthetic: fill the cache with random K/V of the same "
                        "shape, for contexts too long to prefill on this machine (no prefill time)")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk, tokens (default 512)")
    p.add_argument("--text", default=None, metavar="FILE|DIR",
                   help="prefill with this text (each row from another place in it) instead of random token ids: "
                        "what speculative rows need for representative acceptance")
    p.add_argument("--recompute-tokens", type=int, default=8, help="timed steps of recompute (slow; default 8)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure every policy N times, interleaved, pooling the steps (steadier ratios; default 1)")
    p.add_argument("--memory-limit", default=None, help="e.g. 80GiB: report the largest batch whose weights + KV fit")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--contextual", default=None, metavar="DIR[,DIR]",
                   help="also measure with these contextual plans (`sparsegen contextual fit`); 'none' is the model "
                        "without, e.g. none,ctx/teal50: each variant's speed-up over the first is printed")
    _prompt_args(p)
    p.add_argument("--compile", action="store_true",
                   help="time the decode step through torch.compile (fullgraph; inductor on CPU, CUDA graphs on "
                        "CUDA); compiled once per row's shape, the compile kept out of the timed steps")
    p.add_argument("--baseline", choices=["llama.cpp"], default=None,
                   help="also time llama.cpp on the model's own GGUF (same contexts, threads and steps, batch 1) and "
                        "print each row's tok/s over llama.cpp's; needs `make llamacpp` (a one-time source build)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write one row per measurement (with the environment) to this file")
    p.add_argument("--plot", default=None, help="write ms/token and peak memory vs context as a PNG")
    p.add_argument("--markdown", action="store_true", help="also print the rows as a Markdown table")
    _speculative_args(p, with_policy=False, with_draft_model=False)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("prune", help="prune weights (magnitude, Wanda, SparseGPT; unstructured, N:M or structured)")
    _model_args(p)
    p.add_argument("--method", required=True, help="magnitude, wanda, sparsegpt, or one registered by --plugin")
    amount = p.add_mutually_exclusive_group(required=True)
    amount.add_argument("--sparsity", type=float, help="fraction of each layer's weights removed, e.g. 0.5")
    amount.add_argument("--pattern", help="N:M, keep N of every M consecutive inputs, e.g. 2:4")
    amount.add_argument("--structured", help="remove whole MLP neurons / KV head groups: neurons=0.5[,heads=0.25]")
    _calibration_args(p)
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--per-row", dest="per_row", action="store_true", default=None,
                      help="compare scores within each output row (Wanda's default)")
    rows.add_argument("--per-layer", dest="per_row", action="store_false",
                      help="compare scores over the whole layer (magnitude's default)")
    p.add_argument("--out", required=True, help="folder for the pruned checkpoint (+ sparsity.json)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("chat", help="a terminal conversation in one bounded cache (history never re-encoded)")
    _model_args(p, run=True)
    _compile_arg(p)
    _conversation_args(p)
    p.add_argument("--system", default=None, help="a system message at the start of the conversation")
    p.add_argument("--script", default=None, help="read the user's turns from this file, one per line (no terminal)")
    p.add_argument("--json", default=None, help="write per-turn statistics (latency, KV held, memory) to this file")
    p.add_argument("--plot", default=None, help="write per-turn latency and memory as a PNG")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server whose sessions live in bounded caches")
    _model_args(p, run=True)
    _compile_arg(p)
    _conversation_args(p, speculative=False)  # (serve keeps caches bounded; speculation verifies with full)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY'; repeat for several clients, each with its own sessions "
                        "(or set SPARSEGEN_API_KEY)")
    p.add_argument("--api-keys-file", default=None, metavar="FILE", help="API keys, one per line (# comments)")
    p.add_argument("--max-sessions", type=positive_int, default=64,
                   help="conversation caches kept, least recently used dropped beyond (default 64)")
    p.add_argument("--max-batch", type=positive_int, default=16, help="replies decoded together (default 16)")
    p.add_argument("--context", action="append", default=None, metavar="NAME=FILE",
                   help="a context compressed by `sparsegen compress` (under the server's policy), continued by "
                        "requests that send \"context\": NAME; repeat for several")
    p.add_argument("--kv-memory", default=None, metavar="SIZE",
                   help="admit sessions by K/V memory, e.g. 2GiB: each live session reserves its policy's whole "
                        "allocation (budget + a chunk, and its row in the decode batch; full: --max-context); "
                        "beyond the cap, idle sessions are dropped least recently used first (their next request "
                        "re-encodes, X-Session-History: reencoded) or requests wait (429 beyond --max-queue). "
                        "Lets policy 'full' be served")
    p.add_argument("--max-context", type=positive_int, default=None, metavar="TOKENS",
                   help="the most tokens one conversation may hold; sizes a full cache under --kv-memory (default: "
                        "the model's max_position_embeddings)")
    p.add_argument("--prefill-budget", type=positive_int, default=None, metavar="TOKENS",
                   help="prompt tokens one engine step encodes while other replies decode (default: --chunk-size): "
                        "what a long prompt adds to their inter-token latency, at the cost of its own time to first "
                        "token")
    p.add_argument("--idle-grace", type=float, default=2.0, metavar="SECONDS",
                   help="under --kv-memory, an idle session is not dropped for another within this many seconds of "
                        "its last reply (a client's next turn usually follows at once; default 2)")
    p.add_argument("--max-queue", type=positive_int, default=64, help="requests waiting beyond those: 429 (default 64)")
    p.add_argument("--max-tokens-limit", type=positive_int, default=1024,
                   help="largest max_tokens a request may ask (default 1024)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=8192,
                   help="most new tokens one request may bring to encode (default 8192)")
    p.add_argument("--max-messages", type=positive_int, default=256, help="most messages in one request (default 256)")
    p.add_argument("--max-stop-chars", type=positive_int, default=256,
                   help="longest stop string (default 256; at most 4 of them)")
    p.add_argument("--max-request-bytes", type=positive_int, default=1 << 20,
                   help="largest request body (default 1 MiB)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench-serve", help="load a running `sparsegen serve`: concurrent sessions x turns, time to "
                                           "first token, tokens/s, errors, memory per turn")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--sessions", type=positive_int, default=64, help="conversations in all (default 64)")
    p.add_argument("--concurrency", type=positive_int, default=None,
                   help="conversations at a time (default: all of them at once)")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="instead of --sessions conversations, start new ones for this long (a soak)")
    p.add_argument("--sample-every", type=positive_int, default=None, metavar="N",
                   help="sample the server's memory after every N conversations")
    p.add_argument("--chaos", type=int, default=0, metavar="N",
                   help="N more clients that hang up mid-stream, time out, send garbage, reuse a session at once and "
                        "send slow bodies meanwhile; exit status 1 if any good reply fails or any fault gets a 5xx")
    p.add_argument("--turns", type=positive_int, default=10, help="turns per conversation (default 10)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per reply (default 16; 128 with --spawn)")
    p.add_argument("--api-key", default=None, help="the server's key (or SPARSEGEN_API_KEY)")
    p.add_argument("--hostile", action="store_true",
                   help="meanwhile, one client loops over requests that once broke servers (tiny temperature, huge "
                        "stop strings and prompts, a 200 MiB chunked upload)")
    p.add_argument("--json", default=None, help="write the report (with memory per turn) to this file")
    p.add_argument("--plot", default=None, help="write server memory per turn as a PNG (with --spawn: decode tokens/s "
                                                "against the K/V cap, a line per policy)")
    spawn = p.add_argument_group("serving at fixed memory (--spawn)")
    spawn.add_argument("--spawn", action="store_true",
                       help="start `sparsegen serve --kv-memory CAP` itself for each policy and cap, hold --sessions "
                            "long conversations at once against it, and compare: sessions admitted, decode and "
                            "end-to-end tokens/s, TTFT and inter-token latency, failures, peak RSS")
    spawn.add_argument("--model", default=None, help="the model each spawned server runs (e.g. smollm2)")
    spawn.add_argument("--policies", default="full,h2o:0.2,streaming:1024",
                       help="NAME or NAME:BUDGET (tokens, or a fraction of --context), comma-separated (default "
                            "full,h2o:0.2,streaming:1024)")
    spawn.add_argument("--kv-memory", default=None, metavar="SIZE[,SIZE]",
                       help="K/V caps, e.g. 384MiB or 256MiB,512MiB (each policy runs under each)")
    spawn.add_argument("--context", type=positive_int, default=4096,
                       help="tokens each conversation holds at its end: an opening excerpt of a book, then the turns "
                            "(default 4096; also each server's --max-context)")
    spawn.add_argument("--chunk-size", type=positive_int, default=256, help="the servers' prefill chunk (default 256)")
    spawn.add_argument("--text", default=None, help="a .txt file or folder the openings come from (default: the books)")
    spawn.add_argument("--threads", type=positive_int, default=None, help="CPU threads of each server")
    spawn.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                       help="one more flag for every spawned server, e.g. --serve-arg=--kv-bits=4 (repeatable)")
    p.set_defaults(func=cmd_bench_serve)

    p = sub.add_parser("sweep", help="run a grid of experiments from a TOML file (models x policies x budgets x "
                                     "kv-bits x tasks x lengths), resumable, locally or on Ray; `sweep report DIR` "
                                     "prints its table")
    p.add_argument("file", help="the sweep file (e.g. examples/sweep-small.toml), or 'report'")
    p.add_argument("folder", nargs="?", default=None, help="with 'report': the sweep's --out folder")
    p.add_argument("--out", default=None, help="folder for results.jsonl (default: runs/sweep-NAME)")
    p.add_argument("--workers", type=positive_int, default=1,
                   help="cells at a time in the local process pool (default 1: a cell uses [sweep] threads CPUs)")
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="run each cell as a Ray task: 'auto' joins a running cluster or starts a local one")
    p.add_argument("--retries", type=int, default=1, help="Ray retries of a failed cell (default 1)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("quantize", help="weight-only quantization (GPTQ or round-to-nearest, 4/8 bits), also of "
                                        "pruned checkpoints (their zeros stay zero)")
    _model_args(p)
    p.add_argument("--bits", type=int, default=4, help="4 or 8 (default 4)")
    p.add_argument("--group-size", type=int, default=None,
                   help="input columns per scale; 0 = one per row (default: the largest of 128, 64, 32, 16 that divides "
                        "every linear: 64 on SmolLM2)")
    p.add_argument("--method", default="gptq", help="gptq (calibrated, default) or rtn (round to nearest)")
    _calibration_args(p, "gptq ")
    p.add_argument("--out", required=True, help="folder for the quantized checkpoint (+ quantization.json)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("prompt-tune", help="learn a soft prompt that restores a compressed model's quality "
                                           "(Compress, Then Prompt); use it with --soft-prompt FILE")
    _model_args(p)
    p.add_argument("--teacher", default=None,
                   help="the dense model: learn to match its next-token distributions (KL) instead of the text")
    p.add_argument("--tokens", type=int, default=32, help="soft-prompt length, tokens (default 32)")
    p.add_argument("--init", default="vocab", choices=["vocab", "text"],
                   help="start from random vocabulary embeddings (default) or from a passage of the training text")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate, cosine-decayed (default 3e-3)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step (default 8)")
    p.add_argument("--calib", default=None, help="training text file or folder (default ../shared/data/books/train)")
    p.add_argument("--nsamples", type=int, default=1024, help="calibration windows to draw from (default 1024)")
    p.add_argument("--seqlen", type=int, default=None,
                   help="tokens per window (default: the model's context minus the prompt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the prompt file to write (.safetensors)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.set_defaults(func=cmd_prompt_tune)

    p = sub.add_parser("contextual", help="contextual sparsity: statistics, and fitting Deja Vu predictors or TEAL "
                                          "thresholds (run them with --contextual DIR)")
    contextual = p.add_subparsers(dest="contextual_command", required=True, metavar="STEP")
    p = contextual.add_parser("stats", help="per-layer MLP/head sparsity per input and residual-stream similarity")
    _model_args(p)
    p.add_argument("--calib", default=None, help="text file or folder (default ../shared/data/books/test)")
    p.add_argument("--nsamples", type=int, default=32, help="text windows (default 32)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mass", type=float, default=0.95, help="fraction of activation mass the kept units carry")
    p.add_argument("--json", default=None, help="write the statistics to this file")
    p.set_defaults(func=cmd_contextual_stats)
    p = contextual.add_parser("fit", help="fit Deja Vu predictors or TEAL thresholds; use with --contextual DIR")
    _model_args(p)
    p.add_argument("--method", required=True, help="dejavu (low-rank lookahead predictors) or teal (thresholds)")
    amount = p.add_mutually_exclusive_group(required=True)
    amount.add_argument("--sparsity", type=float, help="fraction of MLP neurons (dejavu) / linear inputs (teal) skipped")
    amount.add_argument("--top-k", type=int, help="dejavu: MLP neurons kept per token")
    amount.add_argument("--recall", type=float,
                        help="dejavu: per layer, the smallest K whose recall on validation windows reaches this")
    p.add_argument("--heads", type=float, default=0.0,
                   help="dejavu: fraction of attention heads skipped (default 0: heads are not predicted)")
    p.add_argument("--targets", default=None, choices=["all", "mlp"],
                   help="teal: sparsify the inputs of every decoder linear (default) or of the MLP's only")
    p.add_argument("--rank", type=int, default=None, help="dejavu: predictor rank (default: 5%% of the MLP's cost)")
    p.add_argument("--epochs", type=int, default=20, help="dejavu: training epochs per predictor (default 20)")
    p.add_argument("--calib", default=None, help="calibration text file or folder (default ../shared/data/books/train)")
    p.add_argument("--nsamples", type=int, default=None, help="calibration windows (default dejavu 128, teal 32)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder for contextual.json (+ predictors.safetensors)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.set_defaults(func=cmd_contextual_fit)

    p = sub.add_parser("train-reference", help="train the bundled reference model from ../shared/data/books/train")
    p.add_argument("--preset", default="reference", choices=["reference", "reference-relu", "reference-large"],
                   help="reference (SwiGLU), reference-relu (ReLU gate, for contextual sparsity), reference-large")
    p.add_argument("--out", default=None, help="checkpoint folder (default: the package's bundled folder)")
    p.add_argument("--work", default=None, help="training state, log and tokenizer (default runs/PRESET); resumes from it")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    for size in ("hidden-size", "layers", "heads", "kv-heads", "intermediate-size", "context"):
        p.add_argument(f"--{size}", type=int, default=None, help="override the preset's model size")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between resumable training states")
    p.add_argument("--stop-after", type=int, default=None, help="end this run after N steps (state saved; rerun to resume)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--no-report", action="store_true", help="skip the perplexity and sink evaluation after training")
    p.set_defaults(func=cmd_train_reference)

    p = sub.add_parser("sinks", help="attention-sink statistics: attention mass on token 0, and PPL with/without the first tokens")
    _model_args(p, positional=True)
    p.add_argument("--text", default=None, help="text file or folder (default ../shared/data/books/test)")
    p.add_argument("--length", type=int, default=256, help="window length (default 256)")
    p.add_argument("--window", type=int, default=64, help="local attention window (default 64)")
    p.add_argument("--sinks", type=int, default=4, help="first tokens kept in the sink pattern (default 4)")
    p.add_argument("--windows", type=int, default=128, help="number of text windows (default 128)")
    p.add_argument("--no-bos", action="store_true", help="do not start windows with the BOS token")
    p.set_defaults(func=cmd_sinks)
    return parser


def _load_plugins(argv: list[str]) -> list[str]:
    """Import every leading ``--plugin FILE.py|MODULE`` (what it registers then shows in the commands' choices); the
    rest of ``argv``."""
    from sparsegen.plugins import load_plugin

    while argv and (argv[0] == "--plugin" or argv[0].startswith("--plugin=")):
        if "=" in argv[0]:
            spec, argv = argv[0].split("=", 1)[1], argv[1:]
        else:
            spec, argv = (argv[1] if len(argv) > 1 else ""), argv[2:]
        if not spec:
            raise ValueError("--plugin takes a .py file or a module name")
        load_plugin(spec)
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        argv = _load_plugins(argv)
    except (OSError, ValueError, ImportError) as err:
        print(f"sparsegen: error: {err}", file=sys.stderr)
        return 2
    try:
        if argv[:1] == ["lm-eval"]:  # lm-eval parses its own arguments
            args = argparse.Namespace(command="lm-eval", func=cmd_lm_eval, lm_eval_args=argv[1:])
        else:
            args = build_parser().parse_args(argv)
    except SystemExit as exit:  # --help, or a usage mistake (already reported in one line)
        return exit.code
    from sparsegen.models import ModelLoadError

    try:
        args.func(args)
    except (ModelLoadError, OSError, ValueError) as err:  # what a user can cause; anything else is a bug: traceback
        message = str(err) if not isinstance(err, OSError) or not err.filename else \
            f"{err.filename}: {err.strerror or err}"
        print(f"sparsegen {args.command}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
