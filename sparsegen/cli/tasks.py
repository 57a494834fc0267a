"""The field's long-context tasks: pass-key retrieval, RULER, lm-evaluation-harness."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sparsegen.cli.common import (
    budget_args,
    check_draft_model,
    compile_arg,
    load_draft_model,
    load_model,
    model_args,
    policy_specs,
    speculative_args,
)
from sparsegen.eval.protocols import PROTOCOLS
from sparsegen.kv.quantized import held_kv_description

PROTOCOL_HELP = ("stream: the whole prompt in chunks, evicting as it goes; context: the context in one pass, "
                 "compressed once, then the question, the budget holding throughout; context-once (kvpress's "
                 "exactly): the same, nothing evicted after the context; query-aware: the whole prompt, question "
                 "included, in one pass, compressed once (SnapKV's setting: its scores see the question), the "
                 "budget holding after; query-aware-once (kvpress's compress_questions exactly): the same, nothing "
                 "evicted after the prompt")


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
    results = {}
    for name, policy in policy_specs(args).items():
        results[name] = {**policy.build(max(lengths)).describe(), "budget": policy.budget,
                         **held_kv_description(model, policy.kv_bits),
                         **passkey_accuracy(model, tokenizer, filler, lengths, depths, policy, args.trials, args.seed,
                                            args.chunk_size, chat=chat, protocol=args.protocol)}
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

    from sparsegen.data import data_dir
    from sparsegen.engine.speculative import Speculation, draft_length, draft_policy
    from sparsegen.eval import ruler

    check_draft_model(args)
    if args.speculative is not None:  # a bad --speculative or --draft-tokens fails before the model loads
        draft_tokens = draft_length(args.draft_tokens)
        draft_policy(args.speculative, 1_000)
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
    if any(p not in PROTOCOLS for p in protocols):
        raise ValueError(f"--protocol takes {', '.join(PROTOCOLS)} or several (stream,context), got "
                         f"{args.protocol!r}")
    args.policy = args.policies.split(",")
    lengths = [int(x) for x in args.length.split(",")]
    depths = [float(x) for x in args.depths.split(",")] if args.depths else None

    header = {"model": args.model, "haystack": str(haystack), "chat": chat, "samples_per_task": args.samples,
              "budget_arg": args.budget, "kv_bits": args.kv_bits, "settings": _ruler_settings(args, chat, haystack)}
    done = _resumable_rows(args.json, header["settings"]) if args.resume else []
    rows = list(done)  # what the file holds: what it held, and each row as it is done

    def show(row: dict) -> None:
        rows.append(row)
        if args.json:  # after every row, so an interrupted run loses at most the row it was on
            _write_json(args.json, {**header, "rows": rows})
        draft = row.get("draft")
        drafted = "" if draft is None else (f"; draft {draft['policy']}:{draft['budget']} accepted "
                                            f"{draft['acceptance_rate'] or 0:.0%}, {draft['tokens_per_step'] or 0:.2f} "
                                            "tokens a step")
        print(f"{row['policy']:>14} {row['protocol']:>11} {row['length']:>6} {row['task']:>16}: {row['score']:.3f} "
              f"(K/V peak {row['kv_tokens_peak']:,} tokens; prompts up to {row['prompt_tokens']:,}{drafted})",
              flush=True)

    speculation = None
    if args.speculative is not None:
        draft_model = load_draft_model(args, tokenizer)

        def speculation(context_tokens: int) -> Speculation:
            return Speculation(draft_policy(args.speculative, context_tokens), draft_tokens, args.positions,
                               draft_model)

    if done:
        print(f"resuming {args.json}: {len(done)} rows done", flush=True)
    report = ruler.run(model, tokenizer, Path(haystack).read_text(encoding="utf-8", errors="replace"),
                       policy_specs(args), lengths, tasks, args.samples, tuple(protocols), chat, depths,
                       args.seed, args.chunk_size, args.max_new_tokens,
                       on_row=show, done=done, speculation=speculation, compile=args.compile)
    print()
    print(ruler.markdown(report["rows"]))
    if args.json:  # in table order; rows of the file this run did not ask for stay in it
        _write_json(args.json, {**header, "rows": report["rows"] + [r for r in done if r not in report["rows"]]})
    if args.plot:
        from sparsegen.eval.plots import plot_ruler

        plot_ruler(report["rows"], args.plot)


_RULER_ROW_SELECTORS = {"policies", "protocol", "tasks", "length", "json", "plot", "resume", "func", "command",
                        "policy"}


def _ruler_settings(args: argparse.Namespace, chat: bool, haystack) -> dict:
    """Every argument that changes a row's answers (not which rows run): what a resumed run must share."""
    settings = {k: v for k, v in sorted(vars(args).items())
                if k not in _RULER_ROW_SELECTORS and (v is None or isinstance(v, (str, int, float, bool)))}
    return {**settings, "chat": chat, "haystack": str(haystack)}


def _resumable_rows(path: str | None, settings: dict) -> list[dict]:
    if path is None:
        raise ValueError("--resume continues the run written to --json; give --json OUT")
    if not Path(path).exists():
        return []
    earlier = json.loads(Path(path).read_text())
    if "settings" not in earlier:
        raise ValueError(f"{path} was written by a sparsegen that did not record its settings; it cannot be resumed "
                         "safely: give another --json, or delete it")
    # an option the file does not name did not exist when it was written: that run had its default behaviour
    differ = sorted(k for k in earlier["settings"] if settings.get(k) != earlier["settings"][k])
    if differ:
        shown = ", ".join(f"{k} ({earlier['settings'].get(k)!r} there, {settings.get(k)!r} now)" for k in differ)
        raise ValueError(f"{path} was run with other settings: {shown}; run with the same ones to resume, or give "
                         "another --json")
    return earlier["rows"]


def _write_json(path: str, report: dict) -> None:
    """Through a temporary file, so an interrupted write never leaves a broken report."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


def cmd_lm_eval(args: argparse.Namespace) -> None:
    try:
        from sparsegen.eval import harness
    except ImportError as err:
        raise ValueError(f"sparsegen lm-eval needs lm-eval: pip install 'sparsegen[lmeval]' ({err})") from None
    harness.main(args.lm_eval_args)


def add_parsers(sub) -> None:
    p = sub.add_parser("passkey", help="pass-key retrieval accuracy per context length and needle depth")
    model_args(p, run=True)
    p.add_argument("--text", default=None, help="haystack text (default books/test/great_expectations.txt)")
    p.add_argument("--policy", action="append", default=None, help="policy; repeat for several (default full)")
    budget_args(p, "KV tokens per layer (a token count)")
    p.add_argument("--lengths", default="256,512,1024,2048", help="context lengths, tokens (comma-separated)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths, 0-1 (comma-separated)")
    p.add_argument("--trials", type=int, default=5, help="keys per (length, depth) (default 5)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="stream", help=PROTOCOL_HELP + " (default stream)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="ask in the model's chat template (default: when the model has one)")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--plot", default=None, help="write accuracy heatmaps as a PNG")
    p.set_defaults(func=cmd_passkey)

    p = sub.add_parser("ruler", help="RULER's synthetic long-context tasks (needles, variable tracking, word "
                                     "extraction), generated from a haystack text, per policy and protocol")
    model_args(p, run=True)
    p.add_argument("--haystack", default=None, metavar="FILE",
                   help="text the haystacks and word lists come from (default books/test/great_expectations.txt)")
    p.add_argument("--tasks", default=None, help="comma-separated RULER task names (default: all eleven)")
    p.add_argument("--length", default="4096", help="prompt lengths, tokens (comma-separated; default 4096)")
    p.add_argument("--samples", type=int, default=20, help="prompts per task and length (default 20)")
    p.add_argument("--policies", default="full", help="comma-separated KV policies (default full)")
    budget_args(p, "KV tokens kept per layer, or a fraction of the context (0.5)")
    p.add_argument("--protocol", default="stream",
                   help=PROTOCOL_HELP + "; several comma-separated (default stream)")
    p.add_argument("--depths", default=None, help="needle depths 0-1 the samples cycle through (default "
                                                  "0,.25,.5,.75,1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer tokens (default RULER's per task)")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="ask in the model's chat template (default: when the model has one)")
    compile_arg(p)
    speculative_args(p)
    p.add_argument("--json", default=None, help="write the rows (with every answer) as JSON to this file, after "
                                                "every row")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows the --json file already holds (a run cut short, or fewer policies, protocols, "
                        "tasks or lengths) and run only the others; the other settings must match")
    p.add_argument("--plot", default=None, help="write needle-depth x length heat maps per policy as a PNG")
    p.set_defaults(func=cmd_ruler)

    p = sub.add_parser("lm-eval", help="lm-evaluation-harness with sparsegen's model registered: --model sparsegen "
                                       "--model_args pretrained=M,policy=P,budget=B[,kv_bits=4] --tasks ...",
                       add_help=False)  # (main hands everything after lm-eval to lm-eval)
