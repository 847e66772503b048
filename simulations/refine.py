"""Dirichlet refinement as a federation runs it: how long one takes, what it does round by round, and
what share of a round the server's aggregation takes.

    python simulations/refine.py step [--models 4] [--steps 100] [--repeats 3]
    python simulations/refine.py rounds [--rounds 3]
    python simulations/refine.py share [--preset gpt2-tiny] [--clients 4] [--local-steps 200] [--rounds 3]

``step``: one refinement of 4 gpt2-tiny replies (one random gpt2-tiny moved by 5 % noise each: clients
trained from the global model, where the universe starts) learning 100 steps on Tiny Shakespeare's
validation split; the seconds of ``universe_merge(refine=...)`` and of the refinement alone per repeat,
their medians and a profile (results/bench_refine_gpt2_tiny.json).

``rounds``: the rounds of a gpt2-tiny federation (4 IID clients × 200 local steps from the global
model, the server's validation split halved into refinement and guard data as the apps do) replayed in
one process, each round's replies aggregated five ways: the plain average, the aligned universe, the
refined one with a fixed 100 steps, the refined one stopping on its objective (the default) and the
same counting any improvement; each scored on the guard half and the test split, the next round
starting from ``--follow`` (results/bench_refine_rounds_gpt2-tiny.json).

``share``: one multi-round federation per strategy (aligned, refined) on the Ray simulation engine,
each in its own process: each round's wall time (clients' training included), the strategy's
aggregation seconds and their ratio; the median, the whole federation's share and the worst round
(results/bench_round_share_<preset>.json).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _results import environment, write_results  # noqa: E402  (simulations/, the script's own folder)

from fedlmc.data import load
from fedlmc.federated import Settings, client_data, evaluate_model, global_model, halves, local_train, splits_for
from fedlmc.matching.profile import profiling
from fedlmc.merging.averaging import merge
from fedlmc.merging.universe import universe_merge
from fedlmc.models import from_preset
from fedlmc.options import Refinement, Universe
from fedlmc.strategies.aligned import refine_split


def replies(n: int, seed: int = 0) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """A random gpt2-tiny (the global model) and ``n`` copies of it, each moved by 5 % noise per tensor."""
    torch.manual_seed(seed)
    base = from_preset("gpt2-tiny")
    out = []
    for _ in range(n):
        m = from_preset("gpt2-tiny")
        m.load_state_dict(base.state_dict())
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.05 * p.std() * torch.randn_like(p))
        out.append(m)
    return base, out


def step(argv: list[str]) -> None:
    """One refinement's seconds (results/bench_refine_gpt2_tiny.json)."""
    p = argparse.ArgumentParser(prog="refine.py step", description=step.__doc__)
    p.add_argument("--models", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="results/bench_refine_gpt2_tiny.json")
    args = p.parse_args(argv)
    base, models = replies(args.models)
    data = load("shakespeare", block_size=64).val
    runs = []
    for r in range(args.repeats):
        with profiling() as prof:
            t0 = time.time()
            refine = Refinement(data=data, steps=args.steps, check_every=0)  # a fixed budget, every step
            _, Ts = universe_merge(
                models, None, base, refine=refine, progress=False, universe=Universe(iterations=2, keep_layernorm=False)
            )
            secs = time.time() - t0
        refine = max(T.info.get("seconds", 0.0) for T in Ts)
        runs.append({"seconds": round(secs, 2), "refinement_seconds": round(refine, 2), "profile_seconds": prof})
        print(f"repeat {r + 1}: {secs:.1f} s, refinement {refine:.1f} s ({args.steps} steps)")
    res = {
        "preset": "gpt2-tiny",
        "models": args.models,
        "steps": args.steps,
        **environment(),
        "median_seconds": statistics.median(r["seconds"] for r in runs),
        "median_refinement_seconds": statistics.median(r["refinement_seconds"] for r in runs),
        "runs": runs,
    }
    print(f"median {res['median_seconds']:.1f} s (refinement {res['median_refinement_seconds']:.1f} s)")
    write_results(args.out, res)


def variants(refine_half) -> dict[str, dict]:
    return {
        "aligned": dict(refine=None),
        "refined, 100 steps": dict(refine=Refinement(data=refine_half, steps=100, check_every=0)),
        "refined, stopping on any improvement": dict(
            refine=refine_split(Refinement(data=refine_half, check_sigmas=0.0))
        ),
        "refined, stopping on the objective": dict(refine=refine_split(Refinement(data=refine_half))),
    }


def rounds(argv: list[str]) -> None:
    """Each round's aggregate five ways (results/bench_refine_rounds_gpt2-tiny.json)."""
    p = argparse.ArgumentParser(prog="refine.py rounds", description=rounds.__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--follow", default="refined, stopping on the objective")
    p.add_argument("--out", default="results/bench_refine_rounds_gpt2-tiny.json")
    args = p.parse_args(argv)
    s = Settings.from_run_config({"preset": "gpt2-tiny", "local-steps": 200, "independent-start": False, "seed": 0})
    sp = splits_for(s)
    refine_half, guard_half = halves(sp.val)
    G = global_model(s)
    rows = []
    for rnd in range(1, args.rounds + 1):
        replies, weights = [], []
        for pid in range(4):
            data, _ = client_data(s, pid, 4)
            m = copy.deepcopy(G)
            local_train(m, data, s, 1000 * (s.seed + 1) + 100 * rnd + pid)  # the ClientApp's seed
            replies.append(m)
            weights.append(len(data))
        row = {"round": rnd}
        scored = {"plain average": merge(replies, [w / sum(weights) for w in weights])}
        for name, kw in variants(refine_half).items():
            t0 = time.time()
            scored[name], Ts = universe_merge(
                replies, weights=weights, start=G, **kw, universe=Universe(iterations=3, keep_layernorm=True)
            )
            info = next((T.info for T in Ts if T.info.get("method") == "refined"), {})
            row[name] = {
                "seconds": round(time.time() - t0, 2),
                "steps_run": info.get("steps_run"),
                "best_step": info.get("best_step"),
                "checks": info.get("checks"),
            }
        for name, model in scored.items():
            row.setdefault(name, {}).update(
                {k: evaluate_model(model, d)["loss"] for k, d in (("guard", guard_half), ("test", sp.test))}
            )
            print(f"round {rnd} {name}: {row[name]}", flush=True)
        rows.append(row)
        G = scored[args.follow]
    res = {
        "preset": "gpt2-tiny",
        "clients": 4,
        "local_steps": 200,
        "follow": args.follow,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "rounds": rows,
    }
    write_results(args.out, res)


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


def share(argv: list[str]) -> None:
    """The aggregation's share of each round of a simulated federation (results/bench_round_share_<preset>.json)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the apps run from the checkout
    from simulations.simulate import run_in_subprocess

    p = argparse.ArgumentParser(prog="refine.py share", description=share.__doc__)
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
    args = p.parse_args(argv)
    res = {
        "preset": args.preset,
        "clients": args.clients,
        "local_steps": args.local_steps,
        "rounds": args.rounds,
        "aggregate_threads": args.aggregate_threads,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
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
        res["runs"][strategy] = {
            "rounds": rows,
            "median_share": med,
            "total_share": total,
            "max_share": worst,
        }
        print(
            f"{strategy}: share of the round median {med:.1%}, all rounds {total:.1%}, worst {worst:.1%} "
            "; " + ", ".join(f"r{r['round']} {r['aggregation_seconds']:.1f}/{r['round_seconds']:.1f} s" for r in rows),
            flush=True,
        )
    write_results(args.out or f"results/bench_round_share_{args.preset}.json", res)


STUDIES = {"step": step, "rounds": rounds, "share": share}


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in STUDIES:
        raise SystemExit(f"usage: refine.py {{{'|'.join(STUDIES)}}} [options]; --help after the study lists them")
    STUDIES[argv[0]](argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
