"""Benchmark: weight matching of a gpt2-small-shaped pair (12 layers, d 768, 12 heads, d_ff 3072).

Writes results/bench_wm_gpt2_small.json. Usage: python bench/wm_gpt2_small.py [--layers 12] [--out FILE]
The two models are independently initialised (random weights): the matching has to do its full
work (perms change every iteration), which is the slow case.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from fedlmc.matching import weight_matching
from fedlmc.models import from_preset
from fedlmc.train import pick_device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--out", default="results/bench_wm_gpt2_small.json")
    p.add_argument("--configs", nargs="+", default=["default", "paper-init", "float64"],
                   help="default (init both, float32), paper-init (init paper), float64")
    args = p.parse_args()
    torch.manual_seed(0)
    a = from_preset("gpt2-small", n_layer=args.layers).eval()
    torch.manual_seed(1)
    b = from_preset("gpt2-small", n_layer=args.layers).eval()
    n_params = sum(p.numel() for p in a.parameters())
    configs = {"default": {}, "paper-init": {"init": "paper"}, "float64": {"dtype": torch.float64, "init": "paper"}}
    results = {"model": "gpt2-small shape", "layers": args.layers, "params": n_params, "device": str(pick_device()),
               "threads": torch.get_num_threads(), "machine": platform.machine(), "runs": {}}
    for name in args.configs:
        kw = configs[name]
        t0 = time.time()
        T = weight_matching(a, b, **kw)
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
