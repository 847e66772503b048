"""Width study: do wider models connect better? Barriers of averaging, of the width-and-
temperature control (averaging with each interpolated model's softmax temperature calibrated on
the validation split: Ito et al., ICLR 2026), of weight matching and of learned matching for one pair of
independently trained models per width, same depth.

Writes results/width_study_{arch}.{json,png} and prints its table. Usage:
    python simulations/width_study.py --arch gpt2 [--widths 64 128 256] [--train-steps 1000] [--seeds 0 1]
    python simulations/width_study.py --arch vit  [--widths 32 64 128]
Only the width changes: d_model = d, d_ff = the preset's ratio × d, the preset's head count (so d_head
grows with d), depth and data as the preset. Models and each width's barriers are cached under
--cache, so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from _models import add_model_args, trained_models, width_arch  # noqa: E402  (simulations/, the script's own folder)

from fedlmc import provenance
from fedlmc.commands import console, load_splits
from fedlmc.models import preset_config
from fedlmc.reproduce import METHODS, pair_curves

PRESET = {"gpt2": "gpt2-tiny", "vit": "vit-tiny"}
WIDTHS = {"gpt2": [64, 128, 256], "vit": [32, 64, 128]}
METHOD_KEYS = ["average", "average-temperature", "wm-orth-circuit", "wm-orth-factored", "learned"]


def one_width(preset: str, d: int, splits, args) -> dict:
    """Train (or reuse) the pair at width ``d`` and measure every method's barrier on the test split."""
    base = preset_config(preset)
    arch = width_arch(preset, d)
    over = {"steps": args.train_steps} if args.train_steps else {}
    key = hashlib.sha1(
        json.dumps([preset, arch, over, args.seeds, args.learned_steps, METHOD_KEYS]).encode()
    ).hexdigest()[:10]
    cached = Path(args.cache) / f"width-{preset}-d{d}-{key}.json"
    if cached.is_file():
        console.print(f"width {d}: reusing {cached}")
        return json.loads(cached.read_text())
    t0 = time.time()
    models, _ = trained_models(argparse.Namespace(**{**vars(args), "preset": preset, "width": d}), args.seeds, splits)
    a, b = (models[s] for s in args.seeds)
    train_s = time.time() - t0
    console.rule(f"{preset} at d = {d}: {sum(p.numel() for p in a.parameters()) / 1e6:.2f}M parameters")
    curves = pair_curves(a, b, splits, METHOD_KEYS, args.learned_steps, progress=not args.quiet, log=console.print)
    van = curves["average"]["barrier"]
    row = {
        "d_model": d,
        **arch,
        "n_head": base.n_head,
        "d_head": d // base.n_head,
        "parameters": sum(p.numel() for p in a.parameters()),
        "test_loss": [m.meta.get("test", {}).get("loss") for m in (a, b)],
        "train_steps": [m.meta.get("steps") for m in (a, b)],
        "train_seconds": round(train_s, 1),
        "barrier": {k: c["barrier"] for k, c in curves.items()},
        "ratio": {k: c["barrier"] / van for k, c in curves.items()},
        "acc_mid": {k: c["acc_mid"] for k, c in curves.items()},
        "seconds": {k: round(c["seconds"], 1) for k, c in curves.items()},
        "curves": {k: c["curve"] for k, c in curves.items()},
    }
    cached.write_text(json.dumps(row))
    return row


def markdown(arch: str, rows: list[dict], args) -> str:
    budget = f"{args.train_steps} steps" if args.train_steps else "the preset's budget"
    lines = [
        f"### Width study, {arch} ({PRESET[arch]}'s depth and data; seeds {args.seeds}, one pair per width; "
        f"each model trained for {budget}; learned matching {args.learned_steps} steps from weight matching)",
        "",
        "| d_model | parameters | endpoint test losses | "
        + " | ".join(METHODS[k][0] for k in METHOD_KEYS)
        + " | weight matching × average | learned × average | weight matching × the control |",
        "|---|---|---|" + "---|" * len(METHOD_KEYS) + "---|---|---|",
    ]
    for r in rows:
        losses = " / ".join(f"{x:.3f}" for x in r["test_loss"])
        bars = " | ".join(f"{r['barrier'][k]:.3f}" for k in METHOD_KEYS)
        lines.append(
            f"| {r['d_model']} | {r['parameters'] / 1e6:.2f}M | {losses} | {bars} | "
            f"{r['ratio']['wm-orth-circuit']:.3f}× | {r['ratio']['learned']:.3f}× | "
            f"{r['barrier']['wm-orth-circuit'] / r['barrier']['average-temperature']:.3f}× |"
        )
    return "\n".join(lines) + "\n"


def plot(arch: str, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = [r["d_model"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for i, k in enumerate(METHOD_KEYS):  # one colour per method in both panels
        left.plot(ds, [r["barrier"][k] for r in rows], marker="o", color=f"C{i}", label=METHODS[k][0])
        if k != "average":
            right.plot(ds, [r["ratio"][k] for r in rows], marker="o", color=f"C{i}", label=METHODS[k][0])
    for ax, ylabel in ((left, "loss barrier (test)"), (right, "barrier × averaging's")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ds, [str(d) for d in ds])
        ax.set_xlabel("width d_model")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    right.set_ylim(bottom=0)
    left.legend(fontsize=7)
    fig.suptitle(f"{PRESET[arch]} at several widths: one pair per width")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    provenance.watch()  # samples the load through the run, for the results file's record
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=list(PRESET), required=True)
    p.add_argument("--widths", type=int, nargs="+")
    p.add_argument("--seeds", type=int, nargs=2, default=[0, 1])
    p.add_argument("--learned-steps", type=int, default=300)
    p.add_argument("--quiet", action="store_true")
    add_model_args(p)  # --train-steps, --threads, --cache, --out (its --width is set per row here)
    args = p.parse_args()
    if args.width:
        p.error("the study's widths are --widths")
    torch.set_num_threads(args.threads)
    preset = PRESET[args.arch]
    splits = load_splits(preset, args)
    t0 = time.time()
    rows = [one_width(preset, d, splits, args) for d in (args.widths or WIDTHS[args.arch])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"width_study_{args.arch}"
    payload = {
        "arch": args.arch,
        "preset": preset,
        "seeds": args.seeds,
        "steps": args.train_steps,
        "learned_steps": args.learned_steps,
        "threads": args.threads,
        "device": "cpu",
        "seconds": round(time.time() - t0, 1),
        "rows": rows,
    }
    provenance.write(stem.with_suffix(".json"), payload)
    md = markdown(args.arch, rows, args)
    plot(args.arch, rows, stem.with_suffix(".png"))
    print(md)


if __name__ == "__main__":
    main()
