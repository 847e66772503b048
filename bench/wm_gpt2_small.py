"""Benchmark: weight matching of a gpt2-small-shaped pair (12 layers, d 768, 12 heads, d_ff 3072).

Writes results/bench_wm_gpt2_small.json. Usage: python bench/wm_gpt2_small.py [--layers 12] [--out FILE]
Two pairs: "independent" — two independently initialised models (random weights; nothing to find,
so every assignment is a full Hungarian solve: the slow case); "planted" — B is A under a random
group element (residual O, head and FF permutations) plus 1 % noise, which weight matching must undo.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from fedlmc.canonical import canonicalize
from fedlmc.matching import weight_matching
from fedlmc.symmetry import apply_transform, random_transform
from fedlmc.models import from_preset
from fedlmc.train import pick_device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--out", default="results/bench_wm_gpt2_small.json")
    p.add_argument("--configs", nargs="+", default=["independent", "independent-paper-init", "planted"],
                   help="independent (init both), independent-paper-init, planted (init both)")
    args = p.parse_args()
    torch.manual_seed(0)
    a = from_preset("gpt2-small", n_layer=args.layers).eval()
    torch.manual_seed(1)
    b = from_preset("gpt2-small", n_layer=args.layers).eval()
    ca = canonicalize(a)
    planted = apply_transform(ca, random_transform(ca, seed=2, groups=["residual", "heads", "ff"], dtype=torch.float32))
    with torch.no_grad():
        for p_ in planted.parameters():
            p_.add_(0.01 * p_.std() * torch.randn_like(p_))
    n_params = sum(p.numel() for p in a.parameters())
    configs = {"independent": (b, {}), "independent-paper-init": (b, {"starts": "paper"}), "planted": (planted, {})}
    results = {"model": "gpt2-small shape", "layers": args.layers, "params": n_params, "device": str(pick_device()),
               "threads": torch.get_num_threads(), "machine": platform.machine(), "runs": {}}
    for name in args.configs:
        other, kw = configs[name]
        t0 = time.time()
        T = weight_matching(a, other, **kw)
        secs = time.time() - t0
        results["runs"][name] = {"options": {k: str(v) for k, v in kw.items()}, "seconds": round(secs, 2),
                                 "iterations": T.info["iterations"], "chosen": T.info["chosen"],
                                 "objective": T.info["objective"]}
        print(f"{name:<12s} {secs:7.1f} s  iterations {T.info['iterations']}  chosen {T.info['chosen']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
