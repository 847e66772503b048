"""Dirichlet learned refinement of a universe: learn every model's alignment so that the whole simplex
of merges has low loss, not only the midpoint.

Each step draws λ ~ Dirichlet(α·1_M) and minimises ``L(Σ_m λ_m π_m(θ_m))`` on a training batch; the
paper's objective also subtracts ``Σ λ_m L(π_m(θ_m))``, which does not depend on the alignment (every
π_m preserves its model's function), so it only enters the reported excess. Latents as in pairwise
learned matching: ``O_m`` is the polar factor of a square latent, permutations are Hungarian projections
with a straight-through gradient, intra-head gauges are re-aligned to a fixed reference by Procrustes.
One model (the largest weight) stays fixed: a symmetry applied to all models at once changes nothing.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
from torch.func import functional_call

from ..averaging import circuit_state, unit_weighted, weighted_state
from ..models import from_config
from ..symmetry import StateDict, Transform, apply_to_state, ones_basis, perm_matrix, spec_for
from ..train import _progress, loss_and_correct, pick_device
from ..widths import permute_masks
from .common import apply_elements, assignment, exact_elements, gauge_step
from .learned import _orth, descend, endless_batches
from .weight import canonical_state


def _merged_state(states: Sequence[StateDict], lam: Sequence[float], masks, cfg, form: str) -> StateDict:
    if form == "circuit":
        return circuit_state(states, lam, cfg, masks)[0]
    if masks is not None and any(m is not None for m in masks):
        return unit_weighted(states, lam, masks, cfg)
    return weighted_state(states, lam)


def dirichlet_refine(
    models: Sequence[nn.Module],
    transforms: Sequence[Transform],
    data,
    masks: Optional[Sequence[Optional[dict[str, torch.Tensor]]]] = None,
    weights: Optional[Sequence[float]] = None,
    alpha: float = 0.1,
    steps: int = 200,
    lr: float = 1e-3,
    perm_lr: float = 0.05,
    batch_size: int = 64,
    form: str = "factored",
    keep_layernorm: bool = False,
    gauge: Optional[str] = "orthogonal",
    reference: Optional[nn.Module] = None,
    seed: int = 0,
    progress: bool = True,
    device: Optional[str] = None,
) -> list[Transform]:
    """Refine the transforms of ``models`` (same shape, e.g. padded) into their universe.

    ``transforms`` are the starting alignments (``universe_merge``'s); ``masks`` mark padded units
    (see ``widths.unit_masks``, before permutation); ``weights`` pick the fixed model (the largest);
    ``reference`` (default: the fixed model aligned) is what the intra-head gauges align to.
    ``keep_layernorm`` keeps every ``O_m·1 = 1`` (learning only the centred block).
    Returns the refined transforms (``info['loss']`` holds the loss trace).
    """
    M = len(models)
    if M != len(transforms):
        raise ValueError("dirichlet_refine needs one transform per model")
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    dev = pick_device(device)
    t0 = time.time()
    dtype = torch.float32
    cfg = models[0].config.replace(norm="rmsnorm", norm_bias=False)
    spec = spec_for(cfg)
    states = [canonical_state(m, dev, dtype) for m in models]
    fixed = int(np.argmax(weights)) if weights is not None else 0
    init = [T.to(dtype=dtype, device=dev) for T in transforms]
    masks = list(masks) if masks is not None else [None] * M
    d = cfg.d_model
    Q = ones_basis(d, dtype).to(dev) if keep_layernorm else None

    def residual_map(lat: torch.Tensor) -> torch.Tensor:
        R = _orth(lat)
        if Q is None:
            return R
        return Q @ torch.block_diag(torch.ones(1, 1, dtype=dtype, device=dev), R) @ Q.T

    o_lat: list[Optional[torch.Tensor]] = []
    p_lat: list[dict[str, torch.Tensor]] = []
    params_o, params_p = [], []
    for i, T in enumerate(init):
        if i == fixed:
            o_lat.append(None)
            p_lat.append({})
            continue
        O0 = T.get("residual")
        O0 = torch.eye(d, dtype=dtype, device=dev) if O0 is None else (O0 if O0.is_floating_point() else perm_matrix(O0, dtype).to(dev))
        o = ((Q.T @ O0 @ Q)[1:, 1:] if Q is not None else O0).clone().requires_grad_(True)
        o_lat.append(o)
        params_o.append(o)
        lat = {}
        for g in spec.layer_groups("heads") + spec.layer_groups("ff"):
            el = T.get(g.name)
            start = torch.arange(g.size, device=dev) if el is None else el
            lat[g.name] = perm_matrix(start, dtype).to(dev).requires_grad_(True)
            params_p.append(lat[g.name])
        p_lat.append(lat)
    if not params_o:
        return list(transforms)
    opt = torch.optim.Adam([{"params": params_p, "lr": perm_lr}, {"params": params_o, "lr": lr}])

    fixed_state = apply_to_state(states[fixed], cfg, init[fixed])[0]
    fixed_mask = permute_masks(masks[fixed], init[fixed]) if masks[fixed] is not None else None
    ref = canonical_state(reference, dev, dtype) if reference is not None else fixed_state

    def hard(i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.no_grad():
            return residual_map(o_lat[i]), {k: assignment(v).to(dev) for k, v in p_lat[i].items()}

    def gauges(i: int, O: torch.Tensor, perms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if form != "factored" or not gauge:
            return {}
        with torch.no_grad():
            B = apply_elements(states[i], cfg, {"residual": O.detach(), **perms}, kinds=("residual", "heads"))
            return gauge_step(ref, B, spec, cfg.n_head, gauge)

    merged_cfg = circuit_state([states[0]] * M, [1.0 / M] * M, cfg)[1] if form == "circuit" else cfg
    template = from_config(merged_cfg).to(dev).eval()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = endless_batches(data, batch_size, gen)
    trace: list[float] = []
    running = None
    with _progress(progress) as bar:
        task = bar.add_task(f"Dirichlet refinement ({M} models, α={alpha:g})", total=steps, info="")
        for step in range(steps):
            x, y = next(batches)
            x, y = x.to(dev), y.to(dev)
            aligned, step_masks = [], []
            for i in range(M):
                if i == fixed:
                    aligned.append(fixed_state)
                    step_masks.append(fixed_mask)
                    continue
                O = residual_map(o_lat[i])
                perms = {k: assignment(v).to(dev) for k, v in p_lat[i].items()}
                el = {"residual": O, **gauges(i, O, perms)}
                for k, v in p_lat[i].items():
                    el[k] = perm_matrix(perms[k], dtype).to(dev) + v - v.detach()  # straight-through
                aligned.append(apply_to_state(states[i], cfg, Transform(el))[0])
                step_masks.append(permute_masks(masks[i], Transform(perms)) if masks[i] is not None else None)
            lam = [float(v) for v in rng.dirichlet([alpha] * M)]
            sd = _merged_state(aligned, lam, step_masks, cfg, form)
            loss, _ = loss_and_correct(functional_call(template, sd, (x,)), y)
            lv = descend(opt, loss, trace)
            running = lv if running is None else 0.95 * running + 0.05 * lv
            bar.update(task, completed=step + 1, info=f"loss {running:.4f}")
    out: list[Transform] = []
    for i, T in enumerate(transforms):
        if i == fixed:
            out.append(T)
            continue
        O, perms = hard(i)
        els = {"residual": O, **perms, **gauges(i, O, perms)}
        out.append(Transform(exact_elements(els, keep_layernorm),
                             {"method": "dirichlet", "alpha": alpha, "steps": steps, "loss": trace,
                              "seconds": time.time() - t0, "init": T.info}))
    return out
