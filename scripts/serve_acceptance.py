"""Issue 35's acceptance against a running `sparsegen serve` (SmolLM2, streaming 512, --max-batch 8): 6 concurrent
streamed chats of which 3 clients hang up after 1-5 events; the other 3 complete, /health is ok, a new request then
succeeds; a content-part list gets a 200; models.retrieve works. Prints and writes JSON; exit 1 on any failure."""

import asyncio
import json
import sys
import time

import httpx
from openai import AsyncOpenAI, OpenAI

URL, MODEL = sys.argv[1], sys.argv[2]
HANG_UP = {0: 1, 2: 3, 4: 5}  # client -> events read before closing


async def chat(client: AsyncOpenAI, i: int) -> dict:
    started, text, events = time.perf_counter(), [], 0
    stream = await client.chat.completions.create(
        model=MODEL, max_tokens=40, stream=True,
        messages=[{"role": "user", "content": f"Write a short poem about the number {i}."}])
    async for chunk in stream:
        events += 1
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if i in HANG_UP and events >= HANG_UP[i]:
            await stream.close()  # hang up mid-stream
            return {"client": i, "hung_up_after": events}
    return {"client": i, "completed": True, "events": events, "chars": len("".join(text)),
            "seconds": round(time.perf_counter() - started, 2)}


async def main() -> dict:
    client = AsyncOpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=300)
    results = await asyncio.gather(*[chat(client, i) for i in range(6)])
    await client.close()
    return {"streams": results}


report = asyncio.run(main())
time.sleep(1)
report["health"] = httpx.get(f"{URL}/health").json()
sync = OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=300)
parts = sync.chat.completions.create(model=MODEL, max_tokens=16, messages=[
    {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}])
report["content_parts_reply"] = parts.choices[0].message.content
report["model_retrieved"] = sync.models.retrieve(MODEL).id
after = sync.chat.completions.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello!"}])
report["new_request_after"] = after.choices[0].finish_reason
metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(f"{URL}/metrics").text.splitlines()
           if not line.startswith("#")}
report["metrics"] = {k.removeprefix("sparsegen_"): v for k, v in metrics.items()
                     if any(w in k for w in ("cancelled", "errors", "rebuilds", "kv_bytes", "active"))}
completed = [r for r in report["streams"] if r.get("completed")]
report["ok"] = len(completed) == 3 and report["health"] == {"status": "ok"} and report["model_retrieved"] == MODEL \
    and report["metrics"]["errors_total"] == 0
print(json.dumps(report, indent=2))
sys.exit(0 if report["ok"] else 1)
