"""Barriers of weight matching on independently trained pairs, against where its descent stops, or
at each precision of its products (``--precisions``).

Weight matching's coordinate descent stops when an iteration improves its objective by less than
``Matching.descent_tol`` (relative), or after ``Matching.descent_iterations``. A looser stop saves whole iterations,
each of which costs the same on a GPT-2-small pair; this bench says what it costs in quality. Models
of a preset (default gpt2-tiny on Tiny Shakespeare, trained once per seed and cached) are matched in
pairs as float32 problems:

* ``iterations``: exactly k iterations (``tol=0``) for k = 1 … ``--max-iterations``: the barrier of
  the weight-matched interpolation (λ = 0, 0.1, …, 1 on the test split) and the objective after each;
* ``tols``: the default stop and looser ones: iterations run, barrier, objective, seconds.

    python simulations/wm_trained.py [--preset gpt2-tiny] [--seeds 0 1 2] [--tols 2e-3 5e-3 1e-2 2e-2]
    # → results/bench_wm_stopping_{preset}.{json,png}
    python simulations/wm_trained.py --plot results/bench_wm_stopping_gpt2-tiny.json  # redraw the picture

Its fast precisions change only which products round: bfloat16 factors, or int8 FF similarity scores
(``Matching.precision``). ``--precisions exact int8 bfloat16`` matches each pair at each of them instead
(default starts, float32 problems): the barrier, the objective, the seconds, and each barrier minus
float32's (``exact``) on the same pair.

    python simulations/wm_trained.py --precisions exact int8 bfloat16  # → results/bench_precision_quality_{preset}.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
from _models import add_model_args, models_record, results_path, trained_models  # noqa: E402  (simulations/, the script's own folder)
from _results import environment, gemm_seconds, write_results  # noqa: E402

from fedlmc.commands import load_splits
from fedlmc.matching import weight_matching
from fedlmc.merging.averaging import interpolate
from fedlmc.merging.barrier import barrier, interpolation_curve
from fedlmc.options import Matching
from fedlmc.symmetry import apply_transform, canonicalize


def matched(ca, cb, splits, matching: Matching, max_batches) -> dict:
    """One matching of ``cb`` to ``ca``: its barrier, objective, iterations and seconds."""
    t0 = time.perf_counter()
    T = weight_matching(ca, cb, matching)
    seconds = time.perf_counter() - t0
    curve = interpolation_curve(
        ca, apply_transform(cb, T), splits.test, interpolate=interpolate, max_batches=max_batches
    )
    return {
        "barrier": barrier(curve),
        "objective": T.info["objective"][T.info["chosen"]],
        "chosen": T.info["chosen"],
        "iterations": T.info["iterations"][T.info["chosen"]] if T.info["chosen"] != "identity" else 0,
        "seconds": seconds,
        "loss": curve.to_dict()["loss"],
    }


def plot(doc: dict, path: Path) -> None:
    """Barrier and objective against the iterations run, one line per pair, each tolerance's stop marked."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    tols = sorted({t for r in doc["pairs"] for t in r["tols"]}, key=float)
    markers = {t: (m, 6 + 2 * j) for j, (t, m) in enumerate(zip(tols, "osD^v<>"))}
    for i, r in enumerate(doc["pairs"]):
        ks = sorted(map(int, r["iterations"]))
        for ax, key in zip(axes, ("barrier", "objective")):
            ax.plot(ks, [r["iterations"][str(k)][key] for k in ks], f"C{i}-", lw=1, label=f"seeds {r['seeds']}")
            for t, v in r["tols"].items():
                lab = f"stop at tol {float(t):g}" if i == 0 else None
                m, size = markers[t]
                ax.plot(v["iterations"], v[key], m, mfc="none", color="k", ms=size, label=lab)
    for ax, ylabel in zip(axes, ("loss barrier (test split)", "weight-matching objective")):
        ax.set_xlabel("coordinate-descent iterations")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    width = f", d_model {doc['width']}" if doc.get("width") else ""
    fig.suptitle(f"Weight matching stopped after k iterations: {doc['preset']}{width}, independently trained pairs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


PRECISIONS = ("exact", "int8", "bfloat16")


def precisions(args: argparse.Namespace, splits, models: dict, over) -> None:
    """``--precisions``: every pair matched at each precision (results/bench_precision_quality_{preset}.json)."""
    pairs = []
    for sa, sb in itertools.combinations(args.seeds, 2):
        ca, cb = canonicalize(models[sa]), canonicalize(models[sb])
        row = {"seeds": [sa, sb], "precisions": {}}
        for q in args.precisions:
            r = row["precisions"][q] = matched(
                ca, cb, splits, Matching(precision=q, dtype=torch.float32), args.max_batches
            )
            print(f"seeds {sa},{sb} {q:<9s} barrier {r['barrier']:.4f}  {r['seconds']:.1f} s", flush=True)
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
    write_results(results_path(args, "bench_precision_quality"), doc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-tiny")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--tols", nargs="+", type=float, default=[2e-3, 5e-3, 1e-2, 2e-2])
    p.add_argument("--max-iterations", type=int, default=10)
    p.add_argument("--max-batches", type=int, default=None, help="test batches per point of a curve")
    p.add_argument("--plot", metavar="JSON", help="only redraw the picture of a results file")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, help="compare these precisions instead")
    add_model_args(p)
    args = p.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)
    splits = load_splits(args.preset, args)
    models, over = trained_models(args, args.seeds, splits)
    if args.precisions:
        return precisions(args, splits, models, over)
    base = dict(dtype=torch.float32, keep_identity=False)
    pairs = []
    for sa, sb in itertools.combinations(args.seeds, 2):
        ca, cb = canonicalize(models[sa]), canonicalize(models[sb])
        row = {"seeds": [sa, sb], "iterations": {}, "tols": {}}
        for k in range(1, args.max_iterations + 1):
            r = matched(ca, cb, splits, Matching(descent_iterations=k, descent_tol=0.0, **base), args.max_batches)
            row["iterations"][str(k)] = r
            print(
                f"seeds {sa},{sb} {k:>2d} iterations: barrier {r['barrier']:.4f}  objective {r['objective']:.4f}",
                flush=True,
            )
        for tol in args.tols:
            r = matched(ca, cb, splits, Matching(descent_tol=tol, **base), args.max_batches)
            row["tols"][repr(tol)] = r
            print(
                f"seeds {sa},{sb} tol {tol:g}: {r['iterations']} iterations, barrier {r['barrier']:.4f}  "
                f"objective {r['objective']:.4f}  {r['seconds']:.1f} s",
                flush=True,
            )
        pairs.append(row)
    default = repr(Matching().descent_tol)
    deltas = {
        t: [r["tols"][t]["barrier"] - r["tols"][default]["barrier"] for r in pairs]
        for t in map(repr, args.tols)
        if t != default and all(default in r["tols"] for r in pairs)
    }
    doc = {
        **models_record(args, over),
        **environment(),
        "gemm_seconds": gemm_seconds(),
        "default_tol": Matching().descent_tol,
        "pairs": pairs,
        "barrier_minus_default": deltas,
        "max_abs_barrier_minus_default": {t: max(abs(d) for d in v) for t, v in deltas.items()},
    }
    out = results_path(args, "bench_wm_stopping")
    write_results(out, doc)
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out} and its .png")


if __name__ == "__main__":
    main()
