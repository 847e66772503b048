"""Barriers of weight matching at each precision of its products, on independently trained pairs.

Weight matching's fast precisions change only which products round: bfloat16 factors, or int8 FF
similarity scores (``Matching.precision``). This bench checks that the barrier they reach is the one
float32 products reach. Models of a preset (default gpt2-tiny on Tiny Shakespeare, trained once per
seed and cached) are matched in pairs as float32 problems at each precision. For each it records the
loss barrier of the weight-matched interpolation (λ = 0, 0.1, …, 1 on the test split), the
objective, and the seconds.

    python bench/precision_quality.py [--preset gpt2-tiny] [--seeds 0 1 2] [--width W] [--train-steps N]
    # → results/bench_precision_quality_{preset}.json
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from _models import add_model_args, models_record, results_path, trained_models  # noqa: E402  (bench/, the script's own folder)
from _results import environment, gemm_seconds, write_results  # noqa: E402

from fedlmc.averaging import interpolate
from fedlmc.barrier import barrier, interpolation_curve
from fedlmc.commands import load_splits
from fedlmc.matching import weight_matching
from fedlmc.options import Matching
from fedlmc.symmetry import apply_transform, canonicalize

PRECISIONS = ("exact", "int8", "bfloat16")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-tiny")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--max-batches", type=int, default=None, help="test batches per point of a curve")
    add_model_args(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    splits = load_splits(args.preset, args)
    models, over = trained_models(args, args.seeds, splits)
    pairs = []
    for sa, sb in itertools.combinations(args.seeds, 2):
        ca, cb = canonicalize(models[sa]), canonicalize(models[sb])
        row = {"seeds": [sa, sb], "precisions": {}}
        for precision in args.precisions:
            t0 = time.perf_counter()
            T = weight_matching(ca, cb, Matching(precision=precision, dtype=torch.float32))
            seconds = time.perf_counter() - t0
            curve = interpolation_curve(
                ca, apply_transform(cb, T), splits.test, interpolate=interpolate, max_batches=args.max_batches
            )
            row["precisions"][precision] = {
                "barrier": barrier(curve),
                "objective": T.info["objective"][T.info["chosen"]],
                "chosen": T.info["chosen"],
                "seconds": seconds,
                "curve": curve.to_dict(),
            }
            print(
                f"seeds {sa},{sb} {precision:<9s} barrier {barrier(curve):.4f}  objective "
                f"{row['precisions'][precision]['objective']:.4f}  {seconds:.1f} s",
                flush=True,
            )
        pairs.append(row)
    deltas = {
        q: [r["precisions"][q]["barrier"] - r["precisions"]["exact"]["barrier"] for r in pairs]
        for q in args.precisions
        if q != "exact" and "exact" in args.precisions
    }
    doc = {
        **models_record(args, over),
        **environment(),
        "gemm_seconds": gemm_seconds(),
        "pairs": pairs,
        "barrier_minus_exact": deltas,
        "max_abs_barrier_minus_exact": {q: max(abs(d) for d in v) for q, v in deltas.items()},
    }
    out = results_path(args, "bench_precision_quality")
    write_results(out, doc)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
