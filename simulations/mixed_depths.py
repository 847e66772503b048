"""One-shot merges of clients of different depths: a 4-layer and a 6-layer client against two 6-layer ones.

Writes results/mixed_depths_<preset>.json. Usage:
    python -m simulations mixed_depths [--preset gpt2-tiny] [--triples 3] [--steps 1500] [--distill-steps 100]

Per seed triple ``t``: three clients trained independently (their own initialisation and batches) on the
same data, two of 6 layers (seeds 3t, 3t+1) and one of 4 (seed 3t+2). Merged once, equal weights:

* ``6+6``: the two 6-layer clients, weight-matched universe (``depth_merge`` at one depth);
* ``4+6``: the 4-layer client with the first 6-layer one, placed by the layer matching (dynamic
  programme on the blocks' activations: CKA on the server's first 16 validation sequences), padded with
  identity blocks, each block averaged over its holders; ``4+6 weights``: placed without data (the
  aligned circuits' distances; the block signatures' first placement is recorded too);
* ``4+6 zeros``: the same placement, identity padding averaged as zeros;
* ``4+6 prefix``: the 4 blocks placed at the first 4 layers (InclusiveFL / DepthFL's placement), aligned;
* ``both axes``: the 4-layer client at half width (d_model and d_ff halved, seed 3t+2) with the first
  6-layer one, merged into the full width and depth;
* ``4+6 distilled``: ``4+6`` distilled toward the two clients' ensemble on the server's unlabelled data
  (the validation split), as ``aligned-distilled`` does at one depth; ``FedDF zeros``: the same from the
  plain average, the 4-layer client zero-padded after its blocks (FedDF's start);
* every placement of 4 blocks in 6 (15), to see whether the dynamic programme picks the best one.

Test loss of each client and merge; the gap is ``4+6`` minus ``6+6``. Trained clients are kept under
``--cache`` and reused by a rerun.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch
from _models import width_arch  # noqa: E402  (simulations/, the script's own folder)
from _results import environment, write_results  # noqa: E402

from fedlmc.commands import trained
from fedlmc.data import load, split
from fedlmc.merging.depths import match_layers, pad_to_depth
from fedlmc.merging.distill import distill
from fedlmc.merging.mixed_depths import block_average, depth_merge
from fedlmc.models import preset_config
from fedlmc.options import Distill
from fedlmc.symmetry import canonicalize, rebuild
from fedlmc.train import evaluate


def server_inputs(splits, sequences: int = 16) -> torch.Tensor:
    """The first inputs of the server's unlabelled data (the validation split): the activation cost's."""
    return next(iter(splits.val.batches(sequences)))[0]


def distilled(student, teachers, splits, steps: int) -> tuple:
    """``student`` distilled toward ``teachers``' ensemble on the validation split (its last quarter for the
    checks): the server's unlabelled data, as ``aligned-distilled`` uses it."""
    learn, check = split(splits.val, 0.75)
    return distill(student, teachers, Distill(data=learn, check_data=check, steps=steps))


def loss(model, data) -> float:
    return round(evaluate(model, data)["loss"], 5)


def clients_of(preset: str, splits, t: int, steps: int, cache: Path, narrow: bool = True) -> list:
    """Triple ``t``'s clients (two of 6 layers, one of 4, and with ``narrow`` one of 4 at half width, seed
    3t+2 too), trained once and kept under ``cache``."""
    over = dict(steps=steps) if steps else {}
    half = width_arch(preset, preset_config(preset).d_model // 2)
    kinds = [(3 * t, {"n_layer": 6}), (3 * t + 1, {"n_layer": 6}), (3 * t + 2, {"n_layer": 4})]
    kinds += [(3 * t + 2, {"n_layer": 4, **half})] if narrow else []
    out = []
    for seed, arch in kinds:
        print(f"triple {t}: {preset} {arch}, seed {seed}", flush=True)
        model = trained(preset, seed, splits, cache, progress=False, model_overrides=arch, **over)
        out.append(canonicalize(model.eval()))
    return out


def one_triple(preset: str, dataset: str, t: int, steps: int, cache: Path, distill_steps: int) -> dict:
    splits = load(dataset)
    clients = clients_of(preset, splits, t, steps, cache)
    deep_a, deep_b, shallow, narrow = clients
    out = {"seeds": [3 * t, 3 * t + 1, 3 * t + 2], "clients": [loss(c, splits.test) for c in clients]}
    server = server_inputs(splits)  # the server's unlabelled inputs: the layer matching's activations
    t0 = time.perf_counter()
    placed = match_layers(shallow, deep_a, data=server)
    out["match_seconds"] = round(time.perf_counter() - t0, 3)
    out["placement"] = placed.positions
    t0 = time.perf_counter()
    out["placement_weights"] = match_layers(shallow, deep_a).positions  # no data: the aligned circuits
    out["match_seconds_weights"] = round(time.perf_counter() - t0, 3)
    out["placement_signatures"] = match_layers(shallow, deep_a, rounds=0).positions  # their first placement
    at = [None, placed.positions]
    merges = {
        "6+6": dict(models=[deep_a, deep_b]),
        "4+6": dict(models=[deep_a, shallow], positions=at),
        "4+6 weights": dict(models=[deep_a, shallow], positions=[None, out["placement_weights"]]),
        "4+6 zeros": dict(models=[deep_a, shallow], positions=at, padding="zeros"),
        "4+6 prefix": dict(models=[deep_a, shallow], positions=[None, [0, 1, 2, 3]]),
        "both axes": dict(models=[deep_a, narrow], data=server),  # ½ width and 4 layers with full width and 6
    }
    kept = {}
    for name, kw in merges.items():
        t0 = time.perf_counter()
        kept[name] = depth_merge(kw.pop("models"), **kw).universe
        out[name] = {"test_loss": loss(kept[name], splits.test), "seconds": round(time.perf_counter() - t0, 2)}
        print(f"triple {t}: {name} {out[name]['test_loss']:.4f}", flush=True)
    if distill_steps:
        # FedDF's student: the plain (unaligned) average, the shallow client zero-padded after its blocks
        padded = pad_to_depth(shallow, range(4), 6)
        plain = block_average([deep_a.state_dict(), padded.state_dict()], [1.0, 1.0], [range(6), range(4)], "zeros")
        for name, student in (("4+6 distilled", kept["4+6"]), ("FedDF zeros", rebuild(deep_a, plain))):
            t0 = time.perf_counter()
            model, rec = distilled(student, [deep_a, shallow], splits, distill_steps)
            out[name] = {
                "test_loss": loss(model, splits.test),
                "start": loss(student, splits.test),
                "seconds": round(time.perf_counter() - t0, 2),
                "best_step": rec["best_step"],
            }
            print(f"triple {t}: {name} {out[name]['start']:.4f} → {out[name]['test_loss']:.4f}", flush=True)
        out["distilled_below_both"] = out["4+6 distilled"]["test_loss"] < min(out["clients"][0], out["clients"][2])
    every = {}
    for positions in itertools.combinations(range(6), 4):
        merged = depth_merge([deep_a, shallow], positions=[None, list(positions)], iterations=1)
        every[",".join(map(str, positions))] = loss(merged.universe, splits.test)
    out["every_placement"] = every
    best = min(every, key=every.get)
    out["best_placement"] = [int(p) for p in best.split(",")]
    out["picked_is_best"] = out["best_placement"] == placed.positions
    out["gap"] = round(out["4+6"]["test_loss"] - out["6+6"]["test_loss"], 5)
    out["both_axes_gap"] = round(out["both axes"]["test_loss"] - out["6+6"]["test_loss"], 5)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-tiny")
    p.add_argument("--dataset", default=None, help="default: the preset's")
    p.add_argument("--triples", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500, help="training steps per client (0: the preset's budget)")
    p.add_argument("--distill-steps", type=int, default=100, help="the distilled rows' steps (0: none)")
    p.add_argument("--cache", default="runs/cache", help="trained clients are kept here and reused")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from fedlmc.models import preset_dataset

    dataset = args.dataset or preset_dataset(args.preset)
    triples = [
        one_triple(args.preset, dataset, t, args.steps, Path(args.cache), args.distill_steps)
        for t in range(args.triples)
    ]
    gaps = [r["gap"] for r in triples]
    write_results(
        args.out or f"results/mixed_depths_{args.preset}.json",
        {
            "preset": args.preset,
            "dataset": dataset,
            "steps": args.steps,
            "triples": triples,
            "gap_mean": round(sum(gaps) / len(gaps), 5),
            "both_axes_gap_mean": round(sum(r["both_axes_gap"] for r in triples) / len(triples), 5),
            "distill_steps": args.distill_steps,
            "picked_best": sum(r["picked_is_best"] for r in triples),
            "environment": environment(),
        },
        seeds=[s for r in triples for s in r["seeds"]],
    )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
