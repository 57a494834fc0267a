"""Freed memory kept in the process for a while, so that large buffers are not paged in anew each time.

glibc's ``malloc`` returns every freed buffer of over 32 MiB to the kernel (it was ``mmap``-ed), so the next one is
paged in again and zeroed by the kernel, one page fault per 4 KiB. A one-pass prefill that scores attention (SnapKV,
H2O, Ada-KV ... over a 4K context, as RULER's ``context`` and ``query-aware`` protocols run it) allocates and frees
``[heads, tokens, tokens]`` fp32 matrices in every layer: on SmolLM2 at 4,096 tokens that was 53 s a prefill, 43 of
them spent in the kernel. With the buffers reused it is 25 s (measured on this 2-core machine)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_KEEP = 2**31 - 1  # the largest value mallopt takes (an int): buffers under 2 GiB come from the heap, and stay
_GLIBC_CEILING = 32 << 20  # where glibc's own sliding threshold stops once large buffers have been freed


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@contextlib.contextmanager
def reusing_freed_memory() -> Iterator[None]:
    """Inside: freed buffers under 2 GiB stay in the process for the next allocation. After: glibc's thresholds as its
    sliding rule leaves them after large buffers (32 MiB to map, 64 MiB to trim), and the freed memory handed back
    to the kernel (``malloc_trim``). Process-wide; does nothing where the C library is not glibc. The command line
    runs every command in it but ``bench`` and ``bench-serve`` (their memory peaks must not hold what an earlier row
    freed) and ``serve``."""
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _KEEP)
    libc.mallopt(_M_TRIM_THRESHOLD, _KEEP)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_CEILING)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _GLIBC_CEILING)
        libc.malloc_trim(0)
