"""Learned matching: the paper's pairwise method. It is the shared optimiser (``optimise``) with two
models, A fixed, and merge weights (u, 1 − u), u ~ U(0.4, 0.6): the latents of B's residual map and of
every layer's head and FF permutations train so that the midpoint region of A and aligned B has low
loss on training batches."""
from __future__ import annotations

import random
import warnings
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..symmetry import Transform, canonical_config
from ..train import pick_device
from .optimise import Options, learn_alignments
from .weight import canonical_state, weight_matching


def learned_matching(model_a: nn.Module, model_b: nn.Module, data, start: Optional[Transform] = None,
                     steps: int = 300, lr: float = 1e-3, perm_lr: float = 0.05, batch_size: int = 64,
                     perms_only: bool = False, form: str = "factored", keep_layernorm: bool = False,
                     gauge: Optional[str] = "orthogonal", seed: int = 0, progress: bool = True,
                     device: Optional[str] = None, init: Optional[Transform] = None, schedule: str = "constant",
                     snapshots: Sequence[int] = (), relax: str = "ste", tau: float = 0.1) -> Transform:
    """Learn T (residual O, head and FF permutations) minimising the merged model's loss on ``data``.

    ``start`` defaults to ``weight_matching(A, B)`` (``init`` is its deprecated name); ``perms_only`` keeps O at its start and
    learns only the permutations; ``perm_lr`` is the permutation latents' learning rate (they start as
    0/1 matrices, so a permutation changes once a latent moves by about one). Returns an exact group
    element whose ``info['loss']`` holds the loss trace. ``schedule="cosine"`` decays both learning
    rates to 0 over ``steps``; ``snapshots`` (step counts) also keep the transform after those steps
    in ``info['snapshots']`` (with the constant schedule, the same as a run of that many steps).
    ``relax="sinkhorn"`` merges with soft permutations ``sinkhorn(latent / tau)`` instead of hard
    ones with a straight-through gradient (the result is still the latents' hard assignment).
    """
    dev = pick_device(device)
    if init is not None:
        warnings.warn("learned_matching(init=...) is deprecated: use start=", DeprecationWarning, stacklevel=2)
        start = init
    if start is None:
        start = weight_matching(model_a, model_b, keep_layernorm=keep_layernorm, gauge=gauge, device=dev)
    states = [canonical_state(m, dev, torch.float32) for m in (model_a, model_b)]
    cfg = canonical_config(model_b.config)
    rng = random.Random(seed)

    def midpoint_region() -> list[float]:
        lam = rng.uniform(0.4, 0.6)
        return [lam, 1.0 - lam]

    opts = Options(steps=steps, lr=lr, perm_lr=perm_lr, batch_size=batch_size, form=form,
                   keep_layernorm=keep_layernorm, gauge=gauge, learn_residual=not perms_only, seed=seed,
                   progress=progress, schedule=schedule, snapshots=tuple(snapshots), relax=relax, tau=tau)
    got = learn_alignments(states, cfg, [Transform(), start], data, fixed=0, sample_weights=midpoint_region,
                           opts=opts, label="learned matching")
    info = {"method": "learned", "perms_only": perms_only, "steps": steps, "lr": lr, "schedule": schedule, "relax": relax,
            "loss": got.trace, "seconds": got.seconds, "init": start.info,
            "snapshots": {n: Transform(els[1]) for n, els in got.snapshots.items()}}
    return Transform(got.elements[1], info)
