"""Commands that change weights: prune, quantize, and a soft prompt that wins quality back."""

from __future__ import annotations

import argparse
from pathlib import Path

from sparsegen.cli.common import calibration_args, calibration_tokens, load_model, model_args


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
        ids, calib = calibration_tokens(args, tokenizer, "train")
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


def cmd_quantize(args: argparse.Namespace) -> None:

    from sparsegen.models.loading import resolve
    from sparsegen.models.synthetic import is_random, random_model
    from sparsegen.output import check_output
    from sparsegen.pruning import save_pruned
    from sparsegen.quant import QuantizeConfig, quantize_model

    config = QuantizeConfig(bits=args.bits, group_size=args.group_size, method=args.method, nsamples=args.nsamples,
                            seqlen=args.seqlen, seed=args.seed, batch_size=args.batch_size, format=args.format)
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
    ids, calib = calibration_tokens(args, tokenizer, "train") if config.method == "gptq" else (None, None)
    loaded = model.dtype
    report = {"model": args.model, "calibration": str(calib) if calib else None, **quantize_model(model, config, ids)}
    save_pruned(model, tokenizer, out, report, "quantization.json", overwrite=args.force)  # (a pruned source's
    # sparsity.json travels with it)
    before = sum(f.stat().st_size for f in source.glob("*.safetensors")) if source and source.exists() else None
    after = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    linear = report["linear_bytes_before"] / report["linear_bytes_after"]
    group = report["group_size"] or "row"
    chosen = "" if config.group_size is not None else " (W8A8's)" if config.per_row else \
        " (the largest that divides every linear)"
    inputs = ", int8 inputs per token" if config.format == "int-quantized" else ""
    print(f"{config.method} int{config.bits}{inputs}, group {group}{chosen}: {len(report['layers'])} linear layers "
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
    ids, calib = calibration_tokens(args, tokenizer, "train")
    prefix = tune_prompt(model, ids, config, teacher)
    prefix.info.update(model=args.model, teacher=args.teacher, calibration=str(calib))
    prefix.save(out, overwrite=args.force)
    info = prefix.info
    print(f"{args.tokens}-token soft prompt, {args.steps} steps on {len(ids) - config.eval_windows} windows of "
          f"{args.seqlen} tokens ({info['loss']}); held-out loss {info['held_out_loss_without_prompt']:.4f} without "
          f"the prompt -> {info['held_out_loss_with_prompt']:.4f} with it; {info['seconds']} s; saved to {out}")


def add_parsers(sub) -> None:
    p = sub.add_parser("prune", help="prune weights (magnitude, Wanda, SparseGPT; unstructured, N:M or structured)")
    model_args(p)
    p.add_argument("--method", required=True, help="magnitude, wanda, sparsegpt, or one registered by --plugin")
    amount = p.add_mutually_exclusive_group(required=True)
    amount.add_argument("--sparsity", type=float, help="fraction of each layer's weights removed, e.g. 0.5")
    amount.add_argument("--pattern", help="N:M, keep N of every M consecutive inputs, e.g. 2:4")
    amount.add_argument("--structured", help="remove whole MLP neurons / KV head groups: neurons=0.5[,heads=0.25]")
    calibration_args(p)
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--per-row", dest="per_row", action="store_true", default=None,
                      help="compare scores within each output row (Wanda's default)")
    rows.add_argument("--per-layer", dest="per_row", action="store_false",
                      help="compare scores over the whole layer (magnitude's default)")
    p.add_argument("--out", required=True, help="folder for the pruned checkpoint (+ sparsity.json)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("quantize", help="weight-only quantization (GPTQ or round-to-nearest, 4/8 bits), also of "
                                        "pruned checkpoints (their zeros stay zero)")
    model_args(p)
    p.add_argument("--bits", type=int, default=4, help="4 or 8 (default 4)")
    p.add_argument("--group-size", type=int, default=None,
                   help="input columns per scale; 0 = one per row (default: the largest of 128, 64, 32, 16 that "
                        "divides "
                        "every linear: 64 on SmolLM2)")
    p.add_argument("--method", default="gptq", help="gptq (calibrated, default) or rtn (round to nearest)")
    p.add_argument("--format", default="pack-quantized", choices=("pack-quantized", "int-quantized"),
                   help="compressed-tensors layout: pack-quantized (W4A16/W8A16, weight-only; default) or "
                        "int-quantized (W4A8/W8A8: inputs rounded to int8 per token at run time; the 4-bit scheme "
                        "vLLM's CPU build runs on AVX2 CPUs, whose wheel has no kernel for W4A16)")
    calibration_args(p, "gptq ")
    p.add_argument("--out", required=True, help="folder for the quantized checkpoint (+ quantization.json)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("prompt-tune", help="learn a soft prompt that restores a compressed model's quality "
                                           "(Compress, Then Prompt); use it with --soft-prompt FILE")
    model_args(p)
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
