"""Benchmark: what share of a federated round the server's aggregation takes.

    python bench/round_share.py [--preset gpt2-tiny] [--clients 4] [--local-steps 200] [--rounds 3]

Runs one multi-round federation per strategy (aligned, refined) on the Ray simulation engine, each in
its own process, and reads the ServerApp's per-round record: the round's wall time (clients' training
included) and the strategy's aggregation seconds. Writes results/bench_round_share_<preset>.json.
Targets: aligned ≤ 10 %, refined ≤ 25 % of the round; ``met`` asks it of every round (the
median, the whole federation's share and the worst round are all written).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from pathlib import Path

from _results import write_results  # noqa: E402  (bench/, the script's own folder)

from simulations.simulate import run_in_subprocess

TARGETS = {"aligned": 0.10, "refined": 0.25}


def shares(doc: dict) -> list[dict]:
    """Per round (from round 1): round seconds, aggregation seconds, and their ratio."""
    out = []
    for r in doc["rounds"]:
        if r["round"] < 1:
            continue
        rec = r.get("strategy", {})
        agg = float(rec.get("seconds", rec.get("align_seconds", 0.0)))
        out.append(
            {
                "round": r["round"],
                "round_seconds": round(r["round_seconds"], 2),
                "aggregation_seconds": round(agg, 2),
                "share": round(agg / r["round_seconds"], 4),
                **{k: rec[k] for k in ("refine_steps_run", "refine_best_step") if k in rec},
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-tiny")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--local-steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--strategies", nargs="+", default=["aligned", "refined"])
    p.add_argument(
        "--aggregate-threads",
        type=int,
        default=0,
        help="torch threads while the server combines (0: every core: the clients wait; -1: the app's one)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res = {
        "preset": args.preset,
        "clients": args.clients,
        "local_steps": args.local_steps,
        "rounds": args.rounds,
        "aggregate_threads": args.aggregate_threads,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "targets": TARGETS,
        "runs": {},
    }
    for strategy in args.strategies:
        with tempfile.TemporaryDirectory() as tmp:
            settings = {
                "strategy": strategy,
                "preset": args.preset,
                "num-server-rounds": args.rounds,
                "local-steps": args.local_steps,
                "independent-start": False,
                "min-nodes": args.clients,
                "out-dir": str(Path(tmp) / "run"),
                "seed": 0,
                "aggregate-threads": args.aggregate_threads,
            }
            doc = run_in_subprocess(settings, num_supernodes=args.clients, timeout=3600, log_path=Path(tmp) / "log.txt")
        rows = shares(doc)
        med = statistics.median(r["share"] for r in rows)
        # the whole federation's share too: a costly first round hides behind a median of cheap ones
        total = round(sum(r["aggregation_seconds"] for r in rows) / sum(r["round_seconds"] for r in rows), 4)
        worst = max(r["share"] for r in rows)
        target = TARGETS.get(strategy, 1.0)
        res["runs"][strategy] = {
            "rounds": rows,
            "median_share": med,
            "total_share": total,
            "max_share": worst,
            "target_share": target,
            "met": worst <= target,
        }
        print(
            f"{strategy}: share of the round median {med:.1%}, all rounds {total:.1%}, worst {worst:.1%} "
            f"(target {target:.0%}, every round); "
            + ", ".join(f"r{r['round']} {r['aggregation_seconds']:.1f}/{r['round_seconds']:.1f} s" for r in rows),
            flush=True,
        )
    write_results(args.out or f"results/bench_round_share_{args.preset}.json", res)


if __name__ == "__main__":
    main()
