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


# the flags of `contextual fit` that are a method's own options (``ContextualMethod.options``); None: not given
FIT_OPTIONS = ("sparsity", "top_k", "recall", "heads", "targets", "rank", "epochs")


def cmd_contextual_fit(args: argparse.Namespace) -> None:
    from sparsegen.contextual.runtime import contextual_method
    from sparsegen.models.loading import resolve
    from sparsegen.models.synthetic import is_random, random_model
    from sparsegen.output import check_output

    out = check_output(args.out, None if is_random(args.model) else resolve(args.model), args.force)
    method = contextual_method(args.method)
    given = {k: getattr(args, k) for k in FIT_OPTIONS if getattr(args, k) is not None}
    if extra := [k for k in given if k not in method.options]:
        takes = ", ".join("--" + k.replace("_", "-") for k in method.options) or "none"
        raise ValueError(f"{args.method} takes no --{' --'.join(k.replace('_', '-') for k in extra)} (its options: "
                         f"{takes})")
    args.nsamples = args.nsamples or method.calibration_windows
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
    plan = method.fit(model, ids, batch_size=args.batch_size, seed=args.seed, **given)
    plan.info.update(model=args.model, calibration=str(calib), seconds=round(time.perf_counter() - started, 1))
    plan.save(out, overwrite=args.force)
    for line in method.summary(plan):
        print(line)
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
    p.add_argument("--method", required=True, help="dejavu (low-rank lookahead predictors), teal (thresholds) or a "
                                                   "registered method of your own (--plugin)")
    amount = p.add_mutually_exclusive_group()
    amount.add_argument("--sparsity", type=float, help="fraction of MLP neurons (dejavu) / linear inputs (teal) "
                                                       "skipped")
    amount.add_argument("--top-k", type=int, help="dejavu: MLP neurons kept per token")
    amount.add_argument("--recall", type=float,
                        help="dejavu: per layer, the smallest K whose recall on validation windows reaches this")
    p.add_argument("--heads", type=float, default=None,
                   help="dejavu: fraction of attention heads skipped (default 0: heads are not predicted)")
    p.add_argument("--targets", default=None, choices=["all", "mlp"],
                   help="teal: sparsify the inputs of every decoder linear (default) or of the MLP's only")
    p.add_argument("--rank", type=int, default=None, help="dejavu: predictor rank (default: 5%% of the MLP's cost)")
    p.add_argument("--epochs", type=int, default=None, help="dejavu: training epochs per predictor (default 20)")
    p.add_argument("--calib", default=None, help="calibration text file or folder (default ../shared/data/books/train)")
    p.add_argument("--nsamples", type=int, default=None,
                   help="calibration windows (default: the method's, dejavu 128, teal 32)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder for contextual.json (+ predictors.safetensors)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.set_defaults(func=cmd_contextual_fit)
