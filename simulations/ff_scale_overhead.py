"""Weight matching's seconds on a GELU pair with and without ``Matching.ff_scale``, and against another
checkout of fedlmc (``--against DIR``, e.g. one from before the FF-scale groups existed).

GELU has no FF-scale group, so ``ff_scale=True`` should solve nothing more. Each repeat times, in turn,
weight matching in this process without and with ``ff_scale``, then a fresh process of this checkout and
(with ``--against``) one of the other, each on the same two cached models with its own ``Matching()``
defaults; the medians over ``--repeats`` and their ratios go to
``results/bench_ff_scale_overhead_{preset}[_w{width}].json``.

    python -m simulations ff_scale_overhead --preset vit-tiny --width 128 --against /tmp/fedlmc-before --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from _models import add_model_args, models_record, results_path, trained_models, width_arch  # noqa: E402  (simulations/)
from _results import environment, gemm_seconds, write_results  # noqa: E402

from fedlmc.commands import cache_name, load_splits
from fedlmc.matching import weight_matching
from fedlmc.options import Matching
from fedlmc.symmetry import canonicalize
from fedlmc.train import train_config_for

HERE = Path(__file__).resolve().parents[1]

# what a fresh process runs: load both models with that checkout's own code, time its default matching
CHILD = """
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
from fedlmc import io
from fedlmc.matching import weight_matching
from fedlmc.options import Matching
from fedlmc.symmetry import canonicalize
torch.set_num_threads(int(sys.argv[4]))
ca, cb = canonicalize(io.load(sys.argv[2])), canonicalize(io.load(sys.argv[3]))
t0 = time.perf_counter()
weight_matching(ca, cb, Matching())
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def in_process(ca, cb, ff_scale: bool) -> float:
    t0 = time.perf_counter()
    T = weight_matching(ca, cb, Matching(ff_scale=ff_scale))
    seconds = time.perf_counter() - t0
    if ff_scale and any(g.startswith("ffscale") for g in T.elements):
        raise SystemExit("this model has FF-scale groups: the bench is for models without them (GELU)")
    return seconds


def child(checkout: Path, paths: list[Path], threads: int, timeout: float) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(checkout), *map(str, paths), str(threads)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-tiny")
    p.add_argument("--seeds", nargs=2, type=int, default=[0, 1])
    p.add_argument("--against", type=Path, help="another fedlmc checkout to time in the same run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900, help="seconds per fresh process")
    add_model_args(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    splits = load_splits(args.preset, args)
    models, over = trained_models(args, args.seeds, splits)
    arch = width_arch(args.preset, args.width)
    paths = [
        Path(args.cache) / cache_name(args.preset, s, splits, train_config_for(args.preset, s, **over), arch)
        for s in args.seeds
    ]
    ca, cb = (canonicalize(models[s]) for s in args.seeds)
    runs: dict[str, list[float]] = {"in_process": [], "in_process_ff_scale": [], "fresh_process": []}
    if args.against:
        runs["fresh_process_against"] = []
    for r in range(args.repeats):
        runs["in_process"].append(in_process(ca, cb, False))
        runs["in_process_ff_scale"].append(in_process(ca, cb, True))
        runs["fresh_process"].append(child(HERE, paths, args.threads, args.timeout))
        if args.against:
            runs["fresh_process_against"].append(child(args.against.resolve(), paths, args.threads, args.timeout))
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()), flush=True)
    median = {k: statistics.median(v) for k, v in runs.items()}
    ratios = {"ff_scale_over_plain": median["in_process_ff_scale"] / median["in_process"]}
    if args.against:
        ratios["this_over_against"] = median["fresh_process"] / median["fresh_process_against"]
    doc = {
        **models_record(args, over),
        **environment(),
        "gemm_seconds": gemm_seconds(),
        "seeds": args.seeds,
        "against": str(args.against) if args.against else None,
        "threads": args.threads,
        "seconds": runs,
        "median_seconds": median,
        "ratios": ratios,
    }
    out = results_path(args, "bench_ff_scale_overhead")
    write_results(out, doc)
    print(json.dumps(ratios), f"→ {out}")


if __name__ == "__main__":
    main()
