"""Load on a running ``sparsegen serve``: many concurrent chat sessions over several turns each, streamed.

Each session sends its whole conversation every turn (as OpenAI clients do) with its session id, so the server
encodes only the new message. Time to first token is measured from sending a request to its first content chunk;
the server's memory (RSS and K/V bytes, from /metrics) is sampled as the turns go by.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

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


async def run_load(url: str, sessions: int, turns: int, max_tokens: int = 16, headers: dict | None = None,
                   timeout: float = 600) -> dict:
    """``sessions`` concurrent conversations of ``turns`` turns each; latency, throughput, errors and memory."""
    limits = httpx.Limits(max_connections=sessions + 4, max_keepalive_connections=sessions + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers or {}) as client:
        before = await _metrics(client, url)
        results: list[dict] = []
        memory: list[dict] = []
        done_turns = [0] * turns

        async def converse(index: int) -> None:
            messages = []
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Reader {index} asks question {turn}: what happened next?"})
                result = await _turn(client, url, f"load-{index}", messages, max_tokens)
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
    }
