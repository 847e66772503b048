"""Benchmark: one Dirichlet refinement as a federated round runs it (4 gpt2-tiny replies, 100 steps).

    python bench/refine_gpt2_tiny.py [--models 4] [--steps 100] [--repeats 3] [--out FILE]

The replies are one random gpt2-tiny moved by 5 % noise each (clients trained from the global model:
the universe starts from it, as ``RefinedFedAvg`` does in a multi-round federation); the refinement
learns on Tiny Shakespeare's validation split, the server's half a round would use. Reports the
seconds of the whole ``universe_merge(refine=...)`` and of the refinement alone per repeat, their
medians, and a profile (seconds per section; "assignment solves" is the waiting for the Hungarian
solves, inside "aligned models"). Writes results/bench_refine_gpt2_tiny.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _results import environment, write_results  # noqa: E402  (bench/, the script's own folder)

from fedlmc.data import load
from fedlmc.matching.profile import profiling
from fedlmc.models import from_preset
from fedlmc.options import Refinement, Universe
from fedlmc.universe import universe_merge


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="results/bench_refine_gpt2_tiny.json")
    args = p.parse_args()
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


if __name__ == "__main__":
    main()
