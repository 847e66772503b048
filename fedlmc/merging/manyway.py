"""Many-model experiments: excess loss of universe merges, the loss over the 2-simplex of three models
(paper Fig. 4) and the width experiment (paper Fig. 3c).

The excess of a merge is ``E = L(merged) − mean_m L(θ_m)`` on the test split: how much worse the merged
model is than the models it came from, on average.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch.nn as nn

from fedlmc import provenance
from fedlmc.matching import weight_matching
from fedlmc.merging.averaging import merge
from fedlmc.merging.barrier import Curve, barrier, interpolation_curve, plot_curves
from fedlmc.merging.universe import universe_merge
from fedlmc.merging.widths import into_universe, pad, permute_masks, shape_of, unit_masks
from fedlmc.options import Matching, Refinement, Universe
from fedlmc.train import evaluate


def aligned_models(models: Sequence[nn.Module], transforms) -> tuple[list[nn.Module], list[Optional[dict]]]:
    """Every model mapped into the universe by its transform, with the masks of its real units."""
    out, masks = [], []
    for m, T in zip(models, transforms):
        out.append(into_universe(m, T))
        masks.append(
            permute_masks(
                unit_masks(m.config, T.width_map.shape, ff_lift=T.width_map.ff_lift, head_lift=T.width_map.head_lift),
                T,
            )
            if T.width_map
            else None
        )
    return out, masks


def excess(merged_loss: float, endpoint_losses: Sequence[float]) -> float:
    return merged_loss - sum(endpoint_losses) / len(endpoint_losses)


def simplex_grid(n: int = 8) -> list[tuple[float, float, float]]:
    """Barycentric points ``(i, j, n−i−j)/n`` covering the 2-simplex."""
    return [(i / n, j / n, (n - i - j) / n) for i in range(n + 1) for j in range(n + 1 - i)]


def simplex_losses(
    models: Sequence[nn.Module], data, n: int = 8, masks=None, max_batches: Optional[int] = None, form: str = "factored"
) -> list[dict]:
    """Loss and accuracy of ``merge(models, λ)`` at every point of ``simplex_grid(n)`` (three models)."""
    if len(models) != 3:
        raise ValueError(f"the simplex plot needs exactly 3 models, got {len(models)}")
    out = []
    for lam in simplex_grid(n):
        ev = evaluate(merge(models, list(lam), form=form, masks=masks), data, max_batches=max_batches)
        out.append({"lambda": list(lam), "loss": ev["loss"], "acc": ev["acc"]})
    return out


def plot_simplex(panels: dict[str, list[dict]], path: Path, title: str = "") -> Path:
    """One triangle per method, coloured by loss on a shared scale (corners are the three models)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.tri as mtri
    import numpy as np

    lo = min(p["loss"] for pts in panels.values() for p in pts)
    hi = max(p["loss"] for pts in panels.values() for p in pts)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 4.2), squeeze=False)
    corners = np.array([[0.0, 0.0], [1.0, 0.0], [0.5, 3**0.5 / 2]])
    for ax, (name, pts) in zip(axes[0], panels.items()):
        lam = np.array([p["lambda"] for p in pts])
        xy = lam @ corners
        loss = np.array([p["loss"] for p in pts])
        tri = mtri.Triangulation(xy[:, 0], xy[:, 1])
        cs = ax.tripcolor(tri, loss, shading="gouraud", vmin=lo, vmax=hi, cmap="viridis")
        centre = loss[np.argmin(np.abs(lam - 1 / 3).sum(1))]
        ax.set_title(f"{name}\nmax {loss.max():.2f}, near centre {centre:.2f}", fontsize=10)
        for k, (cx, cy) in enumerate(corners):
            ax.annotate(
                f"θ{k + 1}",
                (cx, cy),
                textcoords="offset points",
                xytext=(0, -12 if cy == 0 else 4),
                ha="center",
                fontsize=9,
            )
        ax.set_aspect("equal")
        ax.axis("off")
    fig.colorbar(cs, ax=axes[0].tolist(), shrink=0.8, label="test loss")
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _ff_scale_rows(models, refine: Refinement, iterations: int, tol: float, progress: bool, row) -> None:
    """``universe_table``'s rows whose matching also solves the FF scales: the universe, then the refined
    universe (which learns them)."""
    scaled = Universe(iterations=iterations, tol=tol, keep_layernorm=False)
    t = time.time()
    row(
        "universe + FF scales",
        universe_merge(models, matching=Matching(ff_scale=True), universe=scaled)[0],
        time.time() - t,
    )
    t = time.time()
    ref = universe_merge(models, matching=Matching(ff_scale=True), refine=refine, progress=progress, universe=scaled)[0]
    row(f"refined (α={refine.alpha:g}) + FF scales", ref, time.time() - t)


def universe_table(
    models: Sequence[nn.Module],
    splits,
    refine: Optional[Refinement] = None,
    alphas: Sequence[float] = (1.0,),
    iterations: int = Universe.iterations,
    log: Callable[[str], None] = print,
    progress: bool = True,
    simplex_n: int = 0,
    max_batches: Optional[int] = None,
    forms: Sequence[str] = ("factored",),
    tol: float = 1e-6,
    ff_scale: bool = False,
) -> dict[str, Any]:
    """Plain average vs universe (weight matching) vs Dirichlet-refined universe of ``models``:
    test loss of each merge and its excess over the mean endpoint loss. With ``simplex_n`` > 0 and
    the first three models, also the loss over their 2-simplex for each method. ``ff_scale`` adds the
    universe and the refined universe whose matching also solves the FF neurons' scales (ReLU, SwiGLU:
    ``Matching.ff_scale``; the refinement then learns them, from the first α)."""
    ends = [evaluate(m, splits.test, max_batches=max_batches) for m in models]
    end_loss = [e["loss"] for e in ends]
    rows: dict[str, Any] = {}

    def row(name: str, model: nn.Module, seconds: float) -> None:
        ev = evaluate(model, splits.test, max_batches=max_batches)
        rows[name] = {"loss": ev["loss"], "acc": ev["acc"], "excess": excess(ev["loss"], end_loss), "seconds": seconds}
        log(
            f"{name:<28s} loss {ev['loss']:.4f} acc {ev['acc']:.4f} excess {rows[name]['excess']:+.4f} "
            f"({seconds:.0f} s)"
        )

    n = len(models)
    t = time.time()
    row("average", merge(models, [1 / n] * n), time.time() - t)
    t = time.time()
    uni, T_wm = universe_merge(
        models, progress=progress, universe=Universe(iterations=iterations, tol=tol, keep_layernorm=False)
    )
    row("universe", uni, time.time() - t)
    for form in forms:
        if form != "factored":
            t = time.time()
            row(
                f"universe ({form})",
                universe_merge(
                    models, universe=Universe(iterations=iterations, tol=tol, form=form, keep_layernorm=False)
                )[0],
                time.time() - t,
            )
    # a fixed budget, every step (the table compares refinement lengths as they are); ``alphas`` override its α
    refine = refine if refine is not None else Refinement(steps=200, check_every=0)
    alphas = list(alphas)
    T_ref = None
    for a in alphas:
        t = time.time()
        ref, T = universe_merge(
            models,
            refine=replace(refine, data=splits.train, alpha=a),
            progress=progress,
            universe=Universe(iterations=iterations, tol=tol, keep_layernorm=False),
        )
        row(f"refined (α={a:g})" if len(alphas) > 1 else "refined", ref, time.time() - t)
        T_ref = T_ref or T
    if ff_scale:
        _ff_scale_rows(models, replace(refine, data=splits.train, alpha=alphas[0]), iterations, tol, progress, row)
    v = rows["average"]["excess"]
    for name in rows:
        rows[name]["ratio"] = rows[name]["excess"] / v if v > 0 else float("nan")
    out: dict[str, Any] = {
        "endpoints": ends,
        "rows": rows,
        "alpha": alphas,
        "refine_steps": refine.steps,
        "iterations": iterations,
    }
    if simplex_n and n >= 3:
        three = list(models[:3])
        panels = {"average": simplex_losses(three, splits.test, simplex_n, max_batches=max_batches)}
        for name, Ts in (("universe", T_wm), (f"refined (α={alphas[0]:g})", T_ref)):
            al, masks = aligned_models(three, Ts[:3])
            panels[name] = simplex_losses(al, splits.test, simplex_n, masks=masks, max_batches=max_batches)
        out["simplex"] = panels
    return out


def universe_markdown(preset: str, result: dict[str, Any], seeds: Sequence[int]) -> str:
    lines = [
        f"### {preset}: universe of {len(seeds)} models (seeds {', '.join(map(str, seeds))})",
        "",
        "Endpoint test losses: " + ", ".join(f"{e['loss']:.3f}" for e in result["endpoints"]),
        "",
        "| merge | test loss | acc | excess E | E / E(average) | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["rows"].items():
        lines.append(
            f"| {name} | {r['loss']:.4f} | {r['acc']:.4f} | {r['excess']:+.4f} | {r['ratio']:.3f} "
            f"| {r['seconds']:.0f} |"
        )
    lines.append("")
    lines.append(
        f"Refinement: Dirichlet α = {', '.join(f'{a:g}' for a in result['alpha'])}, {result['refine_steps']} steps; "
        f"universe: {result['iterations']} iterations of weight matching."
    )
    return "\n".join(lines)


def width_experiment(
    wide: nn.Module,
    narrow: dict[int, nn.Module],
    data,
    log: Callable[[str], None] = print,
    max_batches: Optional[int] = None,
    matching: Optional[Matching] = None,
) -> dict[str, Any]:
    """Interpolation barriers between one wide model and narrower ones (paper Fig. 3c).

    Each narrower model (key: its residual width) is lifted exactly into the wide model's width by
    ``[I; 0]`` ("lifted": no alignment) and by a universe merge with the wide model ("aligned": the
    rectangular orthogonal map and permutations of weight matching), then interpolated with it.
    """

    curves: dict[str, Curve] = {}
    rows: dict[str, Any] = {}
    target = shape_of(wide.config)
    for d, m in sorted(narrow.items(), reverse=True):
        t = time.time()
        lifted = pad(m, target)
        T = weight_matching(wide, lifted, matching)
        aligned = into_universe(lifted, T)
        secs = time.time() - t
        c_lift = interpolation_curve(wide, lifted, data, max_batches=max_batches)
        c_al = interpolation_curve(wide, aligned, data, max_batches=max_batches)
        curves[f"d={d}: lifted"] = c_lift
        curves[f"d={d}: aligned"] = c_al
        rows[str(d)] = {
            "ratio": d / wide.config.d_model,
            "lifted": barrier(c_lift),
            "aligned": barrier(c_al),
            "narrow_loss": c_lift.loss[0],
            "align_seconds": secs,
        }
        log(
            f"d={d} ({d / wide.config.d_model:.3g}·d): barrier lifted {rows[str(d)]['lifted']:.4f} → aligned "
            f"{rows[str(d)]['aligned']:.4f} ({secs:.0f} s)"
        )
    return {
        "wide_loss": next(iter(curves.values())).loss[-1],
        "rows": rows,
        "curves": {k: c.to_dict() for k, c in curves.items()},
    }


def width_markdown(preset: str, result: dict[str, Any], d: int) -> str:
    lines = [
        f"### {preset}: one model of width {d} vs narrower ones (interpolation barrier, test split)",
        "",
        f"Wide model test loss {result['wide_loss']:.4f} ({result.get('steps', {}).get('wide', '?')} steps).",
        "",
        "| narrow width | ratio | training steps | narrow loss | barrier, lifted by [I;0] | barrier, aligned "
        "| align s |",
        "|---|---|---|---|---|---|---|",
    ]
    for dn, r in result["rows"].items():
        lines.append(
            f"| {dn} | {r['ratio']:.3g} | {result.get('steps', {}).get(dn, '?')} | {r['narrow_loss']:.4f} | "
            f"{r['lifted']:.4f} | {r['aligned']:.4f} | {r['align_seconds']:.0f} |"
        )
    return "\n".join(lines)


def write(out_dir: Path, stem: str, payload: dict) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [provenance.write(out_dir / f"{stem}.json", payload)]


def plot_width_curves(result: dict[str, Any], path: Path, title: str) -> Path:
    return plot_curves({k: Curve(**c) for k, c in result["curves"].items()}, path, title)
