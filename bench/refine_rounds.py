"""Benchmark: what Dirichlet refinement does to a federation's aggregate, round by round, and how long.

    python bench/refine_rounds.py [--rounds 3] [--out results/bench_refine_rounds_gpt2-tiny.json]

Replays the rounds of ``bench/round_share.py``'s federation in one process (gpt2-tiny, 4 IID clients ×
200 local steps from the global model, the server's validation split halved into refinement and guard
data as ``strategies.factory`` does) and aggregates each round's replies five ways: the plain average,
the aligned universe, the refined one with a fixed 100 steps, the refined one stopping on its
objective (``RefinedFedAvg``'s default: checks every 10 steps on held-out refinement batches, patience
2, an improvement counted when it exceeds 2 standard errors) and the same counting any improvement.
Each is scored on the guard half and the test split; the next round starts from the default stopping
variant (``--follow`` picks another). Writes every loss, second, step count and check score.
"""

from __future__ import annotations

import argparse
import copy
import platform
import time

import torch
from _results import write_results  # noqa: E402  (bench/, the script's own folder)

from fedlmc.averaging import merge
from fedlmc.federated import Settings, client_data, evaluate_model, global_model, halves, local_train, splits_for
from fedlmc.options import Refinement, Universe
from fedlmc.strategies.aligned import refine_split
from fedlmc.universe import universe_merge


def variants(refine_half) -> dict[str, dict]:
    return {
        "aligned": dict(refine=None),
        "refined, 100 steps": dict(refine=Refinement(data=refine_half, steps=100, check_every=0)),
        "refined, stopping on any improvement": dict(
            refine=refine_split(Refinement(data=refine_half, check_sigmas=0.0))
        ),
        "refined, stopping on the objective": dict(refine=refine_split(Refinement(data=refine_half))),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--follow", default="refined, stopping on the objective")
    p.add_argument("--out", default="results/bench_refine_rounds_gpt2-tiny.json")
    args = p.parse_args()
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


if __name__ == "__main__":
    main()
