"""What the speed benches write beside their figures: where they ran (device, torch threads, CPU,
torch version), and the JSON file itself."""

from __future__ import annotations

import platform
import threading
import time
from pathlib import Path

import psutil
import torch

from fedlmc import provenance
from fedlmc.scale.cpu import cpu_model
from fedlmc.train import pick_device

provenance.watch()  # every bench imports this module first: the load is sampled through the whole run


def environment() -> dict:
    """The device a fedlmc path picks here, torch's threads, the machine and processor, torch's version."""
    return {
        "device": str(pick_device()),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor() or cpu_model(),
        "torch": torch.__version__,
    }


def write_results(path: str | Path, res: dict, seeds=None) -> Path:
    """Write ``res`` as JSON to ``path`` (its folder made if needed) with its provenance record
    (``fedlmc.provenance``; ``seeds``: default, those ``res`` names); returns the path."""
    out = provenance.write(path, res, seeds)
    print(f"wrote {out}")
    return out


class PeakMemory:
    """Peak resident memory (bytes) while the block runs, sampled in a thread every ``every`` seconds:
    ``peak`` of this process, ``tree`` of it and its child processes (workers), ``start`` before."""

    def __init__(self, every: float = 0.02) -> None:
        self.every = every

    def __enter__(self) -> "PeakMemory":
        self.me = psutil.Process()
        self.start = self.me.memory_info().rss
        self.peak = self.tree = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                own = self.me.memory_info().rss
                kids = sum(c.memory_info().rss for c in self.me.children(recursive=True))
            except psutil.Error:
                continue
            self.peak, self.tree = max(self.peak, own), max(self.tree, own + kids)
            time.sleep(self.every)


BURN = """
import sys, time, torch
torch.set_num_threads(1)
a = torch.randn(512, 512)
while True:
    a @ a
"""


class Burners:
    """``n`` CPU-bound competitors (each a 1-thread fp32 GEMM loop in its own process) while the block
    runs: the busy host a measurement is taken beside. Stopped (killed) on exit, whatever happened."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list = []

    def __enter__(self) -> "Burners":
        import subprocess
        import sys

        self.procs = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(timeout=30)


def gemm_seconds() -> float:
    """A fixed float32 GEMM (2048², 10 products) with torch's current threads, median of 3: the
    reference a timing taken in the same run is divided by (a busy host slows both)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]
