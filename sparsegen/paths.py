"""Where sparsegen keeps what it builds once per machine (importing nothing heavy: ``sparsegen/__init__`` uses it
first)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPARSEGEN_CACHE"
COMPILE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # inductor's compile cache


def cache_root() -> Path:
    """Where converted checkpoints, assembled GGUF files and compiled steps live: ``$SPARSEGEN_CACHE`` or
    ``~/.cache/sparsegen``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sparsegen")


def use_compile_cache() -> str:
    """Inductor's compile cache: ``$TORCHINDUCTOR_CACHE_DIR`` if set, else ``cache_root() / "inductor"`` (not
    ``/tmp``, so a compile is paid once per machine and shape, not once per boot). Set before ``torch._dynamo`` is
    imported: its import fixes the folder for the process."""
    return os.environ.setdefault(COMPILE_ENV, str(cache_root() / "inductor"))
