"""Benchmark: aggregation on a busy host. An independent gpt2-small pair's weight matching and a universe of
8 gpt2-small-shaped models (``--universe-layers`` layers, 2 iterations), timed idle and beside 2 and 4
competing CPU-bound processes (each a 1-thread fp32 GEMM loop), with a fixed GEMM reference timed in
the same run. Each is timed with fedlmc's thread fitting (``fedlmc.scale.cpu.fitting_threads``: no more
torch threads than idle cores; median of ``--repeats``) and without it (``FEDLMC_FIT_THREADS=0``:
torch's default team on every core, once).

Writes ``results/bench_load.json``: per condition and mode, seconds and threads; each one's slowdown
against the idle run of the same mode, beside the GEMM reference's slowdown.

    python simulations/busy_host.py [--competitors 0 2 4] [--repeats 3] [--universe-layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _results import Burners, environment, gemm_seconds, write_results  # noqa: E402  (simulations/'s own folder)
from universe_gpt2_small import noisy_copy  # noqa: E402
from wm_gpt2_small import pair  # noqa: E402

from fedlmc.matching import weight_matching
from fedlmc.merging.universe import universe_merge
from fedlmc.options import Universe
from fedlmc.scale.allocator import retain_freed_memory
from fedlmc.scale.cpu import SAMPLE_SECONDS


def timed(fn, fit: bool) -> tuple[float, int]:
    """Seconds of ``fn()`` with thread fitting on or off, and the threads it ran with."""
    os.environ["FEDLMC_FIT_THREADS"] = "1" if fit else "0"
    time.sleep(SAMPLE_SECONDS)  # a fresh count of busy cores
    t0 = time.perf_counter()
    threads = fn()
    return time.perf_counter() - t0, threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--competitors", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--universe-layers", type=int, default=4)
    p.add_argument("--out", default="results/bench_load.json")
    args = p.parse_args()
    retain_freed_memory()
    _, ca, b, *_ = pair(12)
    copies = [noisy_copy(args.universe_layers, s) for s in range(8)]

    def run_pair() -> int:
        return weight_matching(ca, b).info["threads"]

    def run_universe() -> int:
        _, Ts = universe_merge(copies, universe=Universe(iterations=2, keep_layernorm=False))
        return max(T.info.get("threads", 1) for T in Ts[1:])

    res = {
        **environment(),
        "what": f"independent gpt2-small pair (12 layers); universe of 8 gpt2-small-shaped models "
        f"({args.universe_layers} layers, 2 iterations); competitors: 1-thread fp32 GEMM loops",
        "cores": os.cpu_count(),
        "runs": [],
    }
    for n in args.competitors:
        with Burners(n):
            time.sleep(3)
            row: dict = {"competitors": n, "gemm_seconds": gemm_seconds()}
            for name, fn in (("pair", run_pair), ("universe", run_universe)):
                fitted = [timed(fn, True) for _ in range(args.repeats)]
                row[f"{name}_fitted_seconds"] = statistics.median(s for s, _ in fitted)
                row[f"{name}_fitted_all"] = [round(s, 2) for s, _ in fitted]
                row[f"{name}_fitted_threads"] = [t for _, t in fitted]
                s, t = timed(fn, False)
                row[f"{name}_unfitted_seconds"], row[f"{name}_unfitted_threads"] = s, t
                print(f"{n} competitors: {name} fitted {row[f'{name}_fitted_all']} s, unfitted {s:.1f} s", flush=True)
            row["gemm_seconds_after"] = gemm_seconds()
        res["runs"].append(row)
        write_results(args.out, res)
    idle = next((r for r in res["runs"] if r["competitors"] == 0), None)
    if idle is not None:
        for r in res["runs"]:
            g = (r["gemm_seconds"] + r["gemm_seconds_after"]) / (idle["gemm_seconds"] + idle["gemm_seconds_after"])
            r["gemm_slowdown"] = g
            for key in ("pair_fitted", "pair_unfitted", "universe_fitted", "universe_unfitted"):
                r[f"{key}_slowdown"] = r[f"{key}_seconds"] / idle[f"{key}_seconds"]
                r[f"{key}_slowdown_per_gemm"] = r[f"{key}_slowdown"] / g
    res["torch_threads"] = torch.get_num_threads()
    write_results(args.out, res)


if __name__ == "__main__":
    main()
