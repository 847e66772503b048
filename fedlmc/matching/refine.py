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

from ..symmetry import Transform, canonical_config
from ..train import pick_device
from .optimise import Options, learn_alignments
from .weight import canonical_state


def dirichlet_refine(models: Sequence[nn.Module], transforms: Sequence[Transform], data,
                     masks: Optional[Sequence[Optional[dict[str, torch.Tensor]]]] = None,
                     weights: Optional[Sequence[float]] = None, alpha: float = 1.0, steps: int = 200,
                     lr: float = 1e-3, perm_lr: float = 0.05, batch_size: int = 64, form: str = "factored",
                     keep_layernorm: bool = False, gauge: Optional[str] = "orthogonal",
                     reference: Optional[nn.Module] = None, seed: int = 0, progress: bool = True,
                     device: Optional[str] = None, loss_fn=None, relax: str = "ste", tau: float = 0.1,
                     check_every: int = 0, patience: int = 2, check_data=None,
                     check_sigmas: float = 2.0) -> list[Transform]:
    """Refine the transforms of ``models`` (same shape, e.g. padded) into their universe.

    ``transforms`` are the starting alignments (``universe_merge``'s); ``masks`` mark padded units
    (see ``widths.unit_masks``, before permutation); ``weights`` pick the fixed model (the largest);
    ``reference`` (default: the fixed model aligned) is what the intra-head gauges align to.
    ``keep_layernorm`` keeps every ``O_m·1 = 1`` (learning only the centred block). ``data``: anything
    with fedlmc's ``batches(batch_size, shuffle, generator)``; ``loss_fn(outputs, targets)``: the loss to
    descend on (default: cross-entropy, as in training). ``relax="sinkhorn"``: soft permutations in the
    merges (see ``learned_matching``). ``check_every`` > 0 stops on the objective: the merge at ``weights``
    is scored on the first batches of ``check_data`` (default ``data``; better held out) at the start and
    every ``check_every`` steps, the best alignment scored is returned and the descent stops after
    ``patience`` checks without improvement — a loss lower by more than ``check_sigmas`` standard
    errors of the paired per-example difference (``optimise.Options``).
    Returns the refined transforms (exact group elements; ``info['loss']`` holds the loss trace,
    ``info['checks']`` the scores by step and ``info['best_step']`` the step returned).
    """
    M = len(models)
    if M != len(transforms):
        raise ValueError("dirichlet_refine needs one transform per model")
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    if M < 2:
        return list(transforms)
    dev = pick_device(device)
    states = [canonical_state(m, dev, torch.float32) for m in models]
    cfg = canonical_config(models[0].config)
    fixed = int(np.argmax(weights)) if weights is not None else 0
    rng = np.random.default_rng(seed)
    opts = Options(steps=steps, lr=lr, perm_lr=perm_lr, batch_size=batch_size, form=form,
                   keep_layernorm=keep_layernorm, gauge=gauge, seed=seed, progress=progress, loss_fn=loss_fn,
                   relax=relax, tau=tau, check_every=check_every, patience=patience, check_sigmas=check_sigmas)
    ref = canonical_state(reference, dev, torch.float32) if reference is not None else None
    got = learn_alignments(
        states, cfg, transforms, data, fixed=fixed, sample_weights=lambda: [float(v) for v in rng.dirichlet([alpha] * M)],
        opts=opts, masks=masks, reference=ref, label=f"Dirichlet refinement ({M} models, α={alpha:g})",
        check_weights=[w / sum(weights) for w in weights] if weights is not None else None, check_data=check_data)
    info = {"method": "refined", "alpha": alpha, "steps": steps, "relax": relax, "loss": got.trace, "seconds": got.seconds,
            "steps_run": len(got.trace), "checks": got.checks, "best_step": got.best_step}
    return [T if el is None else Transform(el, {**info, "init": T.info}) for T, el in zip(transforms, got.elements)]
