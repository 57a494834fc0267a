"""Sessions across replicas, measured against a running ``sparsegen serve --ray`` (docs/serving.md, issue 87):
N sessions x 2 turns undisturbed, then N more with one replica killed (``ray.kill`` on its actor) after every first
turn and before any second one.
Prints the replies' statuses, the second turns' ``cached_tokens``, which sessions moved, and whether each moved
session's reply equals the undisturbed one.

    sparsegen serve --model smollm2 --policy h2o --budget 820 --ray --replicas 2 --session-store /tmp/sessions &
    python scripts/ray_sessions.py --url http://127.0.0.1:8000 --sessions 12 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import httpx
import ray

from sparsegen.data import data_dir
from sparsegen.serve.replicas import REPLICA_HEADER


def turn(url: str, session: str, messages: list[dict], max_tokens: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens},
                      headers={"X-Session-Id": session}, timeout=600)


def conversations(url: str, tag: str, openings: list[str], max_tokens: int, between=lambda replicas: None):
    """Every session's first turn, then ``between`` (given the replica of each), then every second turn."""
    talks = [[{"role": "user", "content": opening}] for opening in openings]
    firsts = [turn(url, f"{tag}{i}", talk, max_tokens) for i, talk in enumerate(talks)]
    between([first.headers.get(REPLICA_HEADER) for first in firsts])
    for talk, first in zip(talks, firsts):
        talk += [first.json()["choices"][0]["message"], {"role": "user", "content": "Summarize that in one line."}]
    return list(zip(firsts, [turn(url, f"{tag}{i}", talk, max_tokens) for i, talk in enumerate(talks)]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--prompt-chars", type=int, default=6000, help="characters of a book opening each session")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ray.init(address="auto", namespace="serve", logging_level="error")
    book = (data_dir() / "books" / "test" / "great_expectations.txt").read_text()
    step = len(book) // (args.sessions + 1)
    openings = [f"Read this:\n{book[i * step:i * step + args.prompt_chars]}\nWho is speaking here?"
                for i in range(args.sessions)]
    t0 = time.perf_counter()
    calm = conversations(args.url, f"calm-{t0}-", openings, args.max_tokens)
    killed = []

    def kill_one(replicas: list[str]) -> None:
        time.sleep(1.0)  # (the first turns' snapshots are written just after their replies)
        ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=False)
        killed.append(replicas[0])

    moved = conversations(args.url, f"moved-{t0}-", openings, args.max_tokens, kill_one)
    rows = []
    for i, ((_, calm_second), (first, second)) in enumerate(zip(calm, moved)):
        moved_here = first.headers.get(REPLICA_HEADER) == killed[0]
        rows.append({"session": i, "statuses": [first.status_code, second.status_code], "moved": moved_here,
                     "history": second.headers.get("X-Session-History"),
                     "prompt_tokens": second.json()["usage"]["prompt_tokens"],
                     "cached_tokens": second.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
                     "same_text_as_undisturbed": second.json()["choices"][0]["message"]["content"]
                     == calm_second.json()["choices"][0]["message"]["content"]})
    ok = sum(s == 200 for r in rows for s in r["statuses"])
    print(f"{ok}/{2 * len(rows)} replies 200; {sum(r['moved'] for r in rows)} sessions moved off the killed replica")
    print("| session | moved | history | prompt tokens | cached tokens | text = undisturbed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['session']} | {r['moved']} | {r['history']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
              f"{r['same_text_as_undisturbed']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"replies_ok": ok, "rows": rows, "killed": killed[0]}, f, indent=2)


if __name__ == "__main__":
    main()
