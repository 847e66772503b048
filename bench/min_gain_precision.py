"""Benchmark: the gain that ``Matching.min_gain`` compares, with the CPU's fast products and with float32.

Writes results/bench_min_gain_precision.json. Usage: python bench/min_gain_precision.py [--replies 8]
A GPT-2-small-shaped model A (12 layers, d 768, untied head) and ``--replies`` replies trained a little
from it: ``A + δ``, δ Gaussian with 2 % of each tensor's standard deviation (the common round of
``bench/universe_scale.py``). Each reply is aligned to A with ``Matching(min_gain=0.1)`` at
``precision="auto"`` (bfloat16 factors on a CPU with native bfloat16, int8 FF scores on one with only
int8 dot products, float32 elsewhere) and at ``precision="exact"`` (float32 products), A's side built
once per precision as in a universe iteration. Recorded per reply and precision: the identity's
objective, the descent's, the gain ``1 − descent / identity``, whether it gave up, the seconds (the
first reply of each precision also builds A's side: left out of the median).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _results import environment, gemm_seconds, write_results  # noqa: E402  (bench/, the script's own folder)

from fedlmc.allocator import retain_freed_memory
from fedlmc.matching import weight_matching
from fedlmc.models import from_preset
from fedlmc.options import Matching
from fedlmc.symmetry import rebuild

PRECISIONS = ("auto", "exact")


def reply(a: torch.nn.Module, seed: int, noise: float) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    return rebuild(
        a,
        {
            k: v + noise * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v
            for k, v in a.state_dict().items()
        },
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replies", type=int, default=8)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--noise", type=float, default=0.02)
    p.add_argument("--min-gain", type=float, default=0.1)
    p.add_argument("--out", default="results/bench_min_gain_precision.json")
    args = p.parse_args()
    retain_freed_memory()
    torch.manual_seed(0)
    a = from_preset("gpt2-small", n_layer=args.layers).eval()
    res = {
        "model": "gpt2-small shape",
        "layers": args.layers,
        "noise": args.noise,
        "min_gain": args.min_gain,
        **environment(),
        "gemm_seconds": [round(gemm_seconds(), 3)],
        "replies": [],
    }
    reuse = {prec: {} for prec in PRECISIONS}
    for i in range(args.replies):
        b = reply(a, 100 + i, args.noise)
        row = {"seed": 100 + i}
        for prec in PRECISIONS:
            t0 = time.perf_counter()
            T = weight_matching(a, b, Matching(min_gain=args.min_gain, precision=prec), reuse=reuse[prec])
            obj = T.info["objective"]
            row[prec] = {
                "seconds": round(time.perf_counter() - t0, 3),
                "identity": obj["identity"],
                "descent": obj["paper"],
                "gain": 1.0 - obj["paper"] / obj["identity"],
                "gave_up": "gave_up" in T.info,
                "chosen": T.info["chosen"],
                # parts whose cross-covariances were AᵀA + Aᵀ(B − A), the difference an int8 product
                "difference_products": T.info.get("difference_products", []),
            }
        res["replies"].append(row)
        print(
            f"reply {i + 1}/{args.replies}: gain "
            + ", ".join(f"{prec} {row[prec]['gain']:.5f} ({row[prec]['seconds']:.2f} s)" for prec in PRECISIONS),
            flush=True,
        )
    res["gemm_seconds"].append(round(gemm_seconds(), 3))
    rows = res["replies"]
    res["summary"] = {
        "max_gain_difference": max(abs(r["auto"]["gain"] - r["exact"]["gain"]) for r in rows),
        "max_identity_relative_difference": max(
            abs(r["auto"]["identity"] - r["exact"]["identity"]) / r["exact"]["identity"] for r in rows
        ),
        "gains": {prec: [round(r[prec]["gain"], 5) for r in rows] for prec in PRECISIONS},
        "same_choice": all(r["auto"]["chosen"] == r["exact"]["chosen"] for r in rows),
        "median_seconds": {prec: statistics.median(r[prec]["seconds"] for r in rows[1:]) for prec in PRECISIONS},
    }
    write_results(args.out, res)


if __name__ == "__main__":
    main()
