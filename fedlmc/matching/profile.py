"""Where matching spends its time: named sections, accumulated only inside ``profiling()``.

Outside ``profiling()`` a section costs one global lookup, so the steps stay instrumented in
production. On CUDA a section synchronises before reading the clock (kernels are asynchronous), which
is why it is off by default.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

_totals: Optional[defaultdict] = None
_lock = threading.Lock()  # assignment solves run in a worker thread beside the matrix products


@contextmanager
def section(name: str) -> Iterator[None]:
    """Add the wall time of the block to ``name`` when profiling is on."""
    if _totals is None:
        yield
        return
    _sync()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _sync()
        with _lock:
            if _totals is not None:
                _totals[name] += time.perf_counter() - t0


@contextmanager
def profiling() -> Iterator[dict[str, float]]:
    """Collect section times (seconds, summed over calls) into the yielded dict."""
    global _totals
    outer, _totals = _totals, defaultdict(float)
    out: dict[str, float] = {}
    try:
        yield out
    finally:
        out.update({k: round(v, 3) for k, v in sorted(_totals.items(), key=lambda kv: -kv[1])})
        _totals = outer


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
