"""Benchmark: universe merge of 8 gpt2-small-shaped models (12 layers, d 768, 12 heads, d_ff 3072).

Writes results/bench_universe_gpt2_small.json. Usage: python bench/universe_gpt2_small.py [--models 8]
The 8 models are one random gpt2-small under 8 random group elements (residual O, head and FF
permutations) plus 1 % noise each, so the answer is known: the universe must be that model (in the
first copy's coordinates), with its noise averaged down. Reports wall time, per-iteration seconds and
the relative distance of the universe to the clean model.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from fedlmc.canonical import canonicalize
from fedlmc.merge import universe_merge
from fedlmc.models import from_preset
from fedlmc.symmetry import apply_transform, random_transform
from fedlmc.train import pick_device


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in a)
    return (num / sum(float(b[k].float().pow(2).sum()) for k in b)) ** 0.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=int, default=8)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--init", default="paper", help="weight matching start for the first iteration (paper|both)")
    p.add_argument("--out", default="results/bench_universe_gpt2_small.json")
    args = p.parse_args()
    torch.manual_seed(0)
    base = canonicalize(from_preset("gpt2-small", n_layer=args.layers).eval())
    copies, clean0 = [], None
    for s in range(args.models):
        T = random_transform(base, seed=100 + s, groups=["residual", "heads", "ff"], dtype=torch.float32)
        c = apply_transform(base, T)
        if s == 0:
            clean0 = {k: v.clone() for k, v in c.state_dict().items()}
        with torch.no_grad():
            for p_ in c.parameters():
                p_.add_(0.01 * p_.std() * torch.randn_like(p_))
        copies.append(c)
    noisy0 = _rel(copies[0].state_dict(), clean0)
    t0 = time.time()
    merged, Ts = universe_merge(copies, iterations=args.iterations, starts=args.init, progress=True)
    secs = time.time() - t0
    dist = _rel(merged.state_dict(), clean0)
    res = {"model": "gpt2-small shape", "layers": args.layers, "models": args.models,
           "params_per_model": sum(p.numel() for p in base.parameters()), "device": str(pick_device()),
           "threads": torch.get_num_threads(), "machine": platform.machine(), "iterations": args.iterations,
           "init": args.init, "seconds": round(secs, 1), "target_seconds": 180,
           "relative_distance_to_clean_model": dist, "one_noisy_copy_distance": noisy0,
           "per_model": [{"chosen": T.info.get("chosen"), "iterations": T.info.get("iterations"),
                          "seconds": round(T.info.get("seconds", 0.0), 1)} for T in Ts]}
    print(f"{args.models} models: {secs:.0f} s; universe vs clean model {dist:.4f} (one noisy copy {noisy0:.4f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
