"""Let a long-lived aggregation process keep the memory it frees (glibc's malloc), instead of handing
every large block back to the kernel and faulting it in again on the next allocation.

A matching iteration at gpt2-small size allocates and frees a few hundred MB of temporaries. By
default glibc serves each large block with a fresh ``mmap`` and returns freed heap tops to the kernel
(``M_TRIM_THRESHOLD``), so every iteration pays page faults for memory it has just released.
Raising the thresholds keeps those pages mapped for reuse. The process's resident size then stays at
its peak rather than shrinking between rounds, which is what a server holding M replies does anyway.

Called by fedlmc's own entry points (the ServerApp, the ``fedlmc`` CLI, the benches); a library user
may call it in theirs. A no-op (returning False) on other C libraries and platforms.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Optional

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_MAX_THRESHOLD = 32 << 20  # glibc refuses larger mmap thresholds on 64-bit


@functools.cache
def libc() -> Optional[ctypes.CDLL]:
    """The C library, through ctypes (a call lets the GIL go), on Linux; None elsewhere or where it
    cannot be loaded. Shared by the calls here and ``replies``' prefetch (``mmap``, ``madvise``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.cache
def retain_freed_memory() -> bool:
    """Raise glibc's trim, top-pad and mmap thresholds for this process; whether it applied."""
    mallopt = getattr(libc(), "mallopt", None)  # musl and others have no mallopt
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(
        [
            mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX_THRESHOLD) == 1,
            mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1,
            mallopt(_M_TOP_PAD, 256 << 20) == 1,
        ]
    )


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel now (glibc's ``malloc_trim``); whether it applied.

    With ``retain_freed_memory`` the heap keeps a matching's temporaries for reuse, but the next block of
    allocations of other sizes (a universe's average after its matchings) cannot always fit into their
    holes and grows the heap instead: at gpt2-small size that put the 8-model universe's peak about 1.2
    models above its live memory. Called once before such a phase, it costs one pass over the heap and
    the page faults of re-touching what was returned.
    """
    trim = getattr(libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
