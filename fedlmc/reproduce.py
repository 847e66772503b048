"""The paper's Table 1 on our presets: loss barriers of every alignment method over pairs of seeds."""

from __future__ import annotations

import itertools
import math
import time
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch.nn as nn

from fedlmc import provenance
from fedlmc.matching import (
    activation_matching,
    learned_matching,
    relaxed_model,
    residual_activation_cross,
    weight_matching,
)
from fedlmc.merging.averaging import interpolate
from fedlmc.merging.barrier import Curve, barrier, interpolation_curve, plot_curves
from fedlmc.merging.distill import calibrated
from fedlmc.options import Learning, Matching
from fedlmc.symmetry import Transform, apply_transform, canonicalize
from fedlmc.train import pick_device


def _wm(residual: str = "orthogonal", keep_layernorm: bool = False, ff_scale: bool = False) -> Callable:
    def run(a, b, splits, ctx):
        return weight_matching(a, b, Matching(residual=residual, ff_scale=ff_scale), keep_layernorm=keep_layernorm)

    return run


def _act(a, b, splits, ctx):
    return activation_matching(a, b, splits.train)


def _wm_act(a, b, splits, ctx):
    return weight_matching(a, b, residual_acts=residual_activation_cross(a, b, splits.train))


def _learned(perms_only: bool, start: str = "wm-orth-factored", relax: str = "ste") -> Callable:
    def run(a, b, splits, ctx):
        return learned_matching(
            a,
            b,
            splits.train,
            ctx[start],
            Learning(steps=ctx["learned_steps"], relax=relax),
            perms_only=perms_only,
            progress=ctx["progress"],
        )

    return run


# key -> (label, transform builder or None for averaging, merge form, keep_layernorm)
METHODS: dict[str, tuple[str, Optional[Callable], str, bool]] = {
    "average": ("averaging", None, "factored", False),
    # the width-and-temperature control (Ito et al., ICLR 2026): averaging, each interpolated
    # model's softmax temperature calibrated on the validation split
    "average-temperature": ("averaging, temperature calibrated", None, "factored", False),
    "activation": ("activation matching (factored)", _act, "factored", False),
    "wm-perm-circuit": (
        "weight matching, permutation residual (circuit)",
        _wm(residual="permutation"),
        "circuit",
        False,
    ),
    "wm-orth-circuit": ("weight matching, orthogonal residual (circuit)", _wm(), "circuit", False),
    "wm-orth-factored": ("weight matching, orthogonal (factored)", _wm(), "factored", False),
    # the semi-permutation level's FF scales (ReLU, SwiGLU; ``Matching.ff_scale``): GELU models match as above
    "wm-orth-scale": ("weight matching, orthogonal + FF scales (factored)", _wm(ff_scale=True), "factored", False),
    "wm-orth-keepln": (
        "weight matching, orthogonal, O·1 = 1 (LayerNorm kept)",
        _wm(keep_layernorm=True),
        "factored",
        True,
    ),
    "wm-act-factored": ("weight matching + residual activations (factored)", _wm_act, "factored", False),
    "wm-act-circuit": ("weight matching + residual activations (circuit)", _wm_act, "circuit", False),
    "learned": ("learned matching (factored)", _learned(False), "factored", False),
    "learned-perms": ("learned matching, permutations only (factored)", _learned(True), "factored", False),
    "learned-scale": (
        "learned matching + FF scales (factored)",
        _learned(False, start="wm-orth-scale"),
        "factored",
        False,
    ),
    # the relaxation: learned matching through Sinkhorn's soft maps, merged with the hard maps they round
    # to, or (the relaxed merge) with the soft maps themselves: λ·A + (1 − λ)·S(B), λ = 0 being B itself
    "learned-sinkhorn": (
        "learned matching, Sinkhorn relaxation (factored)",
        _learned(False, relax="sinkhorn"),
        "factored",
        False,
    ),
    "learned-relaxed": ("learned matching, Sinkhorn, relaxed merge (factored)", None, "factored", False),
}


def seed_pairs(pairs: int) -> list[tuple[int, int]]:
    """The first ``pairs`` pairs of the fewest seeds that provide them: (0,1), (0,2), (1,2), (0,3) ..."""
    n = 2
    while n * (n - 1) // 2 < pairs:
        n += 1
    return sorted(itertools.combinations(range(n), 2), key=lambda p: (p[1], p[0]))[:pairs]


def _calibrated_on(data) -> Callable:
    def run(a, b, lam):
        return calibrated(interpolate(a, b, lam), data)

    return run


def pair_curves(
    a: nn.Module,
    b: nn.Module,
    splits,
    methods: Sequence[str],
    learned_steps: int = 300,
    progress: bool = True,
    log: Callable[[str], None] = print,
    device: Optional[str] = None,
) -> dict[str, dict]:
    """Every method's interpolation curve for one pair (reusing weight matching as learned's init).
    The curves are evaluated on ``device`` (default: CUDA when present, else the CPU)."""
    ctx: dict = {"learned_steps": learned_steps, "progress": progress}
    dev = pick_device(device)
    out: dict[str, dict] = {}
    ca, cb = canonicalize(a), canonicalize(b)
    order = sorted(methods, key=lambda k: k.startswith("learned"))  # learned needs wm-orth-factored first
    if any(k.startswith("learned") for k in methods) and "wm-orth-factored" not in methods:
        order.insert(0, "wm-orth-factored")
    if "learned-scale" in methods and "wm-orth-scale" not in order:
        order.insert(0, "wm-orth-scale")
    if "learned-relaxed" in order:  # after the Sinkhorn-learned transform it reads
        order = [k for k in order if k not in ("learned-relaxed", "learned-sinkhorn")] + [
            "learned-sinkhorn",
            "learned-relaxed",
        ]
    for key in order:
        label, build, form, keep = METHODS[key]
        t0 = time.time()
        if key == "average-temperature":
            curve = interpolation_curve(a, b, splits.test, interpolate=_calibrated_on(splits.val), device=dev)
        elif key == "learned-relaxed":
            curve = _relaxed_curve(ca, cb, ctx["learned-sinkhorn"], splits.test, dev)
        elif build is None:
            curve = interpolation_curve(a, b, splits.test, device=dev)
        else:
            T: Transform = ctx.get(key) or build(a, b, splits, ctx)
            ctx[key] = T
            aligned = apply_transform(cb, T)
            curve = interpolation_curve(
                ca,
                aligned,
                splits.test,
                interpolate=partial(interpolate, form=form, keep_layernorm=keep),
                device=dev,
            )
        secs = time.time() - t0
        if key in methods:
            out[key] = {
                "curve": curve.to_dict(),
                "barrier": barrier(curve),
                "acc_mid": curve.acc[len(curve.acc) // 2],
                "seconds": secs,
            }
            log(f"  {label:<58s} barrier {out[key]['barrier']:.4f}  ({secs:.0f} s)")
    return out


def _relaxed_curve(ca: nn.Module, cb: nn.Module, T: Transform, data, dev) -> Curve:
    """The relaxed merge's path: λ·A + (1 − λ)·S(B) for λ > 0 (S: the final soft maps), and B itself at
    λ = 0, so its barrier is measured against the real endpoints."""
    soft = interpolation_curve(ca, relaxed_model(cb, T), data, device=dev)
    end = interpolation_curve(ca, apply_transform(cb, T), data, lambdas=[0.0], device=dev)
    i = soft.lambdas.index(0.0)
    soft.loss[i], soft.acc[i] = end.loss[0], end.acc[0]
    return soft


def summarise(per_pair: list[dict[str, dict]], methods: Sequence[str]) -> dict[str, dict]:
    """Mean ± standard error of the barrier (and λ = 0.5 accuracy) over pairs; ratio to averaging's."""
    rows = {}
    for key in methods:
        vals = [p[key]["barrier"] for p in per_pair]
        accs = [p[key]["acc_mid"] for p in per_pair]
        n = len(vals)
        mean = sum(vals) / n
        se = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1) / n) if n > 1 else 0.0
        rows[key] = {
            "label": METHODS[key][0],
            "barrier_mean": mean,
            "barrier_se": se,
            "acc_mid": sum(accs) / n,
            "seconds": sum(p[key]["seconds"] for p in per_pair) / n,
            "barriers": vals,
        }
    if "average" in rows and rows["average"]["barrier_mean"] > 0:
        for r in rows.values():
            r["ratio"] = r["barrier_mean"] / rows["average"]["barrier_mean"]
    return rows


def markdown(preset: str, rows: dict[str, dict], pairs: list, show_acc: bool, test_losses: dict) -> str:
    head = (
        "| method | loss barrier (mean ± s.e.) | × average |"
        + (" acc at λ = 0.5 |" if show_acc else "")
        + " s / pair |"
    )
    sep = "|---|---|---|" + ("---|" if show_acc else "") + "---|"
    lines = [
        f"### {preset}: {len(pairs)} pair(s) of seeds {pairs}",
        "",
        "Endpoint test losses: " + ", ".join(f"seed {s} {l:.3f}" for s, l in sorted(test_losses.items())),
        "",
        head,
        sep,
    ]
    for r in rows.values():
        ratio = f"{r['ratio']:.3f}×" if "ratio" in r else "–"
        acc = f" {r['acc_mid']:.3f} |" if show_acc else ""
        lines.append(
            f"| {r['label']} | {r['barrier_mean']:.3f} ± {r['barrier_se']:.3f} | {ratio} |{acc} {r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot_mean_curves(per_pair: list[dict[str, dict]], methods: Sequence[str], path: Path, title: str) -> Path:
    curves = {}
    for key in methods:
        cs = [Curve(**p[key]["curve"]) for p in per_pair]
        n = len(cs)
        curves[METHODS[key][0]] = Curve(
            cs[0].lambdas,
            [sum(c.loss[i] for c in cs) / n for i in range(len(cs[0].loss))],
            [sum(c.acc[i] for c in cs) / n for i in range(len(cs[0].acc))],
        )
    return plot_curves(curves, path, title=title)


def write_results(out_dir: Path, preset: str, payload: dict, per_pair: list, methods: Sequence[str]) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    seeds = sorted({int(s) for pair in payload.get("pairs", []) for s in pair})
    provenance.write(out_dir / f"reproduce_{preset}.json", payload, seeds)
    png = plot_mean_curves(
        per_pair, methods, out_dir / f"reproduce_{preset}.png", f"{preset}: mean interpolation curves"
    )
    return {
        "json": str(out_dir / f"reproduce_{preset}.json"),
        "png": str(png),
    }
