"""Benchmark: universe merge of 8 gpt2-small-shaped models (12 layers, d 768, 12 heads, d_ff 3072).

Writes results/bench_universe_gpt2_small.json. Usage: python simulations/universe_gpt2_small.py [--models 8]
The 8 models are one random gpt2-small under 8 random group elements (residual O, head and FF
permutations) plus 1 % noise each, so the answer is known: the universe must be that model (in the
first copy's coordinates), with its noise averaged down. Reports wall time, per-model seconds, a
profile of where the time went, the peak resident memory of the process during the merge (sampled
every 20 ms) against the (M + 4) × model-size budget, and the relative distance of the universe to
the clean model. Runs with ``fedlmc.scale.allocator.retain_freed_memory`` as the ServerApp does
(``--default-allocator``: without).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import psutil
import torch
from _results import PeakMemory, environment, write_results  # noqa: E402  (simulations/, the script's own folder)

from fedlmc.matching.profile import profiling
from fedlmc.merging.universe import universe_merge
from fedlmc.models import from_preset
from fedlmc.options import Matching, Universe
from fedlmc.scale.allocator import release_freed_memory, retain_freed_memory
from fedlmc.symmetry import apply_transform, canonicalize, random_transform


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in a)
    return (num / sum(float(b[k].float().pow(2).sum()) for k in b)) ** 0.5


def clean_copy(layers: int, s: int) -> torch.nn.Module:
    """Copy ``s``: one fixed random gpt2-small (canonical) under the random group element of seed 100 + s."""
    torch.manual_seed(0)
    base = canonicalize(from_preset("gpt2-small", n_layer=layers).eval())
    return apply_transform(
        base, random_transform(base, seed=100 + s, groups=["residual", "heads", "ff"], dtype=torch.float32)
    )


def noisy_copy(layers: int, s: int) -> torch.nn.Module:
    """``clean_copy`` plus 1 % Gaussian noise per tensor."""
    c = clean_copy(layers, s)
    g = torch.Generator().manual_seed(1000 + s)
    with torch.no_grad():
        for p_ in c.parameters():
            p_.add_(0.01 * p_.std() * torch.randn(p_.shape, generator=g))
    return c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=int, default=8)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument(
        "--keep-identity",
        action="store_true",
        help="also score the identity as the do-no-harm candidate (Matching.keep_identity)",
    )
    p.add_argument("--out", default="results/bench_universe_gpt2_small.json")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, i.e. all cores)")
    p.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's malloc thresholds as they are (fedlmc.scale.allocator is what servers use)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    retained = False if args.default_allocator else retain_freed_memory()
    rss_interpreter = psutil.Process().memory_info().rss
    copies = [noisy_copy(args.layers, s) for s in range(args.models)]
    model_bytes = 4 * sum(p.numel() for p in copies[0].parameters())
    # the server holds the M replies and nothing else (the clean model is rebuilt afterwards); what
    # building the copies freed goes back to the kernel, so the peak below is the merge's own
    gc.collect()
    release_freed_memory()
    with profiling() as prof, PeakMemory() as mem:
        t0 = time.time()
        merged, Ts = universe_merge(
            copies,
            matching=Matching(keep_identity=args.keep_identity),
            progress=True,
            universe=Universe(iterations=args.iterations, keep_layernorm=False),
        )
        secs = time.time() - t0
    clean0 = clean_copy(args.layers, 0).state_dict()
    noisy0 = _rel(copies[0].state_dict(), clean0)
    dist = _rel(merged.state_dict(), clean0)
    res = {
        "model": "gpt2-small shape",
        "layers": args.layers,
        "models": args.models,
        "params_per_model": sum(p.numel() for p in copies[0].parameters()),
        **environment(),
        "iterations": args.iterations,
        "retain_freed_memory": retained,
        "rss_interpreter_gb": round(rss_interpreter / 1e9, 2),
        "keep_identity": args.keep_identity,
        "seconds": round(secs, 1),
        "target_seconds": 120,
        "profile_seconds": prof,
        "peak_rss_gb": round(mem.peak / 1e9, 2),
        "rss_before_merge_gb": round(mem.start / 1e9, 2),
        "model_float32_gb": round(model_bytes / 1e9, 3),
        "peak_rss_in_models": round(mem.peak / model_bytes, 1),
        "budget_in_models": args.models + 4,
        "relative_distance_to_clean_model": dist,
        "one_noisy_copy_distance": noisy0,
        "per_model": [
            {
                "chosen": T.info.get("chosen"),
                "iterations": T.info.get("iterations"),
                "seconds": round(T.info.get("seconds", 0.0), 1),
            }
            for T in Ts
        ],
    }
    print(
        f"{args.models} models: {secs:.0f} s; universe vs clean model {dist:.4f} (one noisy copy {noisy0:.4f}); "
        f"peak RSS {mem.peak / 1e9:.2f} GB = {mem.peak / model_bytes:.1f} models (budget {args.models + 4})"
    )
    print("profile (s):", json.dumps(prof))
    write_results(args.out, res)


if __name__ == "__main__":
    main()
