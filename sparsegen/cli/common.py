"""What every command shares: model, policy and calibration options, loading, small argument types."""

from __future__ import annotations

import argparse

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


def model_args(p: argparse.ArgumentParser, positional: bool = False, more: str = "", run: bool = False) -> None:
    if positional:
        p.add_argument("model", help="hub id, local checkpoint folder, or 'reference'")
    else:
        p.add_argument("--model", default="reference",
                       help=f"hub id, local checkpoint folder, or 'reference' (default){more}")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--dtype", default=None, help="auto, float32, float16, bfloat16 (default: float32 on CPU, the "
                                                 "checkpoint's on GPU)")
    if run:
        weights_arg(p)
        p.add_argument("--contextual", default=None, metavar="DIR",
                       help="run with the contextual sparsity fit into DIR by `sparsegen contextual fit`")
        prompt_args(p)


def compile_arg(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--compile [regional|whole]`` and ``--no-compile``: ``args.compile`` None (the default), True, False or a
    mode (``DecodeStep``'s ``compile``)."""
    from sparsegen.engine.step import COMPILE_MODES

    p.add_argument("--compile", nargs="?", const=True, default=None, choices=COMPILE_MODES, metavar="MODE",
                   help=help or "run the decode step through torch.compile in fixed shapes (each layer's budget of "
                        "slots, or a full cache's allocation); the first step of a shape compiles, kept in "
                        "sparsegen's cache folder for the next run. MODE: regional (a block of decoder layers "
                        "compiled once for every block: seconds to compile; the default on a CPU) or whole (the "
                        "whole step one graph: a faster step, minutes to compile; the default on CUDA). Default: "
                        "compiled where the weights are low-bit, as a GGUF model's are by default, or on CUDA")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="run the decode step eagerly (debugging; the slow path)")


def weights_arg(p: argparse.ArgumentParser, several: bool = False) -> None:
    kinds = "auto|fp32|int8|int4|w8a8|w4a8|w5a8|gguf"
    p.add_argument("--weights", default="auto", metavar=kinds + ("[,...]" if several else ""),
                   help="store the decoder's linears and LM head in 8 or 4 bits for PyTorch's CPU weight-only kernels "
                        "(a quarter / an eighth of the fp32 bytes a token reads; round to nearest); w8a8: int8 weights "
                        "times inputs quantized to 7 bits, each token at its own scale, turned by a Hadamard rotation "
                        "(FBGEMM's integer kernels: the fastest on an x86 CPU without native bfloat16, e.g. AVX2; "
                        "SmolLM2 +1.0%% perplexity, Gemma-3-270M +1.3%%; docs/benchmarks-log.md); w4a8: "
                        "llama.cpp's Q4_1 "
                        "blocks of 32 weights times inputs quantized to 8 bits a block, in sparsegen's AVX2 kernel "
                        "(5 bits a weight read; the LM head at w8a8); w5a8: the same with llama.cpp's Q5_0 blocks (6 "
                        "bits read); gguf: each linear at the bit width its GGUF file has, in those integer kernels "
                        "(4-bit types as w4a8, Q5_0 as w5a8, the others as w8a8); every kind keeps the embedding "
                        "table in llama.cpp's 8-bit Q8_0 blocks (exact for a Q8_0 GGUF's table)"
                        + ("; several, comma-separated, are measured in turn and compared" if several else "")
                        + " (default auto: a GGUF model (smollm2, gemma3-270m, a .gguf file) on a CPU as gguf, "
                          "anything else as loaded: fp32)")


def prompt_args(p: argparse.ArgumentParser) -> None:
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--soft-prompt", default=None, metavar="FILE",
                        help="put the soft prompt trained by `sparsegen prompt-tune` before every sequence (its tokens "
                             "are never evicted)")
    prompt.add_argument("--hard-prompt", default=None, metavar="TEXT",
                        help="put this text before every sequence, pinned in the cache like a soft prompt")


def budget_arg(text: str) -> int | float:
    """An argparse type: a KV budget (tokens, or a fraction of the input)."""
    from sparsegen.kv.policies import parse_budget

    try:
        return parse_budget(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def budget_args(p: argparse.ArgumentParser, budget_help: str) -> None:
    p.add_argument("--budget", type=budget_arg, default=None, help=budget_help)
    p.add_argument("--sinks", type=int, default=None, help="first tokens always kept (streaming: 4)")
    p.add_argument("--recent", type=int, default=None, help="most recent tokens always kept (h2o: half the budget)")
    p.add_argument("--heavy", type=int, default=None, help="heavy-hitter tokens kept (h2o: half the budget)")
    p.add_argument("--history", type=int, default=None,
                   help="scissorhands: count only the latest this many queries' votes (default: all)")
    p.add_argument("--scorer", default=None, metavar="FILE.safetensors",
                   help="kvzap, kvzap-global: the learned KV scorer `sparsegen fit-scorer` wrote for this model")
    p.add_argument("--positions", choices=["original", "rolling"], default=None,
                   help="RoPE positions of cached keys (default: rolling for streaming*, original otherwise)")
    p.add_argument("--kv-bits", type=int, choices=[32, 16, 8, 4, 2], default=None,
                   help="hold the cached keys and values in this many bits, under any policy: 32 as the model computes "
                        "them, 16 as float16 numbers (llama.cpp's default cache type), 8/4/2 as codes (KIVI-style: "
                        "keys per channel, values per token) (default: 16 where the weights run in the integer "
                        "kernels on a CPU, as a GGUF model's do by default; else as the model computes them)")
    p.add_argument("--kv-residual", type=int, default=32,
                   help="with --kv-bits: the newest tokens also kept in full precision (default 32)")


def kv_quantization(args: argparse.Namespace):
    """``--kv-bits``/``--kv-residual`` as a ``KVQuantization``, ``AS_COMPUTED`` (32), or None (the model's default)."""
    from sparsegen.kv import KVQuantization
    from sparsegen.kv.quantized import AS_COMPUTED

    if args.kv_bits in (None, AS_COMPUTED):
        return args.kv_bits
    return KVQuantization(args.kv_bits, args.kv_residual)


def policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="full", help=f"{', '.join(POLICIES)} (default full)")
    budget_args(p, "KV tokens kept per layer, or a fraction of the input length (0.2)")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk, tokens (default 512)")


def speculative_args(p: argparse.ArgumentParser, with_policy: bool = True, with_draft_model: bool = True) -> None:
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


def check_draft_model(args: argparse.Namespace) -> None:
    """``--draft-model`` only drafts for ``--speculative``: refuse it alone (before any model loads)."""
    if getattr(args, "draft_model", None) is not None and getattr(args, "speculative", None) is None:
        raise ValueError("--draft-model drafts for --speculative: give --speculative too, e.g. streaming:512")


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


def calibration_args(p: argparse.ArgumentParser, who: str = "") -> None:
    """Layer-by-layer calibration (prune, quantize): which text, how many windows, how long, how many per forward."""
    p.add_argument("--calib", default=None, help=f"{who}calibration text file or folder (default "
                                                 f"../shared/data/books/train)")
    p.add_argument("--nsamples", type=int, default=128, help="calibration sequences (default 128)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="calibration sequences per forward (default 8)")


def conversation_args(p: argparse.ArgumentParser, speculative: bool = True) -> None:
    if speculative:
        speculative_args(p)
    p.add_argument("--policy", default="streaming", help=f"{', '.join(POLICIES)} (default streaming)")
    budget_args(p, "KV tokens kept per conversation, or a share of the longest one (0.2: of --max-context, by "
                   "default the model's context length; every session gets the same budget) (default 1024)")
    p.set_defaults(budget="1024")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk, tokens (default 512)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per reply at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def policy_spec(args: argparse.Namespace, name: str | None = None, several: bool = False):
    """The cache settings the command's flags give, for ``--policy`` or ``name`` (one of ``several`` a command runs
    at its one ``--budget``: each takes only the splits that apply to it)."""
    from sparsegen.kv import PolicySpec
    from sparsegen.kv.policies import policy_class
    from sparsegen.kv.policy import policy_options

    name = name or args.policy
    takes = policy_options(policy_class(name))
    splits = {k: getattr(args, k, None) for k in ("sinks", "recent", "heavy", "history", "scorer")
              if not several or k in takes}
    return PolicySpec.sharing(name, args.budget, positions=getattr(args, "positions", None),
                              kv_bits=kv_quantization(args) if hasattr(args, "kv_bits") else None, **splits)


def policy_specs(args: argparse.Namespace, besides: tuple[str, ...] = ()) -> dict:
    """Name -> ``policy_spec`` for each ``--policy`` (default full); a name in ``besides`` (ppl's ``recompute``) is no
    policy but its command's own row: None."""
    names = args.policy or ["full"]
    return {name: None if name in besides else policy_spec(args, name, several=len(names) > 1) for name in names}


def load_model(args: argparse.Namespace):
    """``sparsegen.load`` with the command's options; a command without ``--weights`` (prune, quantize, prompt-tune,
    contextual fit...) changes or calibrates the float weights, so it loads them as they are (fp32)."""
    from sparsegen.assemble import load

    return load(args.model, device=args.device, dtype=args.dtype, weights=getattr(args, "weights", "fp32"),
                contextual=getattr(args, "contextual", None), soft_prompt=getattr(args, "soft_prompt", None),
                hard_prompt=getattr(args, "hard_prompt", None))


def read_prompt(args: argparse.Namespace) -> str:
    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of --prompt and --prompt-file")
    if args.prompt is not None:
        return args.prompt
    with open(args.prompt_file, encoding="utf-8", errors="replace") as f:
        return f.read()


def parse_bytes(text: str) -> int:
    """``24GiB``, ``80GB``, ``512MiB`` or a plain number of bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    lowered = text.strip().lower()
    for unit, scale in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * scale)
    if not lowered.rstrip("b").isdigit():
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 24GiB, 80GB or 512MiB")
    return int(lowered.rstrip("b"))


def int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} takes comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{what} takes positive whole numbers, got {text!r}")
    return values


def calibration_tokens(args: argparse.Namespace, tokenizer, books: str):
    """``(ids, source)``: ``--nsamples`` windows of ``--seqlen`` tokens from ``--calib`` (default books/BOOKS)."""
    from sparsegen.data import data_dir, leading_bos, tokenize_files
    from sparsegen.models.calibration import calibration_ids

    source = args.calib or data_dir() / "books" / books
    ids = calibration_ids(tokenize_files(source, tokenizer), args.nsamples, args.seqlen, args.seed,
                          leading_bos(tokenizer))
    return ids, source


class Parser(argparse.ArgumentParser):
    """A usage mistake is one line (and the way to the help), like every other error a user can cause."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
