"""The process's memory and the C library: freed memory kept in the process for a while, so that large buffers are
not paged in anew each time (``reusing_freed_memory``), and memory the process no longer needs handed back to the
kernel: the heap's freed memory (``release_freed_memory``) and the pages under a tensor (``page_out``).

glibc's ``malloc`` returns every freed buffer of over 32 MiB to the kernel (it was ``mmap``-ed), so the next one is
paged in again and zeroed by the kernel, one page fault per 4 KiB. A one-pass prefill that scores attention (SnapKV,
H2O, Ada-KV ... over a 4K context, as RULER's ``context`` and ``query-aware`` protocols run it) allocates and frees
``[heads, tokens, tokens]`` fp32 matrices in every layer: on SmolLM2 at 4,096 tokens that was 53 s a prefill, 43 of
them spent in the kernel. With the buffers reused it is 25 s (measured on this 2-core machine)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import sys
from collections.abc import Iterator

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_KEEP = 2**31 - 1  # the largest value mallopt takes (an int): buffers under 2 GiB come from the heap, and stay
_GLIBC_CEILING = 32 << 20  # where glibc's own sliding threshold stops once large buffers have been freed


MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (file-backed ones are dropped and read again if touched)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library (Linux only), its ``madvise`` typed."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def _glibc() -> ctypes.CDLL | None:
    libc = _libc()
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


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


def release_freed_memory() -> bool:
    """Hand the memory the C heap holds freed back to the kernel (glibc's ``malloc_trim``; elsewhere nothing):
    packing frees each linear's fp32 temporaries, which glibc keeps resident for reuse, and the process's peak then
    carries them through every later step (Gemma-3-270M's generate peaked at 1,345 MiB without this, 968 with it,
    measured). Whether anything was released."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def page_out(tensor: torch.Tensor) -> bool:
    """Ask the kernel to reclaim the whole pages under ``tensor``'s bytes (Linux; elsewhere nothing): a weight read
    from a memory-mapped checkpoint stays resident as long as the mapping lives, and a model that no longer needs it
    (packed into low-bit codes) should not pay for it (SmolLM2 int4: the load's peak). Never loses data: a clean file
    page is read again if touched, and memory with nowhere to go (anonymous, no swap) stays. Whether it was asked."""
    libc = _libc()
    if libc is None or tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous():
        return False
    start = tensor.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    return last > first and libc.madvise(first, last - first, MADV_PAGEOUT) == 0
