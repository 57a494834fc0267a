"""A server under load: concurrent sessions, latency, memory; at a fixed K/V memory (--spawn)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sparsegen.cli.common import parse_bytes, positive_int


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
        held = samples[-1]["kv_bytes"] / 2**20
        print("server RSS after " + ", ".join(f"{s['conversations']}: {s['rss_bytes'] / 2**20:.0f} MiB"
                                              for s in shown) + f" conversations (K/V {held:.1f} MiB held at the end)")
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

    from transformers import AutoTokenizer

    from sparsegen.bench import spawn
    from sparsegen.models.loading import resolve

    if args.model is None or args.kv_memory is None:
        raise ValueError("--spawn needs --model and --kv-memory, e.g. --model smollm2 --kv-memory 384MiB")
    setup = spawn.SpawnSetup(
        model=args.model, policies=[p for p in args.policies.split(",") if p],
        kv_memory=[parse_bytes(size) for size in args.kv_memory.split(",")], context=args.context,
        sessions=args.sessions, turns=args.turns, max_tokens=128 if args.max_tokens is None else args.max_tokens,
        chunk_size=args.chunk_size,
        text=Path(args.text) if args.text else None, threads=args.threads, extra=list(args.serve_arg),
        baseline=args.baseline)
    if args.baseline:
        from sparsegen.bench import llamacpp
        from sparsegen.models.gguf import gguf_file

        llamacpp.server_binary(), gguf_file(args.model)  # missing either fails before any server starts
    for spec in setup.policies:
        spawn.policy_flags(spec, setup.context)  # a bad policy fails before any server starts
    tokenizer = AutoTokenizer.from_pretrained(resolve(args.model))
    work = Path(args.json).with_suffix(".logs") if args.json else Path(".cache") / "bench-serve"
    print(f"{args.model}: {setup.sessions} conversations of {setup.context:,} tokens over {setup.turns} turns "
          f"({setup.max_tokens} tokens per reply) under each K/V cap; server logs in {work}", flush=True)
    done: list[dict] = []

    def save(rows: list[dict]) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"setup": {**vars(setup), "text": str(setup.text) if setup.text else None}, "rows": rows},
                          f, indent=2)

    def finished(row: dict) -> None:  # each policy's row is saved as it ends: a cut-off run keeps the others
        print(f"  {row['policy']} under {row['kv_memory_bytes'] / 2**20:,.0f} MiB: {row['sessions_admitted']} live, "
              f"{row['decode_tokens_per_s']} decode tok/s, {row.get('streamed_tokens_per_s')} streamed tok/s, "
              f"{row['failed']} failed", flush=True)
        done.append(row)
        save(done)

    rows = spawn.run(setup, tokenizer, work, on_row=finished)
    print(spawn.summary(rows))
    save(rows)
    if args.plot:
        spawn.plot(rows, args.plot)
    if any(row["failed"] or row["server_errors"] for row in rows):
        print("bench-serve: FAILED: some requests failed", file=sys.stderr)
        sys.exit(1)


def add_parsers(sub) -> None:
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
                   help="N more clients that hang up mid-stream, time out, send garbage, reuse a session at once, "
                        "send slow bodies or headers, deeply nested bodies, loose types and malformed HTTP, start "
                        "several sessions at once and ask /v1/inspect at tiny budgets meanwhile; exit status 1 if any "
                        "good reply fails or any fault gets a 5xx")
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
    spawn.add_argument("--baseline", choices=["llama.cpp"], default=None,
                       help="also run llama.cpp's server (llama-server, `make llama-server`) on the model's GGUF under "
                            "each cap: as many parallel slots as the cap holds sessions in its own K/V; twice, with "
                            "its prompt cache in RAM off (row llama.cpp: the cap is all it keeps) and on "
                            "(llama.cpp+cache, its default)")
    p.set_defaults(func=cmd_bench_serve)
