"""Admission by K/V memory (``sparsegen serve --kv-memory``): the number of live conversations is set by what their
caches hold, so a policy that holds less serves more of them in the same memory (H2O's serving claim).

Every live session reserves a fixed amount: its cache at its policy's full allocation (a bounded policy's budget
plus one prefill chunk; ``full``: ``--max-context`` tokens). While it decodes with others its row lives in the stacked
decode batch instead (the budget plus the new token), its own slots let go (``sparsegen.kv.rows.park``), and the batch's
storage holds its present rows only, so a conversation is held once. (For a moment while a row joins or leaves, one
layer's batch storage exists twice: a thirtieth of the batch on a 30-layer model.) A request whose session
is not live is admitted only if its reservation fits beside the others'; otherwise the least recently used idle
session that has been idle for ``idle_grace`` seconds is dropped to make room (its cache freed; its next request
re-encodes the history, and the reply says so in ``X-Session-History: reencoded``), and if none can be dropped the
request waits in the queue (bounded: 429 beyond). Reservations are upper bounds of what the caches allocate, so
the K/V bytes allocated never exceed the cap (``/metrics``: ``kv_bytes`` under ``kv_memory_bytes``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparsegen.kv import EvictionCache, KVQuantization


@dataclass
class KVMemory:
    cap: int  # bytes
    per_session: int  # one session's cache at its full allocation (its row in a decode batch is no larger)
    idle_grace: float = 2.0  # seconds an idle session is safe from being dropped for another
    live: dict[int, object] = field(default_factory=dict)  # id(session) -> its Session, in order of admission

    @classmethod
    def plan(cls, cache: EvictionCache, per_token: int, per_row: int, cap: int, idle_grace: float = 2.0) -> KVMemory:
        """The reservation of one session whose cache is built as ``cache`` (empty: a cache allocates nothing until
        fed), at ``per_token`` bytes a token over all layers and ``per_row`` besides; refuses a cap that holds none."""
        if cap < 1 or idle_grace < 0:
            raise ValueError("kv_memory must be a positive number of bytes and idle_grace >= 0")
        if cache.policy.shares_slots:
            raise ValueError(f"--kv-memory cannot size {cache.policy.name!r}'s per-head budgets in advance: use a "
                             "policy whose heads hold the same number of tokens")
        # each layer's most slots: its policy's budget and a chunk (a sliding-window layer: its window), or
        # --max-context under full; a stacked batch row holds no more than that
        slots = sum(layer.most_slots(cache.chunk_size) for layer in cache.layers)
        memory = cls(cap, slots * per_token // len(cache.layers) + 2 * per_row, idle_grace)  # row state: in both
        if memory.per_session > cap:
            raise ValueError(f"--kv-memory {cap / 2**20:,.1f} MiB holds no session: one needs "
                             f"{memory.per_session / 2**20:,.1f} MiB under {cache.policy.name}; raise it, lower the "
                             "budget or --max-context, or add --kv-bits")
        return memory

    @property
    def most_live(self) -> int:
        return self.cap // self.per_session

    @property
    def reserved(self) -> int:
        return len(self.live) * self.per_session

    def admit(self, session, drop: Callable[[object], None]) -> bool:
        """Make ``session`` live if it is not: ``drop`` idle sessions least recently used first (only those idle for
        ``idle_grace``) until its reservation fits. False: it must wait."""
        if id(session) in self.live:
            return True
        now = time.monotonic()
        while self.reserved + self.per_session > self.cap:
            idle = [s for s in self.live.values()
                    if not s.busy and s.id is not None and now - s.idle_since >= self.idle_grace]
            if not idle:
                return False
            dropped = min(idle, key=lambda s: s.idle_since)
            self.leave(dropped)
            drop(dropped)
        self.live[id(session)] = session
        return True

    def leave(self, session) -> None:
        self.live.pop(id(session), None)

    def metrics(self) -> dict:
        return {"kv_memory_bytes": self.cap, "kv_bytes_reserved": self.reserved,
                "kv_bytes_free": self.cap - self.reserved, "live_sessions": len(self.live),
                "most_live_sessions": self.most_live}


def kv_costs(model: torch.nn.Module, quantization: KVQuantization | None) -> tuple[int, int]:
    """K/V bytes of one token over all layers, and of one sequence besides its tokens (a quantized cache's scales and
    residual), at the model's dtype and ``quantization``."""
    from sparsegen.models.spec import kv_bytes_per_sequence, kv_bytes_per_token

    element = next(model.parameters()).element_size()
    return (kv_bytes_per_token(model.config, element, quantization),
            kv_bytes_per_sequence(model.config, element, quantization))
