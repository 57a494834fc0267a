"""``bench``: decode speed and memory per policy, with llama.cpp beside it."""

from __future__ import annotations

import argparse
import json

from sparsegen.cli.common import (
    budget_args,
    compile_arg,
    int_list,
    kv_quantization,
    model_args,
    parse_bytes,
    policy_specs,
    prompt_args,
    speculative_args,
    weights_arg,
)


def cmd_bench(args: argparse.Namespace) -> None:
    import torch

    from sparsegen.bench import report
    from sparsegen.bench.roofline import measure_bandwidth
    from sparsegen.contextual import Contextual, attach, detach
    from sparsegen.kv.quantized import policy_and_bits
    from sparsegen.models.anatomy import weights_of
    from sparsegen.models.loading import check_device
    from sparsegen.models.synthetic import is_random
    from sparsegen.quant.restore import WEIGHTS

    contexts, batches = int_list(args.contexts, "contexts"), int_list(args.batch, "batch")
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    if args.baseline == "llama.cpp":
        from sparsegen.bench import llamacpp
        from sparsegen.models.gguf import gguf_file

        if not llamacpp.available():
            raise ValueError(llamacpp.INSTALL)
        ggufs = {m.strip(): gguf_file(m.strip()) for m in args.model.split(",") if m.strip()}  # fails before loading
    if not isinstance(args.budget, int) and any(policy_and_bits(n)[0] not in ("dense", "full")
                                                and not n.startswith("speculative:") for n in names):
        raise ValueError("--budget (a token count) is needed for every policy but dense and full (recompute: its "
                         "window)")
    if args.threads:
        torch.set_num_threads(args.threads)
    policies = _bench_policies(args, names)
    device = check_device(args.device)
    bandwidth = measure_bandwidth(device)
    rows, env = [], None
    names_of_models = [m.strip() for m in args.model.split(",") if m.strip()]
    variants = [v.strip() for v in (args.contextual or "none").split(",") if v.strip()]
    plans = {v: Contextual.load(v) for v in variants if v != "none"}  # a bad folder fails before any model is built
    weight_modes = [w.strip() for w in args.weights.split(",") if w.strip()]
    if not weight_modes or any(w not in ("auto", *WEIGHTS) for w in weight_modes):
        raise ValueError(f"--weights takes auto, {', '.join(WEIGHTS)} (comma-separated), got {args.weights!r}")
    for name, weights in [(n, w) for n in names_of_models for w in weight_modes]:
        model, tokenizer = _bench_load(args, name, weights, device)
        weights = weights_of(model)  # (auto: what it stood for)
        for variant in variants:
            label = name if variant == "none" else f"{name} + {variant}"
            label = label if len(weight_modes) == 1 and weights == "fp32" else f"{label} [{weights}]"
            if variant != "none":
                attach(model, plans[variant])
            baseline = None
            if args.baseline == "llama.cpp" and variant == "none":  # measured beside each weights variant's rows
                baseline = llamacpp.Baseline(ggufs[name], label, args.new_tokens, args.warmup,
                                             args.threads or torch.get_num_threads(), args.seed)
            measured, env = _bench_model(args, model, label, is_random(name), bandwidth, policies, contexts, batches,
                                         _bench_text(args, tokenizer, name), baseline)
            rows += measured
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


def _bench_policies(args: argparse.Namespace, names: list[str]) -> list[tuple[str, object]]:
    """``(name, make)`` for each row kind named: ``make()`` builds its policy (None for dense; recompute's window; a
    Speculation), checked here, before any model is built."""
    from sparsegen.bench import decode
    from sparsegen.engine.speculative import Speculation, draft_length, draft_policy
    from sparsegen.kv.quantized import policy_and_bits

    # (a POLICY+kvBITS row is POLICY's, its K/V held in BITS bits: ``decode.row_kv_bits``)
    args.policy = list(dict.fromkeys(policy_and_bits(n)[0] for n in names
                                     if n not in decode.BASELINES and not n.startswith("speculative:")))
    specs = policy_specs(args) if args.policy else {}
    draft_tokens = draft_length(args.draft_tokens)
    policies = []
    for name in names:
        if name == "dense":
            policies.append((name, lambda: None))
        elif name == "recompute":
            policies.append((name, lambda: args.budget))
        elif name.startswith("speculative:"):
            spec = name.removeprefix("speculative:")
            policies.append((name, lambda spec=spec: Speculation(draft_policy(spec), draft_tokens)))
        else:
            policies.append((name, specs[policy_and_bits(name)[0]].build))
            decode.row_kv_bits(name, None)  # (bad bit widths fail here)
    for _, make in policies:
        make()  # bad budgets and splits fail here
    return policies


def _bench_load(args: argparse.Namespace, name: str, weights: str, device):
    """The model (and its tokenizer, where one is needed) with the weights and prompt the row asks for."""
    from sparsegen.assemble import put_prompt, restore_weights
    from sparsegen.models import load
    from sparsegen.models.loading import load_config, resolve_dtype
    from sparsegen.models.synthetic import is_random, random_model

    tokenizer = None
    if is_random(name):
        config = load_config(name)
        model = random_model(config, device, resolve_dtype(args.dtype, config, device), args.seed)
    else:  # synthetic prefill needs no tokenizer (a checkpoint compressed from a random: shape has none)
        needs_tokenizer = args.prefill == "real" or args.hard_prompt is not None or args.text is not None
        model, tokenizer = load(name, device=device, dtype=args.dtype, tokenizer=needs_tokenizer)
    restore_weights(model, weights, name)
    put_prompt(model, tokenizer, args.soft_prompt, args.hard_prompt)
    return model, tokenizer


def _vs_llamacpp(measured: list[dict], baseline: list[dict], gguf_name: str) -> None:
    """Each measured row's tok/s over llama.cpp's faster setting at its context (``vs_llama_cpp``; llama-bench
    measures flash attention on and off), and its prefill's (``prefill_vs_llama_cpp``), printed."""
    fastest: dict[int, dict] = {}
    quickest: dict[int, float] = {}  # the faster setting's prompt tok/s at each context
    for row in baseline:
        context = row["context"]
        if context not in fastest or row["tokens_per_s"] > fastest[context]["tokens_per_s"]:
            fastest[context] = row
        if row.get("prefill_tokens_per_s"):
            quickest[context] = max(quickest.get(context, 0.0), row["prefill_tokens_per_s"])
    ratios, prompts = [], []
    for row in measured:
        base = fastest.get(row["context"])
        if not row.get("tokens_per_s") or row["batch"] != 1 or base is None:
            continue
        row["vs_llama_cpp"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["llama_cpp_flash_attn"] = base.get("flash_attn")
        ratios.append(f"{row['policy']} {row['context']:,} {row['vs_llama_cpp']:.2f}x")
        if row.get("prefill_tokens_per_s") and row["context"] in quickest:
            row["prefill_vs_llama_cpp"] = row["prefill_tokens_per_s"] / quickest[row["context"]]
            prompts.append(f"{row['policy']} {row['context']:,} {row['prefill_vs_llama_cpp']:.2f}x")
    settings = "; ".join(f"{c:,}: flash attention {'on' if r.get('flash_attn') else 'off'}"
                         for c, r in sorted(fastest.items()) if r.get("flash_attn") is not None)
    print(f"tok/s of {measured[0]['model'] if measured else ''} over llama.cpp's ({gguf_name}, batch 1"
          + (f"; its faster setting at {settings}" if settings else "") + "): " + "; ".join(ratios))
    if prompts:
        print("prefill tok/s over llama.cpp's faster setting: " + "; ".join(prompts))


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
                 batches, text_ids=None, baseline=None) -> tuple[list[dict], dict]:
    """Measure one model (or one contextual variant of it), and ``baseline`` (llama.cpp) beside it: print its table,
    ratios and goals."""
    from sparsegen.bench import decode, report
    from sparsegen.engine.step import compile_mode

    compiled = compile_mode(model, args.compile)
    setup = decode.Setup(
        model=model, model_name=label, random_weights=random_weights, new_tokens=args.new_tokens,
        warmup=args.warmup, chunk_size=args.chunk_size, prefill=args.prefill,
        recompute_tokens=args.recompute_tokens,
        memory_limit=parse_bytes(args.memory_limit) if args.memory_limit else None,
        bandwidth=bandwidth, compiled=compiled, seed=args.seed, repeats=args.repeats, text_ids=text_ids,
        kv_bits=kv_quantization(args),
    )
    env = setup.environment()
    extensions = f" [{' '.join(env['vector_extensions'])}]" if env["vector_extensions"] else ""
    held = "as computed" if env["kv_bits"] is None else f"in {env['kv_bits']} bits"  # (the evicting rows')
    print(f"{env['model']}{' (random weights)' if env['random_weights'] else ''}: {env['dtype']} on "
          f"{env['machine']}{extensions}; copy bandwidth {env['bandwidth_gb_s']} GB/s; prefill {env['prefill']}; "
          f"K/V {held}; "
          f"{'torch.compile' if compiled else 'eager'}; {args.new_tokens} timed decode steps after "
          f"{args.warmup}{f', {args.repeats} times over' if args.repeats > 1 else ''}")
    print(report.header())
    measured = decode.run(setup, policies, contexts, batches,
                          on_row=lambda row: print(report.format_row(row), flush=True), baseline=baseline)
    ours = [row for row in measured if row["policy"] != "llama.cpp"]
    names = [name for name, _ in policies]
    for reference in ("full", "dense", "recompute"):
        if reference in names:
            ratios = report.speedups(ours, reference)
            if ratios:
                print(f"speed-up over {reference} (its ms/token over the policy's): " + "; ".join(
                    f"{p} {c:,}x{b} {x:.1f}x" for p, c, b, x in ratios))
    for line in report.goals(ours):
        print("goal: " + line)
    if baseline is not None:
        _vs_llamacpp(ours, [row for row in measured if row["policy"] == "llama.cpp"], baseline.gguf.name)
    return measured, env


def add_parsers(sub) -> None:
    p = sub.add_parser("bench", help="decode latency, throughput and memory per KV policy vs context, with roofline")
    model_args(p, more="; or random:PRESET; several, comma-separated, are measured in turn and compared")
    weights_arg(p, several=True)
    p.add_argument("--policies", default="full,window,streaming,h2o,streaming-h2o,recompute",
                   help="comma-separated; besides the KV policies: dense (transformers' DynamicCache) and recompute "
                        "(re-encode the last --budget tokens for every token); POLICY+kvBITS holds that row's K/V in "
                        "BITS bits (16: float16, as llama.cpp; 8, 4, 2: codes), e.g. full,full+kv16")
    p.add_argument("--contexts", default="1024,4096,16384,32768", help="context lengths before decoding")
    budget_args(p, "KV tokens per layer for every policy but full/dense (recompute: its window)")
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
                   help="measure every policy (and --baseline) N times, interleaved, pooling the steps (steadier "
                        "ratios; default 1)")
    p.add_argument("--memory-limit", default=None, help="e.g. 80GiB: report the largest batch whose weights + KV fit")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--contextual", default=None, metavar="DIR[,DIR]",
                   help="also measure with these contextual plans (`sparsegen contextual fit`); 'none' is the model "
                        "without, e.g. none,ctx/teal50: each variant's speed-up over the first is printed")
    prompt_args(p)
    compile_arg(p, help="time the decode step through torch.compile (MODE regional: a block of decoder layers "
                        "compiled once for every block, the default on a CPU; whole: the step one graph, the default "
                        "on CUDA, with CUDA graphs); compiled once per row's shape, the compile kept out of the timed "
                        "steps and reported as compile_seconds (default: compiled where the weights are low-bit, as a "
                        "GGUF model's are by default, or on CUDA; --no-compile: eager)")
    p.add_argument("--baseline", choices=["llama.cpp"], default=None,
                   help="also time llama.cpp on the model's own GGUF (same contexts, threads and steps, batch 1), "
                        "after the policies at each context and in each --repeats turn, and print each row's tok/s "
                        "over llama.cpp's faster flash-attention setting; needs `make llama-tools` (llama-bench, a "
                        "one-time "
                        "source build) or the binding (`make llamacpp`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write one row per measurement (with the environment) to this file")
    p.add_argument("--plot", default=None, help="write ms/token and peak memory vs context as a PNG")
    p.add_argument("--markdown", action="store_true", help="also print the rows as a Markdown table")
    speculative_args(p, with_policy=False, with_draft_model=False)
    p.set_defaults(func=cmd_bench)
