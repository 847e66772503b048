"""One-shot merges of clients of different depths: a 4-layer and a 6-layer client against two 6-layer ones.

Writes results/mixed_depths_<preset>.json. Usage:
    python -m simulations mixed_depths [--preset gpt2-tiny] [--triples 3] [--steps 1500]

Per seed triple ``t``: three clients trained independently (their own initialisation and batches) on the
same data, two of 6 layers (seeds 3t, 3t+1) and one of 4 (seed 3t+2). Merged once, equal weights:

* ``6+6``: the two 6-layer clients, weight-matched universe (``depth_merge`` at one depth);
* ``4+6``: the 4-layer client with the first 6-layer one, placed by the layer matching (dynamic
  programme on the weight-based cost), padded with identity blocks, each block averaged over its holders;
* ``4+6 zeros``: the same placement, identity padding averaged as zeros;
* ``4+6 prefix``: the 4 blocks placed at the first 4 layers (InclusiveFL / DepthFL's placement), aligned;
* every placement of 4 blocks in 6 (15), to see whether the dynamic programme picks the best one.

Test loss of each client and merge; the gap is ``4+6`` minus ``6+6``.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from _results import environment, write_results  # noqa: E402  (simulations/, the script's own folder)

from fedlmc.data import load
from fedlmc.merging.depths import match_layers
from fedlmc.merging.mixed_depths import depth_merge
from fedlmc.symmetry import canonicalize
from fedlmc.train import evaluate, train_preset


def loss(model, data) -> float:
    return round(evaluate(model, data)["loss"], 5)


def one_triple(preset: str, dataset: str, t: int, steps: int) -> dict:
    splits = load(dataset)
    clients = []
    for seed, layers in ((3 * t, 6), (3 * t + 1, 6), (3 * t + 2, 4)):
        print(f"triple {t}: training a {layers}-layer {preset}, seed {seed}", flush=True)
        over = dict(steps=steps) if steps else {}
        model, _ = train_preset(preset, splits, seed, progress=False, model_overrides={"n_layer": layers}, **over)
        clients.append(canonicalize(model.eval()))
    deep_a, deep_b, shallow = clients
    out = {"seeds": [3 * t, 3 * t + 1, 3 * t + 2], "clients": [loss(c, splits.test) for c in clients]}
    t0 = time.perf_counter()
    placed = match_layers(shallow, deep_a)
    out["match_seconds"] = round(time.perf_counter() - t0, 3)
    out["placement"] = placed.positions
    merges = {
        "6+6": dict(models=[deep_a, deep_b]),
        "4+6": dict(models=[deep_a, shallow]),
        "4+6 zeros": dict(models=[deep_a, shallow], padding="zeros"),
        "4+6 prefix": dict(models=[deep_a, shallow], positions=[None, [0, 1, 2, 3]]),
    }
    for name, kw in merges.items():
        t0 = time.perf_counter()
        merged = depth_merge(kw.pop("models"), **kw)
        out[name] = {"test_loss": loss(merged.universe, splits.test), "seconds": round(time.perf_counter() - t0, 2)}
        print(f"triple {t}: {name} {out[name]['test_loss']:.4f}", flush=True)
    every = {}
    for positions in itertools.combinations(range(6), 4):
        merged = depth_merge([deep_a, shallow], positions=[None, list(positions)], iterations=1)
        every[",".join(map(str, positions))] = loss(merged.universe, splits.test)
    out["every_placement"] = every
    best = min(every, key=every.get)
    out["best_placement"] = [int(p) for p in best.split(",")]
    out["picked_is_best"] = out["best_placement"] == placed.positions
    out["gap"] = round(out["4+6"]["test_loss"] - out["6+6"]["test_loss"], 5)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-tiny")
    p.add_argument("--dataset", default=None, help="default: the preset's")
    p.add_argument("--triples", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500, help="training steps per client (0: the preset's budget)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from fedlmc.models import preset_dataset

    dataset = args.dataset or preset_dataset(args.preset)
    triples = [one_triple(args.preset, dataset, t, args.steps) for t in range(args.triples)]
    gaps = [r["gap"] for r in triples]
    write_results(
        args.out or f"results/mixed_depths_{args.preset}.json",
        {
            "preset": args.preset,
            "dataset": dataset,
            "steps": args.steps,
            "triples": triples,
            "gap_mean": round(sum(gaps) / len(gaps), 5),
            "picked_best": sum(r["picked_is_best"] for r in triples),
            "environment": environment(),
        },
        seeds=[s for r in triples for s in r["seeds"]],
    )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
