"""The main job (``make run``: the app's default run_config) on several seeds, and its picture.

    python simulations/main_job.py [--seeds 0 1 2] [--runs runs/main_job]

Each seed is ``make run``'s command, ``fedlmc run . --federation-config "client-resources-num-cpus=1"
-c "seed=S out-dir=RUNS/sS"`` (a seed whose ``summary.json`` is already
there is reused). Writes ``results/main_job.json`` (per seed and strategy: test loss, accuracy,
aggregation seconds; the clients' own mean; the run's wall seconds) and ``results/main_job.png``
(each strategy's excess over the clients' own mean, per seed and on average). Exits 1 unless, on every
seed, aligned ends at least ``MAIN_JOB_MARGIN`` below FedAvg in test loss: the README's claim (the
slow test ``test_the_main_job_shows_alignment_beating_fedavg`` checks it on seed 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from fedlmc import provenance

ROOT = Path(__file__).resolve().parents[1]
# The README's claim about the main job: aligned aggregation of the same two replies ends at least this
# much lower in test loss than FedAvg's, on every seed.
MAIN_JOB_MARGIN = 0.25


def run_seed(seed: int, out: Path, timeout: float) -> float:
    """One main job; returns its wall seconds. A finished run of this very code is reused (its
    ``code.sha256`` is ``provenance.code_hash`` of the federation's code) and named in the record."""
    wall, made_by = out / "wall_seconds.txt", out / "code.sha256"
    code = provenance.code_hash(provenance.FEDERATION_CODE)
    if (out / "summary.json").is_file() and wall.is_file() and made_by.is_file() and made_by.read_text() == code:
        provenance.reused(out)
        return float(wall.read_text())
    t0 = time.time()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fedlmc.flower.launch",
            ".",
            "--federation-config",
            "client-resources-num-cpus=1",
            "-c",
            f"seed={seed} out-dir='{out.resolve()}'",
        ],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=timeout,
    )
    wall.write_text(f"{time.time() - t0:.1f}")
    made_by.write_text(code)
    return time.time() - t0


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["mean"])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(
        names,
        [doc["mean"][n]["excess"] for n in names],
        color=["#9e9e9e" if n == "average" else "#1f77b4" for n in names],
        alpha=0.8,
    )
    for i, n in enumerate(names):
        per_seed = [s["strategies"][n]["test_loss"] - s["mean_client_test_loss"] for s in doc["seeds"].values()]
        ax.plot([i] * len(per_seed), per_seed, "ko", ms=4)
    ax.axhline(0, color="k", lw=0.8)
    ax.set(
        ylabel="test loss − the clients' own mean",
        title=f"{doc['preset']}: 2 independently trained clients, {len(doc['seeds'])} seeds",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    provenance.watch()  # samples the load through the run, for the results file's record
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--runs", default="runs/main_job", help="one run directory per seed (reused when complete)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="results/main_job")
    args = p.parse_args()
    seeds, walls = {}, {}
    for seed in args.seeds:
        out = Path(args.runs) / f"s{seed}"
        walls[seed] = run_seed(seed, out, args.timeout)
        seeds[seed] = json.loads((out / "summary.json").read_text())
    first = next(iter(seeds.values()))
    names = list(first["strategies"])
    mean = {
        n: {
            k: sum(s["strategies"][n][k] for s in seeds.values()) / len(seeds)
            for k in ("test_loss", "test_acc", "aggregation_seconds")
        }
        for n in names
    }
    clients = sum(s["mean_client_test_loss"] for s in seeds.values()) / len(seeds)
    for n in names:
        mean[n]["excess"] = mean[n]["test_loss"] - clients
        mean[n]["excess_ratio_to_average"] = sum(
            (s["strategies"][n]["test_loss"] - s["mean_client_test_loss"])
            / (s["strategies"]["average"]["test_loss"] - s["mean_client_test_loss"])
            for s in seeds.values()
        ) / len(seeds)
    doc = {
        "preset": first["settings"]["preset"],
        "settings": first["settings"],
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "mean_client_test_loss": clients,
        "mean": mean,
        "wall_seconds": walls,
        "seeds": seeds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    provenance.write(args.out + ".json", doc)
    plot(doc, Path(args.out + ".png"))
    for n in names:
        print(
            f"{n:8s} test loss {mean[n]['test_loss']:.4f}  excess {mean[n]['excess']:+.4f} "
            f"({mean[n]['excess_ratio_to_average']:.3f}× FedAvg's)  aggregation {mean[n]['aggregation_seconds']:.1f} s"
        )
    print(f"wrote {args.out}.json and {args.out}.png")
    missed = [
        seed
        for seed, s in seeds.items()
        if not s["strategies"]["aligned"]["test_loss"] < s["strategies"]["average"]["test_loss"] - MAIN_JOB_MARGIN
    ]
    if missed:
        print(f"aligned did not beat FedAvg by {MAIN_JOB_MARGIN} on seeds {missed}", file=sys.stderr)
        return 1
    print(f"aligned beat FedAvg by at least {MAIN_JOB_MARGIN} on every seed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
