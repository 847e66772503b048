"""What learned matching's budget buys: loss barrier against steps (0 = weight matching, 100, one epoch,
300, 1000), and variants that stay within one epoch of the training split (cosine schedule with a
higher rate, smaller batches, the circuit form).

Writes results/learned_budget_{preset}.{json,png} and prints its table. Usage:
    python simulations/learned_budget.py --preset vit-tiny [--pairs 3] [--train-steps N]
Models come from the reproduction's cache (the preset's training budget unless --train-steps); each
pair's measurements are cached, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from functools import partial
from pathlib import Path

import torch
from _models import add_model_args, trained_models  # noqa: E402  (simulations/, the script's own folder)

from fedlmc import provenance
from fedlmc.commands import console, load_splits
from fedlmc.matching import learned_matching, weight_matching
from fedlmc.merging.averaging import interpolate
from fedlmc.merging.barrier import barrier, interpolation_curve
from fedlmc.options import Learning
from fedlmc.reproduce import seed_pairs
from fedlmc.symmetry import apply_transform, canonicalize

BATCH = 64  # learned matching's default batch size: one epoch is len(train) / 64 steps


def variants(epoch: int, long: int = 1000) -> dict[str, dict]:
    """name -> learned_matching options (``steps`` included) and the snapshots to measure."""
    return {
        "constant": dict(steps=long, snapshots=sorted(n for n in {100, epoch, 300, long} if n <= long)),
        "cosine, lr ×3, one epoch": dict(steps=epoch, lr=3e-3, schedule="cosine"),
        "batch 16, one epoch": dict(steps=epoch * BATCH // 16, batch_size=16),
        "batch 16, cosine, lr ×3, one epoch": dict(
            steps=epoch * BATCH // 16, batch_size=16, lr=3e-3, schedule="cosine"
        ),
        "circuit form, one epoch": dict(steps=epoch, form="circuit"),
        "Sinkhorn permutations, 300 steps": dict(steps=300, relax="sinkhorn"),
        "batch 16, cosine, lr ×10, one epoch": dict(
            steps=epoch * BATCH // 16, batch_size=16, lr=1e-2, schedule="cosine"
        ),
        "batch 8, cosine, lr ×3, one epoch": dict(steps=epoch * BATCH // 8, batch_size=8, lr=3e-3, schedule="cosine"),
        "Sinkhorn, batch 16, cosine, lr ×3, one epoch": dict(
            steps=epoch * BATCH // 16, batch_size=16, lr=3e-3, schedule="cosine", relax="sinkhorn"
        ),
        "Sinkhorn, batch 8, cosine, lr ×3, one epoch": dict(
            steps=epoch * BATCH // 8, batch_size=8, lr=3e-3, schedule="cosine", relax="sinkhorn"
        ),
        "batch 16, cosine, lr ×30, one epoch": dict(
            steps=epoch * BATCH // 16, batch_size=16, lr=3e-2, schedule="cosine"
        ),
        "Sinkhorn, batch 16, cosine, lr ×10, one epoch": dict(
            steps=epoch * BATCH // 16, batch_size=16, lr=1e-2, schedule="cosine", relax="sinkhorn"
        ),
    }


def measure(ca, cb, T, test, form: str = "factored") -> float:
    curve = interpolation_curve(ca, apply_transform(cb, T), test, interpolate=partial(interpolate, form=form))
    return barrier(curve)


def one_pair(a, b, splits, epoch: int, long: int, cache: Path, tag: str, log, only=None) -> dict:
    """Every variant's barriers for one pair; each variant's result is cached on its own (``tag`` names
    the pair), so adding a variant later reuses the others."""
    ca, cb = canonicalize(a), canonicalize(b)
    base_file = cache / f"budget-{tag}-base.json"
    out: dict = json.loads(base_file.read_text()) if base_file.is_file() else {}
    t0 = time.time()
    wm = weight_matching(a, b)
    if not out:
        out["average"] = barrier(interpolation_curve(a, b, splits.test))
        out["weight matching"] = {
            "factored": measure(ca, cb, wm, splits.test),
            "seconds": time.time() - t0,
            "circuit": measure(ca, cb, wm, splits.test, "circuit"),
        }
        base_file.write_text(json.dumps(out))
    log(f"  average {out['average']:.4f}, weight matching {out['weight matching']['factored']:.4f}")
    for name, kw in variants(epoch, long).items():
        if only and name != "constant" and not any(o in name for o in only):
            continue
        f = cache / f"budget-{tag}-{hashlib.sha1(json.dumps([name, kw]).encode()).hexdigest()[:10]}.json"
        if f.is_file():
            out[name] = json.loads(f.read_text())
            continue
        kw = dict(kw)
        snaps = kw.pop("snapshots", [])
        form = kw.pop("form", "factored")
        T = learned_matching(a, b, splits.train, wm, Learning(**kw), form=form, snapshots=snaps, progress=False)
        row = {
            "steps": kw["steps"],
            "seconds": T.info["seconds"],
            "form": form,
            "options": {k: v for k, v in kw.items() if k != "steps"},
            "barrier": measure(ca, cb, T, splits.test, form),
        }
        if form == "factored":
            row["barrier_circuit_merge"] = measure(ca, cb, T, splits.test, "circuit")
        row["snapshots"] = {str(n): measure(ca, cb, S, splits.test, form) for n, S in T.info["snapshots"].items()}
        out[name] = row
        f.write_text(json.dumps(row))
        log(f"  {name}: {row['steps']} steps, barrier {row['barrier']:.4f} ({row['seconds']:.0f} s) {row['snapshots']}")
    return out


def summary(per_pair: list[dict], epoch: int, long: int) -> list[dict]:
    """Rows (label, steps, mean barrier, s.e., × average) averaged over pairs."""

    def stats(vals):
        n = len(vals)
        m = sum(vals) / n
        return m, (math.sqrt(sum((v - m) ** 2 for v in vals) / (n - 1) / n) if n > 1 else 0.0)

    van = stats([p["average"] for p in per_pair])[0]
    rows = [
        ("averaging", 0, [p["average"] for p in per_pair]),
        ("weight matching (factored)", 0, [p["weight matching"]["factored"] for p in per_pair]),
        ("weight matching (circuit merge)", 0, [p["weight matching"]["circuit"] for p in per_pair]),
    ]
    for n in variants(epoch, long)["constant"]["snapshots"]:
        label = f"learned, constant rate, {n} steps" + (" (one epoch)" if n == epoch else "")
        rows.append((label, n, [p["constant"]["snapshots"][str(n)] for p in per_pair]))
    rows.append(
        (
            f"learned, constant rate, {long} steps, circuit merge",
            long,
            [p["constant"]["barrier_circuit_merge"] for p in per_pair],
        )
    )
    for name in [k for k in list(variants(epoch, long))[1:] if all(k in p for p in per_pair)]:
        rows.append((f"learned, {name}", per_pair[0][name]["steps"], [p[name]["barrier"] for p in per_pair]))
    out = []
    for label, steps, vals in rows:
        m, se = stats(vals)
        out.append(
            {
                "label": label,
                "steps": steps,
                "barrier_mean": m,
                "barrier_se": se,
                "ratio": m / van if van > 0 else float("nan"),
                "barriers": vals,
            }
        )
    return out


def markdown(preset: str, rows: list[dict], pairs, epoch: int, budget: str) -> str:
    lines = [
        f"### Learned matching's budget, {preset}: {len(pairs)} pair(s) {pairs}, models trained for {budget}; "
        f"one epoch = {epoch} steps of batch {BATCH}",
        "",
        "| method | steps | loss barrier (mean ± s.e.) | × average |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['steps']} | {r['barrier_mean']:.3f} ± {r['barrier_se']:.3f} | {r['ratio']:.3f}× |"
        )
    return "\n".join(lines) + "\n"


def plot(preset: str, rows: list[dict], epoch: int, path: Path) -> None:
    """Left: barrier × averaging's against epochs of data seen (constant rate, batch 64); right: every
    variant that stays within one epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = [rows[1]] + [
        r for r in rows if r["label"].startswith("learned, constant rate") and "circuit" not in r["label"]
    ]
    one = [r for r in rows if "one epoch" in r["label"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 1.3]})
    left.plot([r["steps"] / epoch for r in curve], [r["ratio"] for r in curve], marker="o")
    for r in curve:
        left.annotate(
            f"{r['steps']}", (r["steps"] / epoch, r["ratio"]), textcoords="offset points", xytext=(4, 4), fontsize=7
        )
    left.axvline(1, color="grey", ls=":")
    left.set_xscale("symlog", linthresh=1)
    left.set_xlabel("epochs (constant rate, batch 64; labels: steps)")
    left.set_ylabel("barrier × averaging's")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    names = [r["label"].replace("learned, ", "").replace(", one epoch", "").replace(" (one epoch)", "") for r in one]
    van = rows[0]["barrier_mean"]  # rows[0] is averaging
    right.barh(
        range(len(one)),
        [r["ratio"] for r in one],
        xerr=[r["barrier_se"] / van if van > 0 else 0.0 for r in one],
        color="tab:blue",
        alpha=0.7,
    )
    right.set_yticks(range(len(one)), names, fontsize=7)
    right.set_xlabel("barrier × averaging's, one epoch of data (± s.e.)")
    right.grid(alpha=0.3, axis="x")
    fig.suptitle(f"{preset}: what learned matching's budget buys")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    provenance.watch()  # samples the load through the run, for the results file's record
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="vit-tiny")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--only", nargs="+", help="run only the variants whose name contains one of these (and 'constant')")
    p.add_argument("--long", type=int, default=1000, help="steps of the constant-rate run (snapshots below it)")
    add_model_args(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    splits = load_splits(args.preset, args)
    epoch = math.ceil(len(splits.train) / BATCH)
    pairs = seed_pairs(args.pairs)
    models, over = trained_models(args, sorted({s for q in pairs for s in q}), splits)
    per_pair = []
    for a, b in pairs:
        tag = (
            f"{args.preset}-{a}-{b}-"
            + hashlib.sha1(
                json.dumps([models[a].meta.get("seconds"), models[b].meta.get("seconds"), over]).encode()
            ).hexdigest()[:8]
        )
        console.rule(f"{args.preset} pair ({a}, {b})")
        per_pair.append(
            one_pair(models[a], models[b], splits, epoch, args.long, Path(args.cache), tag, console.print, args.only)
        )
    rows = summary(per_pair, epoch, args.long)
    budget = (f"{args.train_steps} steps" if args.train_steps else "the preset's budget") + (
        f", d_model {args.width}" if args.width else ""
    )
    md = markdown(args.preset, rows, pairs, epoch, budget)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stem = Path(args.out) / (f"learned_budget_{args.preset}" + (f"_d{args.width}" if args.width else ""))
    provenance.write(
        stem.with_suffix(".json"),
        {
            "preset": args.preset,
            "pairs": pairs,
            "epoch_steps": epoch,
            "batch": BATCH,
            "train_steps": args.train_steps,
            "threads": args.threads,
            "rows": rows,
            "per_pair": per_pair,
        },
    )
    plot(args.preset, rows, epoch, stem.with_suffix(".png"))
    print(md)


if __name__ == "__main__":
    main()
