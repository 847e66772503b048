"""Check: on two independently trained gpt2-tiny models (d_ff 512, so weight matching takes the sparse
candidate path), the candidate FF assignments give the dense solver's transform and barrier.

    python bench/candidates_check.py [--steps 1500]

Writes results/bench_candidates_gpt2_tiny.json: objective, permutations that differ, and the loss
barrier (test split) of each path's weight-matched λ sweep.
"""
from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from fedlmc.averaging import interpolate
from fedlmc.barrier import barrier, interpolation_curve
from fedlmc.data import load
from fedlmc.matching import weight_matching
from fedlmc.symmetry import apply_transform
from fedlmc.train import train_preset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--out", default="results/bench_candidates_gpt2_tiny.json")
    args = p.parse_args()
    splits = load("shakespeare")
    a, _ = train_preset("gpt2-tiny", splits, seed=0, steps=args.steps)
    b, _ = train_preset("gpt2-tiny", splits, seed=1, steps=args.steps)
    res: dict = {"steps": args.steps, "paths": {}}
    Ts = {}
    for name, cand in (("candidates-64", 64), ("dense", None)):
        T = Ts[name] = weight_matching(a, b, candidates=cand)
        curve = interpolation_curve(a, apply_transform(b, T), splits.test, interpolate=partial(interpolate, form="factored"))
        res["paths"][name] = {"objective": T.info["objective"], "iterations": T.info["iterations"],
                              "seconds": T.info["seconds"], "barrier": barrier(curve)}
        print(name, res["paths"][name], flush=True)
    ff = [k for k in Ts["dense"].elements if k.startswith("ff.")]
    res["ff_groups_differing"] = [k for k in ff if not torch.equal(Ts["dense"][k], Ts["candidates-64"][k])]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=float))
    print(f"wrote {out}: FF groups that differ: {res['ff_groups_differing']}")


if __name__ == "__main__":
    main()
