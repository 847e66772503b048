"""Weight matching's quality on trained pairs, for the speed work's "quality must not move" check:
loss barriers (factored and circuit merge), iterations, objective and seconds of the default options,
of the exact path (dense assignment everywhere) and of looser stopping tolerances.

Writes results/wm_quality_{preset}[_dW].json. Usage:
    python bench/wm_quality.py --preset vit-tiny [--pairs 1] [--rtols 1e-3 3e-3]
Models come from the reproduction's cache (as bench/learned_budget.py); where that bench measured the
same pair before (runs/cache/budget-*-base.json), its weight-matching barrier is reported beside ours
as "before".
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

from fedlmc.barrier import barrier, interpolation_curve
from fedlmc.canonical import canonicalize
from fedlmc.commands import console, load_splits
from fedlmc.matching import weight_matching
from fedlmc.reproduce import seed_pairs
from learned_budget import measure  # noqa: E402  (bench/, the script's own folder)
from _models import add_model_args, trained_models  # noqa: E402


def before(cache: Path, tag: str) -> dict:
    """The learned-matching bench's weight-matching barriers for this pair, when it measured them."""
    f = cache / f"budget-{tag}-base.json"
    return json.loads(f.read_text())["weight matching"] if f.is_file() else {}


def run(a, b, splits, options: dict) -> dict:
    t0 = time.time()
    T = weight_matching(a, b, **options)
    secs = time.time() - t0
    ca, cb = canonicalize(a), canonicalize(b)
    return {"options": {k: str(v) for k, v in options.items()}, "seconds": round(secs, 2),
            "iterations": T.info["iterations"], "chosen": T.info["chosen"], "objective": T.info["objective"],
            "barrier": measure(ca, cb, T, splits.test), "barrier_circuit_merge": measure(ca, cb, T, splits.test, "circuit")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="vit-tiny")
    p.add_argument("--pairs", type=int, default=1)
    p.add_argument("--rtols", type=float, nargs="*", default=[3e-3], help="looser stopping tolerances to measure")
    add_model_args(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    splits = load_splits(args.preset, args)
    pairs = seed_pairs(args.pairs)
    models, over = trained_models(args, sorted({s for q in pairs for s in q}), splits)
    configs = {"default": {}, "exact (dense assignment)": {"candidates": None}}
    configs.update({f"rtol {r:g}": {"rtol": r} for r in args.rtols})
    out = {"preset": args.preset, "width": args.width, "train_steps": args.train_steps, "threads": args.threads, "pairs": {}}
    for i, j in pairs:
        a, b = models[i], models[j]
        tag = f"{args.preset}-{i}-{j}-" + hashlib.sha1(json.dumps([a.meta.get("seconds"), b.meta.get("seconds"),
                                                                   over]).encode()).hexdigest()[:8]
        row = {"vanilla": barrier(interpolation_curve(a, b, splits.test)), "before": before(Path(args.cache), tag)}
        for name, kw in configs.items():
            row[name] = run(a, b, splits, kw)
            console.print(f"({i}, {j}) {name}: barrier {row[name]['barrier']:.4f} (circuit merge "
                          f"{row[name]['barrier_circuit_merge']:.4f}), iterations {row[name]['iterations']}, "
                          f"{row[name]['seconds']:.1f} s")
        console.print(f"({i}, {j}) vanilla {row['vanilla']:.4f}, before {row['before']}")
        out["pairs"][f"{i}-{j}"] = row
    stem = Path(args.out) / (f"wm_quality_{args.preset}" + (f"_d{args.width}" if args.width else ""))
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1))
    print(f"wrote {stem.with_suffix('.json')}")


if __name__ == "__main__":
    main()
