"""Thread fitting on a busy host (``fedlmc.cpu``): busy cores are counted from the kernel's runnable
tasks, and the heavy steps run with no more torch threads than there are idle cores."""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from fedlmc import cpu

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


def test_the_performance_page_gives_the_busy_host_benchs_table():
    """The performance page's busy-host table is ``results/bench_load.json`` (median fitted seconds, one
    unfitted run, the threads each ran with, slowdowns against the idle run and against the GEMM
    reference's), and the sentences under it quote the ranges those rows span."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = json.loads((root / "results" / "bench_load.json").read_text())
    page = (root / "docs" / "performance.md").read_text()
    prose = " ".join(page.split())
    runs = {r["competitors"]: r for r in doc["runs"]}
    assert sorted(runs) == [0, 2, 4]

    def threads(ts) -> str:
        lo, hi = min(ts), max(ts)
        return f"{lo} thread" if lo == hi == 1 else f"{lo} threads" if lo == hi else f"{lo}–{hi} threads"

    idle = runs[0]
    for r in runs.values():
        for key in ("pair", "universe"):
            assert sorted(r[f"{key}_fitted_all"])[1] == round(r[f"{key}_fitted_seconds"], 2)  # the median of 3
    gemm = (idle["gemm_seconds"] + idle["gemm_seconds_after"]) / 2
    assert (
        f"| 0 | 1 ({gemm:.2f} s) | {idle['pair_fitted_seconds']:.1f} s, {threads(idle['pair_fitted_threads'])} | "
        f"{idle['pair_unfitted_seconds']:.1f} s | {idle['universe_fitted_seconds']:.1f} s, "
        f"{threads(idle['universe_fitted_threads'])} | {idle['universe_unfitted_seconds']:.1f} s |"
    ) in page

    def cell(r: dict, key: str, bold: bool) -> str:
        per = f"{r[key + '_slowdown_per_gemm']:.2f} × GEMM's"
        return f"{r[key + '_seconds']:.1f} s: {r[key + '_slowdown']:.2f}×, " + (f"**{per}**" if bold else per)

    for n in (2, 4):
        r = runs[n]
        cells = [f"{n}", f"{r['gemm_slowdown']:.2f}×"]
        cells += [
            f"{cell(r, 'pair_fitted', True)}, {threads(r['pair_fitted_threads'])}",
            cell(r, "pair_unfitted", False),
        ]
        cells += [f"{cell(r, 'universe_fitted', True)}, {threads(r['universe_fitted_threads'])}"]
        assert "| " + " | ".join(cells + [cell(r, "universe_unfitted", False)]) + " |" in page

    def span(keys: tuple[str, ...]) -> str:
        v = [runs[n][f"{k}_slowdown_per_gemm"] for n in (2, 4) for k in keys]
        return f"{min(v):.2f}–{max(v):.2f}"

    fitted = span(("pair_fitted", "universe_fitted"))
    assert f"({fitted} times the GEMM's slowdown; the target is within 2×)" in prose
    assert max(runs[n][f"{k}_fitted_slowdown_per_gemm"] for n in (2, 4) for k in ("pair", "universe")) < 2
    assert (
        f"the universe slows {span(('universe_unfitted',))}× and the pair {span(('pair_unfitted',))}× the GEMM's"
        in prose
    )
    busy = [t for n in (2, 4) for k in ("pair", "universe") for t in runs[n][f"{k}_fitted_threads"]]
    assert "each alignment sees the busy cores and runs on one thread" in prose and set(busy) == {1}
    idle_threads = {
        t for k in ("pair", "universe") for t in idle[f"{k}_fitted_threads"] + [idle[f"{k}_unfitted_threads"]]
    }
    assert "Idle, fitting changes nothing: both modes use 2 threads" in prose and idle_threads == {2}
    gaps = [
        f"{idle[k + '_fitted_seconds']:.1f} against {idle[k + '_unfitted_seconds']:.1f} s" for k in ("pair", "universe")
    ]
    assert f"the idle columns' gaps, {gaps[0]} and {gaps[1]}, are one unfitted run" in prose
