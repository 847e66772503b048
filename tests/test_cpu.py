"""Thread fitting on a busy host (``fedlmc.scale.cpu``): busy cores are counted from the kernel's runnable
tasks, and the heavy steps run with no more torch threads than there are idle cores."""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from fedlmc.scale import cpu

SPIN = "while True: pass"


def test_busy_cores_counts_other_processes_runnable_threads(monkeypatch):
    monkeypatch.setattr(cpu, "_SAMPLE", {"at": -1e9, "busy": 0.0})
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(3)]
    try:
        time.sleep(0.5)
        busy = cpu.busy_cores(samples=9)
        assert busy >= 2, busy  # three spinning processes on any number of cores: most are runnable now
        assert cpu.idle_cores() == max(1, cpu.available_cores() - round(busy))
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_busy_cores_ignores_wake_ups_that_end_within_the_samples(monkeypatch):
    # right after a burst of its own parallel work a process sees more runnable tasks than its own for
    # a few milliseconds on an idle host; a core is busy only if another task stays runnable throughout
    monkeypatch.setattr(cpu, "_SAMPLE", {"at": -1e9, "busy": 0.0})
    runnable, own = iter([4, 3, 3, 1, 1]), iter([2, 1, 1, 1, 1])
    monkeypatch.setattr(cpu, "runnable_tasks", lambda: next(runnable))
    monkeypatch.setattr(cpu, "own_running", lambda: next(own))
    assert cpu.busy_cores(every=0.0) == 0.0  # a typical sample (the median, 2) would have said 2 busy cores
    monkeypatch.setattr(cpu, "_SAMPLE", {"at": -1e9, "busy": 0.0})
    runnable, own = iter([3, 4, 3, 3, 3]), iter([1, 2, 1, 1, 1])  # another process runnable throughout
    assert cpu.busy_cores(every=0.0) == 2.0
    monkeypatch.setattr(cpu, "runnable_tasks", lambda: None)  # no /proc/loadavg
    monkeypatch.setattr(cpu, "_SAMPLE", {"at": -1e9, "busy": 0.0})
    assert cpu.busy_cores() == 0.0


def test_fitting_threads_caps_torch_threads_at_the_idle_cores(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.setattr(cpu, "available_cores", lambda: 4)
        for busy, expected in ((0.0, 4), (1.0, 3), (3.0, 1), (9.0, 1)):
            monkeypatch.setattr(cpu, "busy_cores", lambda busy=busy: busy)
            with cpu.fitting_threads() as n:
                assert n == expected == torch.get_num_threads()
            assert torch.get_num_threads() == 4  # restored
        monkeypatch.setenv("FEDLMC_FIT_THREADS", "0")  # off: torch's own setting
        with cpu.fitting_threads() as n:
            assert n == 4
    finally:
        torch.set_num_threads(before)


def test_weight_matching_records_the_threads_it_ran_with(monkeypatch):
    from fedlmc.matching import weight_matching
    from fedlmc.models import from_preset

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(cpu, "busy_cores", lambda: 8.0)
        kw = dict(n_layer=1, d_model=16, n_head=2, d_ff=32, image_size=8, patch_size=4)
        T = weight_matching(from_preset("vit-tiny", **kw), from_preset("vit-tiny", **kw))
        assert T.info["threads"] == 1 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
