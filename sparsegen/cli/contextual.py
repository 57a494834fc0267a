"""Contextual sparsity: statistics, and fitting Deja Vu predictors or TEAL thresholds."""

from __future__ import annotations

import argparse
import json
import time

from sparsegen.cli.common import calibration_tokens, load_model, model_args


def cmd_contextual_stats(args: argparse.Namespace) -> None:
    from sparsegen.contextual.stats import contextual_statistics

    model, tokenizer = load_model(args)
    ids, calib = calibration_tokens(args, tokenizer, "test")
    stats = {"model": args.model, "text": str(calib), **contextual_statistics(model, ids, args.mass)}
    print(f"{stats['tokens']:,} tokens from {calib}; sparsity = fraction a token can drop keeping {args.mass:.0%} "
          f"of the mass")
    print(f"{'layer':>5}{'MLP zeros':>11}{'MLP sparsity':>14}{'head sparsity':>15}{'cos(h, h_next)':>16}")
    for layer in stats["layers"]:
        heads, cosine = layer["head_sparsity"], layer["residual_cosine"]
        heads, cosine = ("-" if x is None else format(x, ".3f") for x in (heads, cosine))
        print(f"{layer['layer']:>5}{layer['mlp_zero_fraction']:>11.3f}{layer['mlp_sparsity']:>14.3f}"
              f"{heads:>15}{cosine:>16}")
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
        ids, calib = calibration_tokens(args, tokenizer, "train")
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
        print(f"teal ({args.targets}): {len(achieved)} linear inputs, target sparsity {args.sparsity}, achieved on "
              f"calibration "
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


def add_parsers(sub) -> None:
    p = sub.add_parser("contextual", help="contextual sparsity: statistics, and fitting Deja Vu predictors or TEAL "
                                          "thresholds (run them with --contextual DIR)")
    contextual = p.add_subparsers(dest="contextual_command", required=True, metavar="STEP")
    p = contextual.add_parser("stats", help="per-layer MLP/head sparsity per input and residual-stream similarity")
    model_args(p)
    p.add_argument("--calib", default=None, help="text file or folder (default ../shared/data/books/test)")
    p.add_argument("--nsamples", type=int, default=32, help="text windows (default 32)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mass", type=float, default=0.95, help="fraction of activation mass the kept units carry")
    p.add_argument("--json", default=None, help="write the statistics to this file")
    p.set_defaults(func=cmd_contextual_stats)
    p = contextual.add_parser("fit", help="fit Deja Vu predictors or TEAL thresholds; use with --contextual DIR")
    model_args(p)
    p.add_argument("--method", required=True, help="dejavu (low-rank lookahead predictors) or teal (thresholds)")
    amount = p.add_mutually_exclusive_group(required=True)
    amount.add_argument("--sparsity", type=float, help="fraction of MLP neurons (dejavu) / linear inputs (teal) "
                                                       "skipped")
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
