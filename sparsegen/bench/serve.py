"""Load on a running ``sparsegen serve``: many concurrent chat sessions over several turns each, streamed.

Each session sends its whole conversation every turn (as OpenAI clients do) with its session id, so the server
encodes only the new message. Time to first token is measured from sending a request to its first content chunk;
the server's memory (RSS and K/V bytes, from /metrics) is sampled as the turns go by. With ``hostile``, one more
client meanwhile sends, in a loop, the requests that once stalled, crashed or poisoned the server (a 2.4e-38
temperature, four 250K-character stop strings, a 1,000,000-character prompt and one just under the prompt limit, a
200 MiB chunked upload): the well-behaved sessions must not notice beyond the work those requests legitimately cost.
With ``chaos``, clients meanwhile hang up, time out, send garbage, reuse a session concurrently, send slow bodies or
headers, bodies nested to the parser's limit, loose types and malformed HTTP, start several sessions at once, and ask
the cache inspector at tiny budgets (sometimes giving up on it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
import uuid
from collections import Counter

import httpx


async def read_metrics(client: httpx.AsyncClient, url: str) -> dict:
    """A server's /metrics as ``{name without the sparsegen_ prefix: value}``."""
    text = (await client.get(f"{url}/metrics")).text
    return {line.split()[0].removeprefix("sparsegen_"): float(line.split()[1])
            for line in text.splitlines() if line and not line.startswith("#")}


async def _turn(client, url: str, session: str, messages: list[dict], max_tokens: int) -> dict:
    started = time.perf_counter()
    content: list[tuple[float, str]] = []
    try:
        status = await _read_stream(client, url, session, messages, max_tokens, content)
    except httpx.HTTPError as err:  # a failed good reply, counted as such
        status = type(err).__name__
    end = time.perf_counter()
    first = content[0][0] if content else None
    return {"status": status, "ttft": (first or end) - started, "seconds": end - started,
            "content": "".join(text for _, text in content)}


async def _read_stream(client, url: str, session: str, messages: list[dict], max_tokens: int,
                       content: list) -> int:
    """Stream one reply into ``content`` as ``(arrival time, text)``; its HTTP status (500 for an error event)."""
    async with client.stream("POST", f"{url}/v1/chat/completions", headers={"X-Session-Id": session},
                             json={"messages": messages, "max_tokens": max_tokens, "stream": True}) as response:
        status = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 500
            text = event["choices"][0]["delta"].get("content")
            if text:
                content.append((time.perf_counter(), text))
    return status


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


async def _chaos(client: httpx.AsyncClient, url: str, done: asyncio.Event, counts: Counter, seed: int) -> None:
    """One client that misbehaves at random until ``done``, one fault of ``faults`` (below) after another: hangs up
    mid-stream after 1-5 events, gives up on a reply (a client timeout, maybe while queued), sends garbage, two
    requests at once on one session, a slow body, ... ``counts``: outcome per fault ("NAME: STATUS")."""
    rng = random.Random(seed)
    chat = f"{url}/v1/chat/completions"

    def body(text: str, stream: bool = False, tokens: int = 32) -> dict:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": tokens, "stream": stream}

    async def hang_up():
        async with client.stream("POST", chat, json=body("Tell me about the sea.", True, 64)) as response:
            events, wanted = 0, rng.randint(1, 5)
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events >= wanted:
                    break
            return response.status_code

    async def give_up():
        try:
            return (await client.post(chat, json=body("Tell me a story.", tokens=64),
                                      timeout=rng.uniform(0.05, 0.5))).status_code
        except httpx.TimeoutException:
            return "timeout"

    async def garbage():
        content = rng.choice([b'{"messages": [{"role": "us', b"\x00\xff not json", b'{"messages": '
                                                                                   b'"hi"}', b'{"prompt": 5}',
                              b'{"messages": []}', b"[]", b'{"messages": [{"role": "user", "content": [{"type": '
                                                          b'1}]}]}'])
        return (await client.post(chat, content=content, headers={"content-type": "application/json"})).status_code

    async def shared_session():
        session = f"chaos-{seed}-{rng.randrange(4)}"
        replies = await asyncio.gather(*[client.post(chat, json=body("Hello there."), headers={"X-Session-Id": session})
                                         for _ in range(2)])
        return "+".join(sorted(str(r.status_code) for r in replies))

    async def slow_body():
        raw = json.dumps(body("Slowly, now.", tokens=8)).encode()

        async def pieces():
            for i in range(0, len(raw), len(raw) // 4 + 1):
                await asyncio.sleep(0.2)
                yield raw[i:i + len(raw) // 4 + 1]

        return (await client.post(chat, content=pieces(), headers={"content-type": "application/json"})).status_code

    async def deep_json():  # nested around the JSON parser's own limit: 400, never a 500
        depth = rng.randint(900, 1000)
        content = b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + b"[" * depth + b"]" * depth + b"}"
        return (await client.post(chat, content=content, headers={"content-type": "application/json"})).status_code

    async def loose_types():  # strings where numbers or booleans belong: 400, not coerced
        field, value = rng.choice([("max_tokens", "10"), ("stream", "yes"), ("logprobs", "yes"), ("seed", 1.5)])
        return (await client.post(chat, json={**body("Hi."), field: value})).status_code

    async def new_sessions():  # first turns of several new sessions at once: they wait for a place, never 503
        replies = await asyncio.gather(*[client.post(chat, json=body("Hello there.", tokens=8), headers={
            "X-Session-Id": f"chaos-new-{seed}-{uuid.uuid4().hex[:8]}"}) for _ in range(3)])
        return "+".join(sorted(str(r.status_code) for r in replies))

    async def inspect():  # the cache inspector at tiny budgets, sometimes given up on
        request = {"text": "The ship sailed at dawn and the crew sang. " * rng.randint(2, 20),
                   "budget": rng.randint(1, 4),
                   "policies": ",".join(rng.sample(["snapkv", "h2o", "streaming", "lagkv", "pyramid-snapkv",
                                                    "snapkv-layers", "tova", "window"], 2))}
        try:
            reply = await client.post(f"{url}/v1/inspect", json=request, timeout=rng.choice([0.2, 30]))
        except httpx.TimeoutException:
            return "timeout"
        return reply.status_code

    async def raw(data: bytes, hold: float) -> str:
        """Send ``data`` on a connection of its own, keep it ``hold`` seconds, then read what came back."""
        address = httpx.URL(url)
        reader, writer = await asyncio.open_connection(address.host, address.port)
        try:
            writer.write(data)
            await writer.drain()
            try:
                reply = await asyncio.wait_for(reader.read(4096), hold)
            except asyncio.TimeoutError:
                return "held"
            return reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else "closed"
        finally:
            writer.close()

    async def malformed_http():
        return await raw(rng.choice([b"GARBAGE\r\n\r\n", b"POST / "
                                                         b"HTTP/9.9\r\n\r\n", b"\x16\x03\x01\x00\xa5\x01\r\n\r\n"]), 5)

    async def slow_headers():  # a request's headers trickled, then abandoned (slowloris)
        return await raw(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty", rng.uniform(0.1, 1.0))

    async def head_health():
        return (await client.head(f"{url}/health")).status_code

    faults = {"hang up mid-stream": hang_up, "give up on a reply": give_up, "garbage": garbage,
              "one session twice at once": shared_session, "slow body": slow_body, "deep JSON": deep_json,
              "loose types": loose_types, "new sessions at once": new_sessions, "inspect": inspect,
              "malformed HTTP": malformed_http, "slow headers": slow_headers, "HEAD /health": head_health}
    while not done.is_set():
        name = rng.choice(list(faults))
        try:
            outcome = await faults[name]()
        except (httpx.HTTPError, OSError) as err:
            outcome = type(err).__name__
        counts[f"{name}: {outcome}"] += 1


def server_faults(counts: Counter) -> int:
    """Outcomes of misbehaving clients that are the server's fault: any 5xx (a server that is not stopping answers
    bad input with a 4xx, and waits or says 429 when busy)."""
    return sum(n for outcome, n in counts.items() for status in outcome.split(": ")[-1].split("+")
               if status.isdigit() and int(status) >= 500)


async def run_load(url: str, sessions: int, turns: int, max_tokens: int = 16, headers: dict | None = None,
                   timeout: float = 600, hostile: bool = False, concurrency: int | None = None, chaos: int = 0,
                   duration: float | None = None, sample_every: int | None = None) -> dict:
    """``sessions`` conversations of ``turns`` turns each, ``concurrency`` at a time (default: all at once), or with
    ``duration``, new conversations for that many seconds; latency, throughput, failed replies and server memory
    (after each turn of all when they run at once, and every ``sample_every`` conversations). ``chaos``: that many
    misbehaving clients meanwhile (``_chaos``); ``hostile``: one more sending oversized requests (``_hostile``)."""
    concurrency = concurrency or sessions
    if min(sessions, turns, concurrency) < 1 or (duration is not None and duration <= 0):
        raise ValueError("sessions, turns and concurrency must be at least 1, and a duration positive")
    limits = httpx.Limits(max_connections=concurrency + 2 * chaos + 8,
                          max_keepalive_connections=concurrency + 2 * chaos + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers or {}) as client:
        before = await read_metrics(client, url)
        done, attacks, faults = asyncio.Event(), Counter(), Counter()
        run = uuid.uuid4().hex[:8]  # fresh session ids: a second run does not start over the first one's sessions
        others = [asyncio.create_task(_hostile(client, url, done, attacks))] if hostile else []
        others += [asyncio.create_task(_chaos(client, url, done, faults, seed)) for seed in range(chaos)]
        results: list[dict] = []
        memory: list[dict] = []
        samples: list[dict] = []
        done_turns = [0] * turns
        started = time.perf_counter()
        numbers = iter(range(sessions) if duration is None else itertools.count())
        finished = 0

        async def sample() -> dict:
            metrics = await read_metrics(client, url)
            return {"rss_bytes": metrics.get("resident_bytes"), "kv_bytes": metrics.get("kv_bytes"),
                    "sessions_kept": metrics.get("sessions")}

        async def converse(index: int) -> None:
            nonlocal finished
            messages = []
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Reader {index} asks question {turn}: what happened "
                                                            f"next?"})
                result = await _turn(client, url, f"load-{run}-{index}", messages, max_tokens)
                results.append({**result, "turn": turn})
                messages.append({"role": "assistant", "content": result["content"]})
                done_turns[turn] += 1
                if done_turns[turn] == sessions and concurrency == sessions and duration is None:
                    memory.append({"turn": turn + 1, **await sample()})  # every session has finished this turn
            finished += 1
            if sample_every and finished % sample_every == 0:
                samples.append({"conversations": finished, "seconds": round(time.perf_counter() - started, 1),
                                **await sample()})

        async def client_loop() -> None:
            for index in numbers:
                if duration is not None and time.perf_counter() - started > duration:
                    return
                await converse(index)

        await asyncio.gather(*[client_loop() for _ in range(concurrency)])
        seconds = time.perf_counter() - started
        done.set()
        await asyncio.gather(*others)
        after = await read_metrics(client, url)
        health = (await client.get(f"{url}/health")).json()
    ok = [r for r in results if r["status"] == 200]
    ttft = sorted(r["ttft"] for r in ok)
    generated = after["decode_tokens_total"] - before["decode_tokens_total"] + len(ok)  # + each reply's first token
    return {
        "sessions": finished, "concurrency": concurrency, "turns": turns, "max_tokens": max_tokens,
        "requests": len(results), "errors": len(results) - len(ok), "seconds": round(seconds, 2),
        "ttft_p50_s": round(statistics.median(ttft), 4) if ttft else None,
        "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 4) if ttft else None,
        "tokens_per_s": round(generated / seconds, 1),
        "prefill_tokens": after["prefill_tokens_total"] - before["prefill_tokens_total"],
        "reencoded_sessions": after["reencoded_sessions_total"] - before["reencoded_sessions_total"],
        "kv_bytes_bound": after.get("kv_bytes_bound"), "memory": memory, "samples": samples,
        "server_errors": after["errors_total"] - before["errors_total"], "hostile": dict(attacks) if hostile else None,
        "chaos": dict(faults) if chaos else None, "server_faults": server_faults(faults),
        "engine_rebuilds": after.get("engine_rebuilds_total", 0) - before.get("engine_rebuilds_total", 0),
        "health": health,
    }
