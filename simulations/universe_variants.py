"""Universe variants: which way of merging M independently trained models keeps pairwise quality?

Each variant merges the same M models (seeds 0..M−1); the table gives the merged model's test loss,
its excess over the mean endpoint loss, and that excess × averaging's. Writes
results/universe_variants_{preset}[_d{width}].{json,md}. Usage:
    python simulations/universe_variants.py --preset vit-tiny
    python simulations/universe_variants.py --preset gpt2-tiny --train-steps 1000 --width 128
Each variant's row is cached, so an interrupted run resumes and a new variant reuses the others.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import torch
from _models import add_model_args, trained_models, width_arch  # noqa: E402  (simulations/, the script's own folder)

from fedlmc import provenance
from fedlmc.commands import console, load_splits
from fedlmc.matching import learned_matching
from fedlmc.merging.averaging import merge
from fedlmc.merging.manyway import excess
from fedlmc.merging.universe import universe_merge
from fedlmc.options import Learning, Matching, Refinement, Universe
from fedlmc.symmetry import apply_transform, canonicalize
from fedlmc.train import evaluate


def pairwise_learned(models, splits, steps: int = 300):
    """Every model learned-matched (from weight matching) to model 0, then averaged (factored)."""
    anchor = canonicalize(models[0])
    aligned = [anchor] + [
        apply_transform(
            canonicalize(m),
            learned_matching(models[0], m, splits.train, learning=Learning(steps=steps), progress=False),
        )
        for m in models[1:]
    ]
    return merge(aligned, [1 / len(models)] * len(models))


def variants(refine_steps: int) -> dict[str, Callable]:
    """label -> (models, splits) -> merged model."""

    def uni(**kw):
        return lambda models, splits: universe_merge(
            models, **kw, universe=Universe(iterations=5, keep_layernorm=False)
        )[0]

    def refined(alpha: float, **kw):
        refine = dict(alpha=alpha, steps=refine_steps, check_every=0)  # a fixed budget, every step
        return lambda models, splits: universe_merge(
            models,
            refine=Refinement(data=splits.train, **refine),
            **kw,
            universe=Universe(iterations=10, keep_layernorm=False),
        )[0]

    return {
        "averaging": lambda models, splits: merge(models, [1 / len(models)] * len(models)),
        "universe, 10 iterations (the default anchor: heaviest = model 0)": uni(iterations=10),
        "universe, 1 iteration (each model weight-matched to model 0, averaged)": uni(iterations=1),
        "universe, until it stops moving (≤ 50 iterations, tol 1e-6)": uni(iterations=50, tol=1e-6),
        "universe, central anchor": uni(iterations=10, anchor="central"),
        "universe + residual activations": lambda models, splits: universe_merge(
            models,
            matching=Matching(residual_data=splits.train),
            universe=Universe(iterations=10, keep_layernorm=False),
        )[0],
        "universe, circuit merge": uni(iterations=10, form="circuit"),
        "pairwise learned matching to model 0 (300 steps each), averaged": pairwise_learned,
        f"refined α = 0.1, {refine_steps} steps": refined(0.1),
        f"refined α = 0.3, {refine_steps} steps": refined(0.3),
        f"refined α = 1, {refine_steps} steps": refined(1.0),
        f"refined α = 3, {refine_steps} steps": refined(3.0),
        f"refined α = 1, {refine_steps} steps, Sinkhorn permutations": refined(1.0, relax="sinkhorn"),
    }


def main() -> None:
    provenance.watch()  # samples the load through the run, for the results file's record
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="vit-tiny")
    p.add_argument("--models", type=int, default=4)
    p.add_argument("--refine-steps", type=int, default=200)
    p.add_argument("--only", nargs="+", help="run only the variants whose label contains one of these")
    add_model_args(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    splits = load_splits(args.preset, args)
    by_seed, over = trained_models(args, range(args.models), splits)
    models = [by_seed[s] for s in range(args.models)]
    arch = width_arch(args.preset, args.width)
    ends = [evaluate(m, splits.test)["loss"] for m in models]
    tag = hashlib.sha1(
        json.dumps([args.preset, [m.meta.get("seconds") for m in models], over, arch]).encode()
    ).hexdigest()[:8]
    rows = {}
    for label, build in variants(args.refine_steps).items():
        if args.only and not any(o in label for o in args.only):
            continue
        f = Path(args.cache) / f"universe-variant-{tag}-{hashlib.sha1(label.encode()).hexdigest()[:8]}.json"
        if f.is_file():
            rows[label] = json.loads(f.read_text())
            continue
        t0 = time.time()
        merged = build(models, splits)
        secs = time.time() - t0
        ev = evaluate(merged, splits.test)
        rows[label] = {
            "loss": ev["loss"],
            "acc": ev["acc"],
            "excess": excess(ev["loss"], ends),
            "seconds": round(secs, 1),
        }
        f.write_text(json.dumps(rows[label]))
        console.print(f"{label}: loss {ev['loss']:.4f} excess {rows[label]['excess']:+.4f} ({secs:.0f} s)")
    van = rows["averaging"]["excess"]
    for r in rows.values():
        r["ratio"] = r["excess"] / van
    budget = f"{args.train_steps} steps" if args.train_steps else "the preset's budget"
    width = f", d_model {args.width}" if args.width else ""
    lines = [
        f"### Universe variants, {args.preset}{width}: {args.models} models (seeds 0..{args.models - 1}), "
        f"each trained for {budget}",
        "",
        "Endpoint test losses: " + ", ".join(f"{x:.3f}" for x in ends),
        "",
        "| merge | test loss | acc | excess E | E / E(average) | seconds |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {k} | {r['loss']:.4f} | {r['acc']:.4f} | {r['excess']:+.4f} | {r['ratio']:.3f} | {r['seconds']:.0f} |"
        for k, r in rows.items()
    ]
    md = "\n".join(lines) + "\n"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stem = Path(args.out) / (f"universe_variants_{args.preset}" + (f"_d{args.width}" if args.width else ""))
    provenance.write(
        stem.with_suffix(".json"),
        {
            "preset": args.preset,
            "models": args.models,
            "width": args.width,
            "train_steps": args.train_steps,
            "refine_steps": args.refine_steps,
            "threads": args.threads,
            "endpoints": ends,
            "rows": rows,
        },
    )
    print(md)


if __name__ == "__main__":
    main()
