"""How many cores the heavy steps may use: the cores this process is allowed, less those other processes
are busy on right now.

torch's CPU kernels run in OpenMP thread teams whose threads spin-wait for each other at the end of
every parallel region. On a host where other processes keep the cores busy, a team of two threads on
two cores loses each region's last thread to the scheduler while the first spins, and alignment, made
of many small parallel products, slows down far more than one large GEMM does. ``fitting_threads``
runs a block with no more torch threads than there are idle cores (at least one), so a busy host
slows an alignment about as much as it slows everything else.
"""

from __future__ import annotations

import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

_SAMPLE: dict[str, float] = {"at": -1e9, "busy": 0.0}
SAMPLE_SECONDS = 2.0  # a count of busy cores is reused this long


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else ``platform.processor()`` (empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def available_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota when one is set."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            n = min(n, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


def busy_cores(samples: int = 5, every: float = 0.005) -> float:
    """Runnable threads of *other* processes now: the kernel's count of runnable tasks
    (``/proc/loadavg``'s fourth field, which includes the thread asking) less this process's own
    runnable threads read beside it, the least of a few samples taken ``every`` seconds apart. The
    least, not a typical one: a process busy on a core stays runnable through the samples, while the
    wake-ups that follow a burst of this process's own parallel work (its OpenMP threads winding
    down, short-lived tasks it woke) last a few milliseconds, and would count as a busy core on an
    idle host. 0 where it cannot be read."""
    now = time.monotonic()
    if now - _SAMPLE["at"] < SAMPLE_SECONDS:
        return _SAMPLE["busy"]
    counts = []
    for k in range(samples):
        runnable = runnable_tasks()
        if runnable is None:
            return 0.0
        counts.append(runnable - own_running())
        if k + 1 < samples:
            time.sleep(every)
    busy = float(max(0, min(counts)))
    _SAMPLE.update(at=now, busy=busy)
    return busy


def runnable_tasks() -> Optional[int]:
    """The kernel's count of runnable tasks (``/proc/loadavg``'s fourth field); None where it cannot be read."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def own_running() -> int:
    """This process's threads that are runnable now (state R), the asking thread included."""
    n = 0
    try:
        for task in Path("/proc/self/task").iterdir():
            try:
                if (task / "stat").read_text().rsplit(") ", 1)[1][0] == "R":
                    n += 1
            except (OSError, IndexError):
                pass
    except OSError:
        return 1
    return max(1, n)


def idle_cores() -> int:
    """Cores of ``available_cores`` that no other process is busy on (at least one)."""
    return max(1, available_cores() - round(busy_cores()))


@contextmanager
def fitting_threads() -> Iterator[int]:
    """Inside the block, torch uses at most as many threads as there are idle cores (never more than it
    was set to, at least one); restored after it. Yields the count in force. ``FEDLMC_FIT_THREADS=0``
    in the environment turns it off."""
    before = torch.get_num_threads()
    if before > 1 and os.environ.get("FEDLMC_FIT_THREADS", "1") != "0":
        torch.set_num_threads(min(before, idle_cores()))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
