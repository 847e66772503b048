"""Learned matching: the paper's pairwise method. It is the shared optimiser (``optimise``) with two
models, A fixed, and merge weights (u, 1 − u), u ~ U(0.4, 0.6): the latents of B's residual map and of
every layer's head and FF permutations train so that the midpoint region of A and aligned B has low
loss on training batches."""

from __future__ import annotations

import random
from typing import Optional, Sequence

import torch
import torch.nn as nn

from fedlmc.matching.optimise import Options, learn_alignments
from fedlmc.matching.problem import canonical_state
from fedlmc.matching.weight import weight_matching
from fedlmc.options import Learning, Matching
from fedlmc.symmetry import Transform, canonical_config, canonicalize, rebuild
from fedlmc.train import pick_device


def learned_matching(
    model_a: nn.Module,
    model_b: nn.Module,
    data,
    warm_start: Optional[Transform] = None,
    learning: Optional[Learning] = None,
    *,
    perms_only: bool = False,
    form: str = "factored",
    keep_layernorm: bool = False,
    gauge: Optional[str] = "orthogonal",
    snapshots: Sequence[int] = (),
    progress: bool = True,
    device: Optional[str] = None,
) -> Transform:
    """Learn T (residual O, head and FF permutations) minimising the merged model's loss on ``data``.

    Parameters
    ----------
    model_a, model_b : nn.Module
        Two fedlmc models of one shape; ``model_a`` stays fixed.
    data : data set
        Training batches (fedlmc's ``batches(batch_size, shuffle, generator)``).
    warm_start : Transform or None
        Where the latents start; default ``weight_matching(model_a, model_b)``.
    learning : Learning or None
        The optimiser's knobs (steps, learning rates, schedule, relaxation...); default ``Learning()``.
    perms_only : bool, default False
        Keep O at its start and learn only the permutations.
    form : {"factored", "circuit"}, default "factored"
    keep_layernorm : bool, default False
        Restrict O to O·1 = 1, so the merge can go back to a LayerNorm model.
    gauge : {"orthogonal", "invertible", None}, default "orthogonal"
    snapshots : sequence of int
        Step counts after which the transform is also kept, in ``info['snapshots']``.
    progress : bool, default True
    device : str or None
        Where to learn: CUDA when present, else CPU.

    Returns
    -------
    Transform
        An exact group element; ``info['loss']`` holds the loss trace; with ``learning.relax ==
        "sinkhorn"``, ``info['relaxed_state']`` is B's canonical state under the final soft maps
        (``relaxed_model``).
    """
    learning = learning if learning is not None else Learning()
    dev = pick_device(device)
    if warm_start is None:
        warm_start = weight_matching(model_a, model_b, Matching(gauge=gauge), keep_layernorm=keep_layernorm, device=dev)
    states = [canonical_state(m, dev, torch.float32) for m in (model_a, model_b)]
    cfg = canonical_config(model_b.config)
    rng = random.Random(learning.seed)

    def midpoint_region() -> list[float]:
        lam = rng.uniform(0.4, 0.6)
        return [lam, 1.0 - lam]

    opts = Options(
        learning,
        form=form,
        keep_layernorm=keep_layernorm,
        gauge=gauge,
        learn_residual=not perms_only,
        progress=progress,
        snapshots=tuple(snapshots),
        keep_relaxed=True,  # one model's state: B under the final soft maps (relax="sinkhorn" only)
    )
    got = learn_alignments(
        states,
        cfg,
        [Transform(), warm_start],
        data,
        fixed=0,
        sample_weights=midpoint_region,
        opts=opts,
        label="learned matching",
    )
    return Transform(got.elements[1], _learned_info(got, learning, perms_only, warm_start))


def _learned_info(got, learning: Learning, perms_only: bool, warm_start: Transform) -> dict:
    """A learned transform's record: the run's knobs, its loss trace, seconds, start and snapshots."""
    info = {
        "method": "learned",
        "perms_only": perms_only,
        "steps": learning.steps,
        "lr": learning.lr,
        "schedule": learning.schedule,
        "relax": learning.relax,
        "loss": got.trace,
        "seconds": got.seconds,
        "init": warm_start.info,
        "snapshots": {n: Transform(els[1]) for n, els in got.snapshots.items()},
    }
    if got.relaxed:  # relax="sinkhorn": B aligned by the final soft maps (canonical)
        info["relaxed_state"] = got.relaxed[1]
    return info


def relaxed_model(model_b: nn.Module, transform: Transform) -> nn.Module:
    """B under the soft (doubly stochastic) maps that learned matching ended with (``Learning(relax=
    "sinkhorn")``): the relaxed merge's operand, ``λ·A + (1 − λ)·relaxed_model(B, T)``. A soft map is no
    symmetry, so this model does not compute B's function; the hard ``transform`` does."""
    state = transform.info.get("relaxed_state")
    if state is None:
        raise ValueError("the transform has no relaxed state: learn it with Learning(relax='sinkhorn')")
    cb = canonicalize(model_b)
    return rebuild(cb, state, cb.config)
