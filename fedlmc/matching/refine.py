"""Dirichlet learned refinement of a universe: learn every model's alignment so that the whole simplex
of merges has low loss, not only the midpoint.

It is the shared optimiser (``optimise``) with M models, the largest-weight one fixed, and merge
weights λ ~ Dirichlet(α·1_M) at every step. The paper's objective also subtracts ``Σ λ_m L(π_m(θ_m))``,
which does not depend on the alignment (every π_m preserves its model's function), so it only enters
the reported excess.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from fedlmc.matching.optimise import Options, is_remote, learn_alignments, learn_alignments_remote
from fedlmc.matching.problem import canonical_state
from fedlmc.options import Refinement
from fedlmc.symmetry import Transform, canonical_config
from fedlmc.train import pick_device


def dirichlet_refine(
    models: Sequence[nn.Module],
    transforms: Sequence[Transform],
    refine: Refinement,
    *,
    masks: Optional[Sequence[Optional[dict[str, torch.Tensor]]]] = None,
    weights: Optional[Sequence[float]] = None,
    form: str = "factored",
    keep_layernorm: bool = False,
    gauge: Optional[str] = "orthogonal",
    reference: Optional[nn.Module] = None,
    progress: bool = True,
    device: Optional[str] = None,
) -> list[Transform]:
    """Refine the transforms of ``models`` (same shape, e.g. padded) into their universe.

    Parameters
    ----------
    models : sequence of nn.Module
        The universe's members, of one shape.
    transforms : sequence of Transform
        The starting alignments (``universe_merge``'s).
    refine : Refinement
        The data, the Dirichlet concentration, the optimiser's knobs and when to stop.
    masks : sequence of dict or None
        Each model's padded units (``widths.unit_masks``, before permutation).
    weights : sequence of float or None
        The models' weights: the largest stays fixed, and the checks score the merge at these weights.
    form : {"factored", "circuit"}, default "factored"
    keep_layernorm : bool, default False
        Keep every ``O_m·1 = 1`` (learn only the centred block).
    gauge : {"orthogonal", "invertible", None}, default "orthogonal"
    reference : nn.Module or None
        What the intra-head gauges align to (default: the fixed model aligned).
    progress : bool, default True
    device : str or None

    Returns
    -------
    list of Transform
        The refined transforms (exact group elements; ``info['loss']`` holds the loss trace,
        ``info['checks']`` the scores by step and ``info['best_step']`` the step returned).
    """
    M = len(models)
    if M != len(transforms):
        raise ValueError("dirichlet_refine needs one transform per model")
    if refine.data is None:
        raise ValueError("the refinement needs data: Refinement(data=...), a data set or a remote loss (the clients')")
    if M < 2:
        return list(transforms)
    dev = pick_device(device)
    states = [canonical_state(m, dev, torch.float32) for m in models]
    cfg = canonical_config(models[0].config)
    fixed = int(np.argmax(weights)) if weights is not None else 0
    rng = np.random.default_rng(refine.seed)
    opts = Options(refine, form=form, keep_layernorm=keep_layernorm, gauge=gauge, progress=progress)
    ref = canonical_state(reference, dev, torch.float32) if reference is not None else None
    common = dict(
        fixed=fixed,
        sample_weights=lambda: [float(v) for v in rng.dirichlet([refine.alpha] * M)],
        opts=opts,
        masks=masks,
        reference=ref,
        label=f"Dirichlet refinement ({M} models, α={refine.alpha:g})",
        check_weights=[w / sum(weights) for w in weights] if weights is not None else None,
    )
    remote = refine.data if is_remote(refine.data) else None
    if remote is None:
        got = learn_alignments(states, cfg, transforms, refine.data, check_data=refine.check_data, **common)
    else:
        got = learn_alignments_remote(states, cfg, transforms, remote, samples=getattr(remote, "samples", 1), **common)
    info = {
        "method": "refined",
        "alpha": refine.alpha,
        "steps": refine.steps,
        "relax": refine.relax,
        "loss": got.trace,
        "seconds": got.seconds,
        "steps_run": len(got.trace),
        "checks": got.checks,
        "best_step": got.best_step,
        "where": "server" if remote is None else "remote",
    }
    if got.stopped:
        info["stopped"] = got.stopped
    return [T if el is None else Transform(el, {**info, "init": T.info}) for T, el in zip(transforms, got.elements)]
