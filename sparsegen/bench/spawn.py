"""Serving at fixed memory (``sparsegen bench-serve --spawn``): for each policy and K/V cap, start ``sparsegen serve
--kv-memory CAP`` as its own process, hold ``sessions`` long conversations against it at once (each opens with its own
excerpt of a book, ``context`` tokens in all over ``turns`` turns), and report what a user of that server gets:
sessions live at once (every reply ``max_tokens`` long: ``ignore_eos``, as serving benchmarks fix output lengths),
aggregate decode tokens/s (decode tokens over the seconds the engine spent decoding: the batch
throughput the cap allows, H2O's serving measure) and end-to-end tokens/s (over the whole run, prefill included),
time to first token and inter-token latency percentiles, failed requests, peak K/V bytes and the server's peak RSS.
``baseline="llama.cpp"`` adds a row for llama.cpp's own server (``llama-server``, continuous batching over parallel
slots) on the model's GGUF under the same cap: as many slots as the cap holds sessions of ``context`` tokens in
llama.cpp's own K/V (f16), measured by the same clients; once with its prompt cache in RAM off (``llama.cpp``: the cap
is all it keeps) and once with its default prompt cache (``llama.cpp+cache``: a conversation whose slot went to another
keeps its prompt in RAM beyond the cap).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sparsegen.bench.serve import read_metrics
from sparsegen.bench.stats import percentile
from sparsegen.memory import peak_rss

QUESTION = "In two sentences, what happens next in this story?"
TEMPLATE_TOKENS = 48  # what a turn's chat template and question add, at most


@dataclass
class SpawnSetup:
    model: str
    policies: list[str]  # "full", "h2o:0.2" (a fraction of context), "streaming:1024"
    kv_memory: list[int]  # caps in bytes, one run per policy each
    context: int = 4096  # tokens each conversation holds at its end
    sessions: int = 8
    turns: int = 2
    max_tokens: int = 32
    chunk_size: int = 256
    text: Path | None = None  # a .txt file or a folder of them (default: the shared books)
    threads: int | None = None
    timeout: float = 1800
    extra: list[str] = field(default_factory=list)  # more `sparsegen serve` flags (e.g. --kv-bits 4)
    baseline: str | None = None  # "llama.cpp": its server on the model's GGUF, under each cap too


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def policy_flags(spec: str, context: int) -> list[str]:
    """``h2o:0.2`` -> ``--policy h2o --budget 819`` (a fraction is of the conversation's context)."""
    name, _, budget = spec.partition(":")
    if not budget:
        return ["--policy", name]
    try:
        value = float(budget)
    except ValueError:
        raise ValueError(f"{spec!r}: write a policy as NAME or NAME:BUDGET (tokens, or a fraction of --context)") \
            from None
    tokens = int(value * context) if value < 1 else int(value)
    if tokens < 1:
        raise ValueError(f"{spec!r} keeps no token of a {context}-token context")
    return ["--policy", name, "--budget", str(tokens)]


def excerpts(setup: SpawnSetup, tokenizer) -> list[str]:
    """One excerpt per session, each of the tokens its first turn may take, from different places in the text."""
    from sparsegen.data import data_dir, text_files

    files = text_files(setup.text or data_dir() / "books" / "train")
    words = setup.context - setup.turns * (setup.max_tokens + TEMPLATE_TOKENS)
    if words < 64:
        raise ValueError(f"--context {setup.context} leaves no room for an opening text beside {setup.turns} turns of "
                         f"{setup.max_tokens} tokens: raise --context or lower --turns/--max-tokens")
    text = "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in files[:4])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < words:
        raise ValueError(f"the text has {len(ids):,} tokens, fewer than one opening of {words:,}: give a longer --text")
    step = max(1, (len(ids) - words) // max(1, setup.sessions - 1))
    return [tokenizer.decode(ids[i * step % (len(ids) - words + 1):][:words]) for i in range(setup.sessions)]


def token_gaps(arrivals: list[float], tokens: list[int]) -> list[float]:
    """Inter-token gaps of a stream whose chunk ``i`` came at ``arrivals[i]`` with ``tokens[i]`` tokens: the gap
    before a chunk of ``n`` tokens, as ``n`` gaps of a ``n``-th of it."""
    return [(b - a) / n for a, b, n in zip(arrivals, arrivals[1:], tokens[1:]) for _ in range(n)]


async def _turn(client: httpx.AsyncClient, url: str, session: str, messages: list[dict], max_tokens: int,
                sparsegen: bool = True) -> dict:
    """One streamed reply: status, time to first token, the gaps between tokens, completion tokens, history.

    A streamed chunk carries every token since the one before (a token whose text is held back — a stop string's
    first characters, a special token with no text — comes with the next), so the gap before a chunk of ``n``
    tokens counts as ``n`` inter-token gaps of a ``n``-th of it: the engine's time per token, not the detokenizer's
    holding back (the tokens a chunk carries are counted from its log-probabilities). ``chunk_gaps``: as they came."""
    started = time.perf_counter()
    arrivals, tokens, content, usage, history = [], [], [], None, None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", headers={"X-Session-Id": session},
                                 json={"messages": messages, "max_tokens": max_tokens, "stream": True,
                                       "ignore_eos": True, "stream_options": {"include_usage": True},
                                       **({"logprobs": True} if sparsegen else {})}) as response:
            status, history = response.status_code, response.headers.get("X-Session-History")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    status = 500
                    break
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    if choice["delta"].get("content"):
                        arrivals.append(time.perf_counter())
                        content.append(choice["delta"]["content"])
                        tokens.append(len((choice.get("logprobs") or {}).get("content") or [None]))
    except httpx.HTTPError as err:
        status = type(err).__name__
    return {"status": status, "ttft": (arrivals[0] if arrivals else time.perf_counter()) - started,
            "chunk_gaps": [b - a for a, b in zip(arrivals, arrivals[1:])], "gaps": token_gaps(arrivals, tokens),
            "content": "".join(content), "streamed": (arrivals[0], arrivals[-1], sum(tokens[1:])) if arrivals else None,
            "completion_tokens": (usage or {}).get("completion_tokens") or sum(tokens), "history": history}


def streamed_tokens_per_s(results: list[dict]) -> float | None:
    """Tokens after each reply's first, over the time at least one reply was streaming: the same clock for any
    server (a server's own decode counters differ), between decode-only and end-to-end throughput."""
    spans = sorted(r["streamed"] for r in results if r.get("streamed"))
    busy, end = 0.0, float("-inf")
    for first, last, _ in spans:
        busy += max(0.0, last - max(first, end))
        end = max(end, last)
    return round(sum(n for _, _, n in spans) / busy, 2) if busy > 0 else None


async def drive(url: str, openings: list[str], turns: int, max_tokens: int, timeout: float,
                sparsegen: bool = True) -> dict:
    """Every session at once, turn after turn; a sparsegen server's /metrics sampled meanwhile for live sessions and
    K/V bytes (another server's counters are read by its own row)."""
    limits = httpx.Limits(max_connections=len(openings) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if not sparsegen:
            started = time.perf_counter()
            conversations = await asyncio.gather(*[
                _converse(client, url, i, text, turns, max_tokens, False) for i, text in enumerate(openings)])
            return _client_side(conversations, len(openings) * turns, time.perf_counter() - started)
        before = await read_metrics(client, url)
        peaks = {"live_sessions": 0.0, "kv_bytes": 0.0, "resident_bytes": 0.0}
        done = asyncio.Event()

        async def watch():
            while not done.is_set():
                metrics = await read_metrics(client, url)
                for key in peaks:
                    peaks[key] = max(peaks[key], metrics.get(key, 0.0))
                await asyncio.sleep(0.25)

        watcher = asyncio.create_task(watch())
        started = time.perf_counter()
        conversations = await asyncio.gather(*[_converse(client, url, i, text, turns, max_tokens)
                                               for i, text in enumerate(openings)])
        seconds = time.perf_counter() - started
        done.set()
        await watcher
        after = await read_metrics(client, url)
    row = _client_side(conversations, len(openings) * turns, seconds)

    def spent(name: str) -> float:
        return after[name] - before[name]

    decode_tokens, decode_steps = spent("decode_tokens_total"), spent("decode_steps_total")

    # decode throughput: of the steps that only decoded (one that carried a prompt chunk also did prefill work)
    decoding_alone = decode_tokens - spent("packed_decode_tokens_total")
    decode_seconds = spent("decode_seconds_total") - spent("packed_seconds_total")
    return {
        **row,
        "decode_tokens_per_s": round(decoding_alone / decode_seconds, 2) if decode_seconds > 0 else None,
        "packed_steps": int(spent("packed_steps_total")),
        "mean_decode_batch": round(decode_tokens / decode_steps, 2) if decode_steps else None,
        "sessions_admitted": int(peaks["live_sessions"]), "kv_bytes_peak": int(peaks["kv_bytes"]),
        "reencoded_replies": sum(r["history"] == "reencoded" for c in conversations for r in c if r["status"] == 200),
        "dropped_sessions": int(after.get("dropped_sessions_total", 0) - before.get("dropped_sessions_total", 0)),
        "prefill_tokens": int(after["prefill_tokens_total"] - before["prefill_tokens_total"]),
        "server_errors": int(after["errors_total"] - before["errors_total"]),
    }


async def _converse(client: httpx.AsyncClient, url: str, index: int, opening: str, turns: int, max_tokens: int,
                    sparsegen: bool = True) -> list[dict]:
    """One conversation, turn after turn, each sending the whole history (as an OpenAI client does)."""
    messages, results = [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": (opening + "\n\n" if turn == 0 else "") + QUESTION})
        result = await _turn(client, url, f"spawn-{index}", messages, max_tokens, sparsegen)
        results.append(result)
        if result["status"] != 200:
            break
        messages.append({"role": "assistant", "content": result["content"]})
    return results


def _client_side(conversations: list[list[dict]], expected: int, seconds: float) -> dict:
    """What the clients measured, the same for any server."""
    results = [r for conversation in conversations for r in conversation]
    ok = [r for r in results if r["status"] == 200]
    ttft, gaps = [r["ttft"] for r in ok], [g for r in ok for g in r["gaps"]]  # (percentile sorts)
    chunk_gaps = [g for r in ok for g in r["chunk_gaps"]]
    completion = sum(r["completion_tokens"] for r in ok)
    return {"requests": len(results), "failed": expected - len(ok), "seconds": round(seconds, 2),
            "completion_tokens": completion, "tokens_per_s": round(completion / seconds, 2),
            "streamed_tokens_per_s": streamed_tokens_per_s(ok),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "itl_p50_s": _pct(gaps, 0.5), "itl_p99_s": _pct(gaps, 0.99),
            "chunk_gap_p50_s": _pct(chunk_gaps, 0.5), "chunk_gap_p99_s": _pct(chunk_gaps, 0.99)}


def _pct(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 4) if values else None


def serve_one(setup: SpawnSetup, spec: str, cap: int, openings: list[str], log: Path) -> dict:
    """Start a server for ``spec`` under ``cap``, drive the conversations, stop it; one report row."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "sparsegen", "serve", "--model", setup.model, *policy_flags(spec, setup.context),
               "--kv-memory", str(cap), "--max-context", str(setup.context), "--chunk-size", str(setup.chunk_size),
               "--max-batch", str(setup.sessions), "--max-sessions", str(2 * setup.sessions),
               "--max-queue", str(4 * setup.sessions), "--max-prompt-tokens", str(setup.context),
               "--max-tokens-limit", str(setup.max_tokens), "--max-new-tokens", str(setup.max_tokens),
               "--port", str(port), *setup.extra]
    env = dict(os.environ)
    if setup.threads:
        env["OMP_NUM_THREADS"] = str(setup.threads)
    with open(log, "w") as out:
        started = time.perf_counter()
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(url, server, log)
            ready = time.perf_counter() - started  # (load, and the compiled step's warm-up where it compiles)
            row = asyncio.run(drive(url, openings, setup.turns, setup.max_tokens, setup.timeout))
            row["ready_seconds"] = round(ready, 1)
            row["peak_rss_bytes"] = peak_rss(server.pid)
        except NoRoom as err:
            row = {"skipped": str(err), "sessions_admitted": 0, "failed": 0, "server_errors": 0,
                   "decode_tokens_per_s": None, "tokens_per_s": None}
        finally:
            stop_server(server)
    return {"policy": spec, "kv_memory_bytes": cap, **row}


def stop_server(server: subprocess.Popen, seconds: float = 30) -> None:
    """Ask a server to shut down (SIGTERM: a graceful stop), and kill it if it has not in ``seconds``."""
    server.terminate()
    try:
        server.wait(seconds)
    except subprocess.TimeoutExpired:
        server.kill()


LLAMACPP_PROMPT_CACHE = {"llama.cpp": False, "llama.cpp+cache": True}  # a baseline row's name: its prompt cache on?


def llamacpp_server_command(binary: Path, gguf: Path, setup: SpawnSetup, slots: int, port: int,
                            prompt_cache: bool) -> list[str]:
    """``llama-server`` with ``slots`` parallel slots of ``context`` tokens each. Without ``prompt_cache`` its prompt
    cache in RAM is off (``--cache-ram 0``), so that the cap is all the K/V it keeps; with it, its default cache (the
    prompts of conversations whose slot went to another, kept beyond the cap) stays on."""
    threads = str(setup.threads or os.cpu_count() or 1)
    return [str(binary), "-m", str(gguf), "-c", str(slots * setup.context), "-np", str(slots), "--no-kv-unified",
            *([] if prompt_cache else ["--cache-ram", "0"]), "--metrics", "-t", threads, "-tb", threads,
            "-b", str(setup.chunk_size), "--host", "127.0.0.1", "--port", str(port)]


def serve_llamacpp(setup: SpawnSetup, cap: int, openings: list[str], log: Path, variant: str = "llama.cpp") -> dict:
    """llama.cpp's server on the model's GGUF under ``cap``: as many parallel slots of ``context`` tokens (continuous
    batching) as its K/V allocation fits in the cap — read from its own start-up log, first for one slot, then for
    the count chosen — driven by the same clients. ``variant`` (a key of ``LLAMACPP_PROMPT_CACHE``): ``llama.cpp`` with
    its prompt cache in RAM off, so that the cap is all it keeps; ``llama.cpp+cache`` with its default prompt cache."""
    from sparsegen.bench import llamacpp
    from sparsegen.models.gguf import gguf_file

    binary, gguf = llamacpp.server_binary(), gguf_file(setup.model)

    def start(slots: int, out, *flags: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        server = subprocess.Popen([*llamacpp_server_command(binary, gguf, setup, slots, port,
                                                            LLAMACPP_PROMPT_CACHE[variant]), *flags],
                                  stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, server, log)
        return server, url

    def allocated(slots: int) -> int:  # what llama.cpp allocates for that many slots (its info log says)
        with open(log, "w") as out:
            stop_server(start(slots, out, "-lv", "4")[0])
        return llamacpp.server_kv_bytes(log.read_text())

    per_session = allocated(1)
    slots = min(setup.sessions, cap // per_session)
    while slots > 1 and allocated(slots) > cap:  # (sliding-window caches do not grow by whole sessions)
        slots -= 1
    row = {"policy": variant, "kv_memory_bytes": cap, "engine": f"llama-server ({gguf.name})",
           "prompt_cache_in_ram": LLAMACPP_PROMPT_CACHE[variant], "kv_bytes_per_session": per_session}
    if slots == 0:
        return {**row, "skipped": f"one {setup.context}-token session takes {per_session / 2**20:.1f} MiB of "
                                  f"llama.cpp's K/V", "sessions_admitted": 0, "failed": 0, "server_errors": 0,
                "decode_tokens_per_s": None, "tokens_per_s": None}
    kv_bytes = allocated(slots)
    with open(log, "w") as out:
        server, url = start(slots, out)
        try:
            measured = asyncio.run(drive(url, openings, setup.turns, setup.max_tokens, setup.timeout, sparsegen=False))
            counters = _prometheus(httpx.get(f"{url}/metrics", timeout=10).text)
            measured["peak_rss_bytes"] = peak_rss(server.pid)
        finally:
            stop_server(server)
    return {**row, **measured, "sessions_admitted": slots, "kv_bytes_peak": kv_bytes,
            "decode_tokens_per_s": None,  # llama.cpp counts generation time per slot: no aggregate decode clock
            "mean_decode_batch": round(counters.get("n_busy_slots_per_decode", 0), 2) or None,
            "prefill_tokens": int(counters.get("prompt_tokens_total", 0)), "server_errors": 0}


def _prometheus(text: str) -> dict[str, float]:
    """llama-server's /metrics as ``{name without the llamacpp: prefix: value}``."""
    return {line.split()[0].removeprefix("llamacpp:"): float(line.split()[1])
            for line in text.splitlines() if line.startswith("llamacpp:")}


class NoRoom(Exception):
    """The cap holds not one session of this policy: a row of its own (0 admitted), not a failure of the run."""


def wait_healthy(url: str, server: subprocess.Popen, log: Path, seconds: float = 1800) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if server.poll() is not None:
            tail = log.read_text()[-2000:]
            if "holds no session" in tail:
                raise NoRoom(tail.strip().splitlines()[-1].removeprefix("sparsegen serve: error: "))
            raise RuntimeError(f"the server exited with status {server.returncode} before answering:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health in {seconds:.0f} s (log: {log})")


def run(setup: SpawnSetup, tokenizer, work: Path, on_row=None) -> list[dict]:
    """Every policy under every cap; ``throughput_ratio_vs_full`` (decode tok/s over full's under the same cap) and
    ``end_to_end_ratio_vs_full`` when a ``full`` row is there."""
    openings = excerpts(setup, tokenizer)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for cap in setup.kv_memory:
        for spec in setup.policies + (list(LLAMACPP_PROMPT_CACHE) if setup.baseline else []):
            log = work / f"serve-{spec.replace(':', '-')}-{cap}.log"
            if spec in LLAMACPP_PROMPT_CACHE:
                row = serve_llamacpp(setup, cap, openings, log, spec)
            else:
                row = serve_one(setup, spec, cap, openings, log)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    for row in rows:
        full = next((r for r in rows if r["policy"] == "full" and r["kv_memory_bytes"] == row["kv_memory_bytes"]),
                    None)
        if full is not None and full.get("decode_tokens_per_s") and row.get("decode_tokens_per_s"):
            row["throughput_ratio_vs_full"] = round(row["decode_tokens_per_s"] / full["decode_tokens_per_s"], 2)
        if full is not None and full.get("tokens_per_s") and row.get("tokens_per_s"):
            row["end_to_end_ratio_vs_full"] = round(row["tokens_per_s"] / full["tokens_per_s"], 2)
        if full is not None and full.get("streamed_tokens_per_s") and row.get("streamed_tokens_per_s"):
            row["streamed_ratio_vs_full"] = round(row["streamed_tokens_per_s"] / full["streamed_tokens_per_s"], 2)
    return rows


def summary(rows: list[dict]) -> str:
    head = (f"{'policy':<16}{'KV cap MiB':>11}{'admitted':>9}{'batch':>6}{'failed':>7}{'decode tok/s':>13}"
            f"{'streamed':>9}{'e2e tok/s':>10}{'vs full':>8}{'TTFT p50':>9}{'p99':>7}{'ITL p50':>8}{'p99':>7}"
            f"{'KV peak':>8}{'RSS MiB':>8}")
    lines = [head]
    for r in rows:
        def ms(v):
            return "-" if v is None else f"{v * 1000:.0f}"

        def ratio(v):  # (no full row under this cap: nothing to compare with)
            return "-" if v is None else f"{v:.2f}x"

        def rate(v, width):
            return f"{'-':>{width}}" if v is None else f"{v:>{width}.1f}"
        if "skipped" in r:
            lines.append(f"{r['policy']:<16}{r['kv_memory_bytes'] / 2**20:>11,.0f}{0:>9}  (the cap holds no session: "
                         f"{r['skipped']})")
            continue
        lines.append(
            f"{r['policy']:<16}{r['kv_memory_bytes'] / 2**20:>11,.0f}{r['sessions_admitted']:>9}"
            f"{r['mean_decode_batch'] or 0:>6.1f}{r['failed']:>7}"
            f"{rate(r['decode_tokens_per_s'], 13)}{rate(r.get('streamed_tokens_per_s'), 9)}{r['tokens_per_s']:>10.1f}"
            f"{ratio(r.get('throughput_ratio_vs_full') or r.get('streamed_ratio_vs_full')):>8}"
            f"{r['ttft_p50_s'] or 0:>8.1f}s"
            f"{r['ttft_p99_s'] or 0:>6.1f}s{ms(r['itl_p50_s']):>6}ms{ms(r['itl_p99_s']):>5}ms"
            f"{r['kv_bytes_peak'] / 2**20:>8.0f}{(r['peak_rss_bytes'] or 0) / 2**20:>8.0f}")
    return "\n".join(lines) + ("\n(streamed: tokens after each reply's first over the time any reply streamed, as the "
                               "clients saw it; vs full: decode tok/s, or streamed where a row has no decode clock)"
                               if any(r.get("decode_tokens_per_s") is None and "skipped" not in r for r in rows)
                               else "")


def plot(rows: list[dict], path: str) -> None:
    """Decode tokens/s (sparsegen's servers) and streamed tokens/s (every server, the clients' clock) against the
    K/V cap, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "decode_tokens_per_s", "aggregate decode tokens/s"),
                           (axes[1], "streamed_tokens_per_s", "streamed tokens/s (clients' clock)")):
        for spec in dict.fromkeys(r["policy"] for r in rows):
            mine = sorted((r for r in rows if r["policy"] == spec and "skipped" not in r and r.get(key)),
                          key=lambda r: r["kv_memory_bytes"])
            if mine:
                ax.plot([r["kv_memory_bytes"] / 2**20 for r in mine], [r[key] for r in mine], "o-",
                        label=f"{spec} ({'/'.join(str(r['sessions_admitted']) for r in mine)} live)")
        ax.set_xlabel("K/V memory cap (MiB)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("serving at fixed memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
