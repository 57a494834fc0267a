"""Sessions that outlive their process: after each turn a session's evicted cache is snapshotted to a folder every
replica reads (one machine's disk, or a shared one on a cluster), so that when its replica is gone (killed,
drained, scaled down) the next turn continues on another replica from the same cache, bit-exact, instead of
re-encoding the history into a different one.

A snapshot is a ``CompressedContext`` of the session's cache (its held slots, positions, scores and memo, the
model's fingerprint) with the session's text, its pending reply token and its turn count. Writes go to a
background thread (the engine thread only copies the slots) and are atomic; the folder is bounded by bytes, the
least recently written snapshots deleted first. A snapshot is used only when its session's text is the start of
the request's, so a stale one (the session moved on elsewhere) is never restored.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsegen.engine.context import CompressedContext
from sparsegen.engine.session import Session
from sparsegen.kv import Policy


@dataclass
class Snapshot:
    context: CompressedContext  # the session's cache as it was after the turn
    pending: list[int]  # the last reply token, not yet in the cache (fed with the next turn)
    turns: int

    @property
    def text(self) -> str:
        return self.context.text


class SessionStore:
    def __init__(self, folder: str | Path, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"the session store's size must be at least 1 byte, got {max_bytes}")
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sparsegen-session-store")
        self._lock = threading.Lock()
        self.counters = {"written": 0, "written_bytes": 0, "restored": 0, "restored_bytes": 0, "dropped": 0}

    def _path(self, session_id: str) -> Path:
        return self.folder / f"{hashlib.sha256(session_id.encode()).hexdigest()[:32]}.safetensors"

    def keep(self, session: Session, model: torch.nn.Module) -> None:
        """After a turn: snapshot a named session's cache now (a copy of its held slots), write it in the
        background."""
        if session.id is None or session.cache.seen is None:
            return
        context = CompressedContext.of(model, session.cache, torch.zeros(0, dtype=torch.long), session.text)
        context.meta["session"] = {"pending": list(session.pending), "turns": session.turns}
        self._writer.submit(self._write, session.id, context)

    def _write(self, session_id: str, context: CompressedContext) -> None:
        path = context.save(self._path(session_id))
        with self._lock:
            self.counters["written"] += 1
            self.counters["written_bytes"] += path.stat().st_size
            self._bound()

    def _bound(self) -> None:
        files = sorted(self.folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files[:-1]:  # (the newest stays, whatever its size)
            if total <= self.max_bytes:
                break
            total -= path.stat().st_size
            path.unlink(missing_ok=True)
            self.counters["dropped"] += 1

    def get(self, session_id: str, model: torch.nn.Module) -> Snapshot | None:
        """The session's last snapshot, checked against ``model`` (None if there is none; a damaged or foreign one
        is deleted and counts as none: the session is then re-encoded)."""
        path = self._path(session_id)
        if not path.is_file():
            return None
        try:
            context = CompressedContext.load(path, model)
            session = context.meta["session"]
            snapshot = Snapshot(context, [int(t) for t in session["pending"]], int(session["turns"]))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            path.unlink(missing_ok=True)
            return None
        with self._lock:
            self.counters["restored"] += 1
            self.counters["restored_bytes"] += path.stat().st_size
        return snapshot

    def restore(self, session: Session, model: torch.nn.Module, policy: Policy, max_length: int | None) -> bool:
        """Fill ``session``, which holds nothing yet, from its snapshot if one was written (by this process before
        it dropped the session, or by another replica) under ``policy``: whether one was."""
        snapshot = self.get(session.id, model)
        if snapshot is None:
            return False
        try:
            cache = snapshot.context.cache(model, policy, check=False, max_length=max_length)
        except ValueError:  # (written under another policy: the session is re-encoded)
            return False
        session.release()
        session.cache, session.text, session.pending, session.turns = (cache, snapshot.text, snapshot.pending,
                                                                       snapshot.turns)
        return True

    def flush(self) -> None:
        """Wait for the writes already asked for (a replica that drains writes its sessions' last turns out)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)
