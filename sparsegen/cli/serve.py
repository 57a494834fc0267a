"""Conversations: a terminal chat and the OpenAI-compatible server, on one engine."""

from __future__ import annotations

import argparse
import json
import sys

from sparsegen.cli.common import (
    check_draft_model,
    compile_arg,
    conversation_args,
    load_draft_model,
    load_model,
    model_args,
    parse_bytes,
    policy_spec,
    positive_int,
)


def _engine(args: argparse.Namespace, model, tokenizer):
    from sparsegen.engine import Engine

    speculation = None
    if getattr(args, "speculative", None) is not None:
        from sparsegen.engine.speculative import Speculation, draft_length, draft_policy

        draft_tokens, draft_model = draft_length(args.draft_tokens), load_draft_model(args, tokenizer)

        def speculation():
            return Speculation(draft_policy(args.speculative), draft_tokens, model=draft_model)
    check_draft_model(args)
    return Engine(model, tokenizer, policy_spec(args), chunk_size=args.chunk_size,
                  max_sessions=getattr(args, "max_sessions", 1), max_batch=getattr(args, "max_batch", 1),
                  speculation=speculation, compile=args.compile,
                  kv_memory=parse_bytes(args.kv_memory) if getattr(args, "kv_memory", None) else None,
                  max_context=getattr(args, "max_context", None), idle_grace=getattr(args, "idle_grace", 2.0),
                  prefill_budget=getattr(args, "prefill_budget", None), contexts=_contexts(args, model),
                  packed_prefill=getattr(args, "prefill_mode", "packed") == "packed", store=_store(args))


def _store(args: argparse.Namespace):
    """``--session-store DIR``: every session's cache snapshotted after each turn, for another replica."""
    if getattr(args, "session_store", None) is None:
        return None
    from sparsegen.engine.store import SessionStore

    return SessionStore(args.session_store, parse_bytes(args.session_store_size))


def _contexts(args: argparse.Namespace, model) -> dict:
    """``--context NAME=FILE`` (repeated): compressed contexts by the name requests give, checked whole against
    ``model`` (None: the files alone, before a model is loaded)."""
    from sparsegen.engine.context import CompressedContext

    contexts = {}
    for spec in getattr(args, "context", None) or []:
        name, _, path = spec.partition("=")
        if not name or not path or name in contexts:
            raise ValueError(f"--context takes NAME=FILE.safetensors, each name once, got {spec!r}")
        contexts[name] = CompressedContext.load(path, model)
    return contexts


def _sampling(args: argparse.Namespace):
    from sparsegen.engine import Sampling

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
            json.dump({"model": args.model, "policy": engine.policy.build().describe(), "turns": turns}, f, indent=2)
    if args.plot:
        from sparsegen.eval.plots import plot_turns

        plot_turns({f"{args.policy}": turns}, args.plot, title=f"{args.model}: {len(turns)} chat turns")


def _limits(args: argparse.Namespace):
    """The server's limits and API keys from its flags, checked before any model loads."""
    import os

    from sparsegen.serve.schemas import Limits

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
                    max_request_bytes=args.max_request_bytes, max_inspections=args.max_inspections,
                    header_timeout=args.header_timeout, body_timeout=args.body_timeout, api_keys=tuple(keys))
    if args.shutdown_grace < 0:
        raise ValueError(f"--shutdown-grace is a number of seconds >= 0, got {args.shutdown_grace}")
    if args.kv_memory is None and args.idle_grace != 2.0:
        raise ValueError("--idle-grace is how long an idle session is safe under --kv-memory: give --kv-memory too")
    defaults = _sampling(args)  # before loading: a bad flag fails at once
    _contexts(args, None)  # (and a damaged --context file: checked again against the model once it is loaded)
    if defaults.max_tokens > limits.max_tokens:
        raise ValueError(f"--max-new-tokens {defaults.max_tokens} is over --max-tokens-limit {limits.max_tokens}")
    return limits, defaults


def server_app(args: argparse.Namespace, quiet: bool = False):
    """The app ``sparsegen serve`` runs for its flags (loaded, warmed up before it answers), as a Ray Serve replica
    builds it too; ``quiet``: without the start-up lines."""
    import time

    from sparsegen.models.anatomy import context_length
    from sparsegen.serve.server import build_app
    from sparsegen.serve.worker import kv_bound

    limits, defaults = _limits(args)
    say = (lambda text: None) if quiet else (lambda text: print(text, flush=True))
    model, tokenizer = load_model(args)
    engine = _engine(args, model, tokenizer)
    if engine.decode.compiled:  # (before /health answers: no request waits on a compile)
        from sparsegen.engine.warmup import warm_up
        from sparsegen.models.anatomy import weights_of

        started = time.perf_counter()
        warm = warm_up(engine, rows=min(3, args.max_batch))
        say(f"sparsegen serve: decode step ready in {time.perf_counter() - started:.1f} s ({warm['compiles']} "
            f"compiles, {warm['seconds']:.1f} s; {weights_of(model)} weights)")
    app = build_app(engine, limits, args.model, defaults)
    bound = kv_bound(engine, limits)
    policy = engine.policy.build().describe()
    memory = engine.memory
    held = (f"K/V memory capped at {bound / 2**20:,.1f} MiB: {memory.most_live} live sessions of "
            f"{memory.per_session / 2**20:,.1f} MiB each" if memory is not None else
            f"worst-case KV memory {bound / 2**20:.1f} MiB ({limits.max_sessions} sessions + {limits.max_batch} in "
            f"flight, each at most budget + {args.chunk_size} tokens)")
    share = f" ({args.budget:g} of {engine.max_context or context_length(model):,} tokens)" \
        if isinstance(args.budget, float) else ""
    say(f"sparsegen serve: {args.model}, {policy['policy']} budget {policy['budget']}{share}; {held}; "
        f"http://{args.host}:{args.port}/v1" + (f" ({len(limits.api_keys)} API keys)" if limits.api_keys
                                                else " (no API key)"))
    if not quiet:
        _warn_if_open(args, limits)
    return app


def _warn_if_open(args: argparse.Namespace, limits) -> None:
    if args.host not in ("127.0.0.1", "localhost", "::1") and not limits.api_keys:
        print("warning: listening beyond this machine with no --api-key", file=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> None:
    from sparsegen.serve.server import run_server

    if args.ray is None and args.replicas != 1:
        raise ValueError("--replicas runs several engines on Ray Serve: give --ray [ADDRESS] too")
    if args.ray is not None:
        _serve_on_ray(args)
        return
    status = run_server(server_app(args), args.host, args.port, args.log_level, args.shutdown_grace)
    if status:
        sys.exit(status)


def _serve_on_ray(args: argparse.Namespace) -> None:
    """``--ray [ADDRESS]``: ``--replicas`` engines on a Ray cluster (a local one without an address) behind Ray
    Serve's HTTP proxy on ``--host``/``--port``, until Ctrl-C."""
    import time

    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("serve --ray needs Ray Serve: pip install 'sparsegen[ray]'") from None
    limits, _ = _limits(args)  # (bad flags fail here, before the cluster starts)
    _warn_if_open(args, limits)
    application = _application(args, limits)
    ray.init(address=args.ray or None, logging_level="warning")
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(application, name="sparsegen", route_prefix="/")
    budget = "" if not policy_spec(args).bounded else f" budget {args.budget:g}" + (
        "" if not isinstance(args.budget, float) else f" of {args.max_context:,} tokens" if args.max_context
        else " of the model's context length")
    print(f"sparsegen serve: {args.replicas} replicas of {args.model} ({args.policy}{budget}) on Ray Serve, "
          f"http://{args.host}:{args.port}/v1 "
          f"(each turn of a session to the replica holding its cache: send X-Session-Id)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()


def _application(args: argparse.Namespace, limits):
    from sparsegen.serve.replicas import deployment

    return deployment(server_app, args, True, replicas=args.replicas,
                      max_ongoing_requests=4 * (limits.max_batch + limits.max_queue))


def ray_app(config: dict):
    """What a Ray Serve config file names, to run sparsegen under ``serve run``/``serve deploy`` and Ray Serve's
    own autoscaling: ``import_path: sparsegen.cli.serve:ray_app`` with ``args: {flags: "--model smollm2 --policy h2o
    --budget 1024 --replicas 2 --session-store /shared/sessions"}`` (``sparsegen serve``'s flags)."""
    import shlex

    from sparsegen.cli import build_parser

    flags = config.get("flags", "") if isinstance(config, dict) else None
    if not isinstance(flags, str) or set(config) - {"flags"}:
        raise ValueError("a Ray Serve config gives sparsegen its flags as one string: args: {flags: \"--model ...\"}")
    args = build_parser().parse_args(["serve", *shlex.split(flags)])
    return _application(args, _limits(args)[0])


def cmd_export_window(args: argparse.Namespace) -> None:
    from sparsegen.models.windowed import windowed_checkpoint

    out = windowed_checkpoint(args.model, args.window, args.out, args.max_context, overwrite=args.force)
    print(f"{args.model} with every layer a {args.window}-token sliding window written to {out}; serve it with "
          f"`vllm serve {out}`{f' --max-model-len {args.max_context}' if args.max_context else ''} (vLLM frees the "
          f"blocks outside the window; sparsegen's --policy window --budget {args.window - 1} on the source model "
          f"keeps the same tokens)")


def _prefill_budget(text: str) -> int | str:
    """``--prefill-budget``: a number of tokens, or ``auto``."""
    return text if text == "auto" else positive_int(text)


def add_parsers(sub) -> None:
    p = sub.add_parser("chat", help="a terminal conversation in one bounded cache (history never re-encoded)")
    model_args(p, run=True)
    compile_arg(p)
    conversation_args(p)
    p.add_argument("--system", default=None, help="a system message at the start of the conversation")
    p.add_argument("--script", default=None, help="read the user's turns from this file, one per line (no terminal)")
    p.add_argument("--json", default=None, help="write per-turn statistics (latency, KV held, memory) to this file")
    p.add_argument("--plot", default=None, help="write per-turn latency and memory as a PNG")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server whose sessions live in bounded caches")
    model_args(p, run=True)
    compile_arg(p)
    conversation_args(p, speculative=False)  # (serve keeps caches bounded; speculation verifies with full)
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
    p.add_argument("--prefill-budget", type=_prefill_budget, default=None, metavar="TOKENS|auto",
                   help="prompt tokens one engine step encodes while other replies decode (default: --chunk-size): "
                        "what a long prompt adds to their inter-token latency, at the cost of its own time to first "
                        "token; 'auto': as many as cost one decode step, measured as it serves (the others' "
                        "inter-token latency at most about doubles, but prompts start far later: docs/serving.md)")
    p.add_argument("--prefill-mode", choices=["packed", "separate"], default="packed",
                   help="packed (default): a prompt's chunk rides in the others' decode step, one forward for both "
                        "(a chunk then adds only its own work to their step); separate: a forward of its own "
                        "before the step, as before (docs/serving.md compares them)")
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
    p.add_argument("--max-inspections", type=positive_int, default=2,
                   help="/v1/inspect calls running or waiting at once; more get 429 (default 2: each runs the model "
                        "over its whole text once per policy)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a client must send a request's headers within this many seconds of starting them (default "
                        "10); slower connections get 408 and are closed")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a client must send a request's whole body within this many seconds (default 30; 408 past it)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, replies in flight get this long to finish before each ends with a 503 "
                        "(streams: an error event, then [DONE]); queued requests get 503 at once; then exit 0 "
                        "(default 30)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    ray = p.add_argument_group("several replicas on Ray Serve (docs/serving.md)")
    ray.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                     help="serve on a Ray cluster (its address, e.g. ray://head:10001; none: a local one): "
                          "--replicas engines behind Ray Serve's HTTP proxy, each session's turns on the replica "
                          "holding its cache")
    ray.add_argument("--replicas", type=positive_int, default=1, help="engines under --ray (default 1)")
    ray.add_argument("--session-store", default=None, metavar="DIR",
                     help="snapshot each session's cache here after every turn (a folder every replica reads: a "
                          "shared disk on a cluster), so that a session whose replica is gone continues on another "
                          "from the same cache instead of re-encoding its history")
    ray.add_argument("--session-store-size", default="4GiB", metavar="SIZE",
                     help="the most bytes of snapshots kept, least recently written dropped first (default 4GiB)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("export-window", help="write a checkpoint whose layers are all sliding windows, for vLLM to "
                                             "serve in bounded KV memory (StreamingLLM's window, without sinks)")
    p.add_argument("--model", required=True, help="a Llama/Mistral/Qwen checkpoint folder or a packaged model")
    p.add_argument("--window", type=positive_int, required=True,
                   help="tokens each query attends to, itself included")
    p.add_argument("--max-context", type=positive_int, default=None, metavar="TOKENS",
                   help="raise the positions the engine may serve to this (e.g. 32768; RoPE as trained)")
    p.add_argument("--out", required=True, help="the new checkpoint's folder")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_export_window)
