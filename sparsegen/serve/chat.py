"""``sparsegen chat``: a terminal conversation whose history lives in one bounded cache and is never re-encoded."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import TextIO

from sparsegen.engine.scheduler import Engine
from sparsegen.engine.session import Sampling, Session
from sparsegen.memory import current_rss

HELP = "/reset starts over, /stats shows the cache, /quit leaves (Ctrl-D too); Ctrl-C stops a reply"


def turn_stats(engine: Engine, session: Session, job, seconds: float) -> dict:
    decode = len(job.tokens)
    return {
        "turn": session.turns, "prompt_tokens": job.prompt_tokens, "new_tokens": decode,
        "reencoded": job.reencoded, "seconds": round(seconds, 4),
        "tokens_per_s": round(decode / seconds, 2) if seconds else None,
        "kv_tokens": session.kv_tokens, "kv_bytes": session.cache.held_bytes(),
        "tokens_seen": session.cache.length, "rss_bytes": current_rss(),
    }


def chat(engine: Engine, sampling: Sampling, turns: Iterable[str] | None = None, system: str | None = None,
         out: TextIO | None = None) -> list[dict]:
    """Talk: ``turns`` (a script) or, without it, lines typed at the terminal. Returns one stats dict per turn."""
    out = out or sys.stdout
    session = engine.session("chat")
    messages = [{"role": "system", "content": system}] if system else []
    history = []
    interactive = turns is None
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"sparsegen chat: {HELP}", file=out)
        turns = _typed()
    for line in turns:
        line = line.rstrip("\n")
        if line.strip() in ("/quit", "/exit"):
            break
        if line.strip() == "/reset":
            engine.reset(session)
            messages = messages[:1] if system else []
            print("[conversation reset]", file=out)
            continue
        if line.strip() == "/stats":
            last = history[-1] if history else {}
            print(f"[{session.turns} turns, {session.cache.length:,} tokens seen, {session.kv_tokens:,} KV "
                  f"tokens "
                  f"held ({session.cache.held_bytes() / 2**20:.2f} MiB), RSS {current_rss() / 2**20:.0f} MiB, last "
                  f"turn {last.get('tokens_per_s')} tokens/s]", file=out)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        if not interactive:
            print(f"User: {line}", file=out)
        print("Assistant: ", end="", file=out, flush=True)
        started = time.perf_counter()
        job = engine.begin(session, sampling, messages=messages,
                           on_text=lambda job, text: print(text, end="", file=out, flush=True))
        try:
            while not job.done:
                engine.step([job])
        except KeyboardInterrupt as interrupt:  # Ctrl-C: stop this reply, keep the conversation
            engine.recover([job], interrupt, reason="cancelled")  # mid-step, the cache is in doubt: start over
            print(" [interrupted]", end="", file=out)
            if not job.content:  # nothing answered: the question is not part of the conversation
                messages.pop()
                print(file=out, flush=True)
                continue
        print(file=out, flush=True)
        messages.append({"role": "assistant", "content": job.content})
        history.append(turn_stats(engine, session, job, time.perf_counter() - started))
    return history


def _typed():
    """Lines typed at the prompt: Ctrl-D ends, Ctrl-C at the prompt only clears the line (as in a shell)."""
    while True:
        try:
            yield input("> ")
        except EOFError:
            return
        except KeyboardInterrupt:
            print()
            yield ""
