"""Load on a running ``sparsegen serve``: many concurrent chat sessions over several turns each, streamed.

Each session sends its whole conversation every turn (as OpenAI clients do) with its session id, so the server
encodes only the new message. Time to first token is measured from sending a request to its first content chunk;
the server's memory (RSS and K/V bytes, from /metrics) is sampled as the turns go by. With ``hostile``, one more
client meanwhile sends, in a loop, the requests that once stalled, crashed or poisoned the server (a 2.4e-38
temperature, four 250K-character stop strings, a 1,000,000-character prompt and one just under the prompt limit, a
200 MiB chunked upload): the well-behaved sessions must not notice beyond the work those requests legitimately cost.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections import Counter

import httpx


async def _metrics(client: httpx.AsyncClient, url: str) -> dict:
    text = (await client.get(f"{url}/metrics")).text
    return {line.split()[0].removeprefix("sparsegen_"): float(line.split()[1])
            for line in text.splitlines() if line and not line.startswith("#")}


async def _turn(client, url: str, session: str, messages: list[dict], max_tokens: int) -> dict:
    started = time.perf_counter()
    first, content, status = None, [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", headers={"X-Session-Id": session},
                             json={"messages": messages, "max_tokens": max_tokens, "stream": True}) as response:
        status = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                status = 500
                break
            text = event["choices"][0]["delta"].get("content")
            if text:
                first = first or time.perf_counter()
                content.append(text)
    end = time.perf_counter()
    return {"status": status, "ttft": (first or end) - started, "seconds": end - started, "content": "".join(content)}


async def _hostile(client: httpx.AsyncClient, url: str, done: asyncio.Event, counts: Counter) -> None:
    """Rows 1-4 of the hardening issue, sent one after another until ``done``; ``counts``: outcome per attack."""

    async def upload():
        for _ in range(200):
            yield b" " * (1 << 20)

    async def send(name: str, **request) -> None:
        try:
            async with client.stream("POST", f"{url}/v1/completions", **request) as response:
                await response.aread()
                counts[f"{name}: {response.status_code}"] += 1
        except httpx.HTTPError as err:  # the server cut an upload off: it answered and closed
            counts[f"{name}: {type(err).__name__}"] += 1

    while not done.is_set():
        await send("tiny temperature", json={"prompt": "Once upon a time", "temperature": 2.4e-38, "max_tokens": 64,
                                             "stream": True})
        await send("4 x 250K stop strings", json={"prompt": "Once", "max_tokens": 6, "stop": ["x" * 250_000] * 4})
        await send("1M-character prompt", json={"prompt": "the sea " * 125_000, "max_tokens": 1})
        await send("long prompt under the limit", json={"prompt": "the sea " * 3_000, "max_tokens": 1})
        await send("200 MiB chunked upload", content=upload(), headers={"content-type": "application/json"})


async def run_load(url: str, sessions: int, turns: int, max_tokens: int = 16, headers: dict | None = None,
                   timeout: float = 600, hostile: bool = False) -> dict:
    """``sessions`` concurrent conversations of ``turns`` turns each; latency, throughput, errors and memory."""
    limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers or {}) as client:
        before = await _metrics(client, url)
        done, attacks = asyncio.Event(), Counter()
        run = uuid.uuid4().hex[:8]  # fresh session ids: a second run does not start over the first one's sessions
        attacker = asyncio.create_task(_hostile(client, url, done, attacks)) if hostile else None
        results: list[dict] = []
        memory: list[dict] = []
        done_turns = [0] * turns

        async def converse(index: int) -> None:
            messages = []
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Reader {index} asks question {turn}: what happened next?"})
                result = await _turn(client, url, f"load-{run}-{index}", messages, max_tokens)
                results.append({**result, "turn": turn})
                messages.append({"role": "assistant", "content": result["content"]})
                done_turns[turn] += 1
                if done_turns[turn] == sessions:  # every session has finished this turn: sample memory
                    sample = await _metrics(client, url)
                    memory.append({"turn": turn + 1, "rss_bytes": sample.get("resident_bytes"),
                                   "kv_bytes": sample.get("kv_bytes")})

        started = time.perf_counter()
        await asyncio.gather(*[converse(i) for i in range(sessions)])
        seconds = time.perf_counter() - started
        done.set()
        if attacker is not None:
            await attacker
        after = await _metrics(client, url)
    ok = [r for r in results if r["status"] == 200]
    ttft = sorted(r["ttft"] for r in ok)
    generated = after["decode_tokens_total"] - before["decode_tokens_total"] + len(ok)  # + each reply's first token
    return {
        "sessions": sessions, "turns": turns, "max_tokens": max_tokens, "requests": len(results),
        "errors": len(results) - len(ok), "seconds": round(seconds, 2),
        "ttft_p50_s": round(statistics.median(ttft), 4) if ttft else None,
        "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 4) if ttft else None,
        "tokens_per_s": round(generated / seconds, 1),
        "prefill_tokens": after["prefill_tokens_total"] - before["prefill_tokens_total"],
        "reencoded_sessions": after["reencoded_sessions_total"] - before["reencoded_sessions_total"],
        "kv_bytes_bound": after.get("kv_bytes_bound"), "memory": memory,
        "server_errors": after["errors_total"] - before["errors_total"], "hostile": dict(attacks) if hostile else None,
    }
