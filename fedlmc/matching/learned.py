"""Learned matching: train latent matrices for the residual map and every layer's head and FF
permutations so that the interpolated model has low loss (the paper's learned matching).

O = U Vᵀ from the SVD of its latent (differentiable); permutations are the Hungarian projection of
their latents with a straight-through estimator; the loss is that of the merge at λ ~ U(0.4, 0.6) on
training batches; only the latents train. Intra-head gauges (factored merge) are re-aligned by
Procrustes from the current hard alignment at every step (constants for the gradient).
"""
from __future__ import annotations

import random
import time
from typing import Optional

import torch
import torch.nn as nn
from torch.func import functional_call

from ..averaging import circuit_state, weighted_state
from ..models import from_config
from ..symmetry import Transform, apply_to_state, ones_basis, perm_matrix, spec_for
from ..train import _progress, loss_and_correct, pick_device
from .common import apply_elements, assignment, exact_elements, gauge_step
from .weight import canonical_state, weight_matching


class _Polar(torch.autograd.Function):
    """The orthogonal polar factor ``U Vᵀ`` of a square matrix with a stable gradient.

    Differentiating U and V separately (as SVD's backward does) divides by ``s_i² − s_j²``, which is
    infinite at an orthogonal start; the polar factor itself only needs ``1/(s_i + s_j)``:
    ``∂L/∂X = U [(Ĝ − Ĝᵀ) / (s_i + s_j)] Vᵀ`` with ``Ĝ = Uᵀ (∂L/∂O) V``.
    """

    @staticmethod
    def forward(ctx, X: torch.Tensor) -> torch.Tensor:
        U, S, Vh = torch.linalg.svd(X)
        ctx.save_for_backward(U, S, Vh)
        return U @ Vh

    @staticmethod
    def backward(ctx, G: torch.Tensor) -> torch.Tensor:
        U, S, Vh = ctx.saved_tensors
        Gh = U.T @ G @ Vh.T
        return U @ ((Gh - Gh.T) / (S[:, None] + S[None, :]).clamp_min(1e-12)) @ Vh


def _orth(latent: torch.Tensor) -> torch.Tensor:
    return _Polar.apply(latent)


def endless_batches(data, batch_size: int, gen: torch.Generator):
    """Shuffled batches of ``data``, epoch after epoch (the latents train for a number of steps)."""
    while True:
        yield from data.batches(batch_size, shuffle=True, generator=gen)


def descend(opt: torch.optim.Optimizer, loss: torch.Tensor, trace: list[float]) -> float:
    """One optimiser step on ``loss``; appends its value to ``trace`` and returns it."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    trace.append(float(loss.detach()))
    return trace[-1]


def learned_matching(
    model_a: nn.Module,
    model_b: nn.Module,
    data,
    init: Optional[Transform] = None,
    steps: int = 300,
    lr: float = 1e-3,
    perm_lr: float = 0.05,
    batch_size: int = 64,
    perms_only: bool = False,
    form: str = "factored",
    keep_layernorm: bool = False,
    gauge: Optional[str] = "orthogonal",
    lam_range: tuple[float, float] = (0.4, 0.6),
    seed: int = 0,
    progress: bool = True,
    device: Optional[str] = None,
) -> Transform:
    """Learn T (residual O, head and FF permutations) minimising the merged model's loss on ``data``.

    ``init`` defaults to ``weight_matching(A, B)``; ``perms_only`` keeps O at its initial value and
    learns only the permutations. ``perm_lr`` is the permutation latents' learning
    rate: they start as 0/1 matrices, so a permutation only changes once a latent moves by about one. Returns a Transform whose ``info['loss']`` holds the loss trace.
    """
    dev = pick_device(device)
    t0 = time.time()
    if init is None:
        init = weight_matching(model_a, model_b, keep_layernorm=keep_layernorm, gauge=gauge, device=dev)
    dtype = torch.float32
    A = canonical_state(model_a, dev, dtype)
    B = canonical_state(model_b, dev, dtype)
    cfg = model_b.config.replace(norm="rmsnorm", norm_bias=False)  # the canonical form's config
    spec = spec_for(cfg)
    init = init.to(dtype=dtype, device=dev)
    d = cfg.d_model

    O0 = init["residual"] if init.get("residual") is not None else torch.eye(d, device=dev)
    if not O0.is_floating_point():
        O0 = perm_matrix(O0, dtype).to(dev)
    Q = ones_basis(d, dtype).to(dev) if keep_layernorm else None
    o_lat = ((Q.T @ O0 @ Q)[1:, 1:] if keep_layernorm else O0).clone().requires_grad_(not perms_only)
    p_lat = {}
    for g in spec.layer_groups("heads") + spec.layer_groups("ff"):
        el = init.get(g.name)
        start = torch.arange(g.size, device=dev) if el is None else el
        p_lat[g.name] = perm_matrix(start, dtype).to(dev).requires_grad_(True)
    groups = [{"params": list(p_lat.values()), "lr": perm_lr}]
    if not perms_only:
        groups.append({"params": [o_lat], "lr": lr})
    opt = torch.optim.Adam(groups, lr=lr)

    def residual_map() -> torch.Tensor:
        R = _orth(o_lat)
        if keep_layernorm:
            one = torch.ones(1, 1, dtype=dtype, device=dev)
            return Q @ torch.block_diag(one, R) @ Q.T
        return R

    def hard() -> dict[str, torch.Tensor]:
        return {k: assignment(v).to(dev) for k, v in p_lat.items()}

    def gauges(O: torch.Tensor, perms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if form != "factored" or not gauge:
            return {}
        with torch.no_grad():
            B_res = apply_elements(B, cfg, {"residual": O.detach()})
            B_heads = apply_elements(B_res, cfg, {k: v for k, v in perms.items() if k.startswith("heads.")})
            return gauge_step(A, B_heads, spec, cfg.n_head, gauge)

    merged_cfg = circuit_state([A, A], [0.5, 0.5], cfg)[1] if form == "circuit" else cfg
    template = from_config(merged_cfg).to(dev).eval()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = endless_batches(data, batch_size, gen)
    trace: list[float] = []
    running = None
    with _progress(progress) as bar:
        task = bar.add_task("learned matching", total=steps, info="")
        for step in range(steps):
            x, y = next(batches)
            x, y = x.to(dev), y.to(dev)
            O = residual_map()
            perms = hard()
            el = {"residual": O, **gauges(O, perms)}
            for k, v in p_lat.items():
                Ph = perm_matrix(perms[k], dtype).to(dev)
                el[k] = Ph + v - v.detach()  # straight-through: forward hard, gradient to the latent
            Bt = apply_to_state(B, cfg, Transform(el))[0]
            lam = rng.uniform(*lam_range)
            sd = circuit_state([A, Bt], [lam, 1 - lam], cfg)[0] if form == "circuit" else weighted_state([A, Bt], [lam, 1 - lam])
            loss, _ = loss_and_correct(functional_call(template, sd, (x,)), y)
            lv = descend(opt, loss, trace)
            running = lv if running is None else 0.9 * running + 0.1 * lv
            bar.update(task, completed=step + 1, info=f"loss {running:.4f}")
    with torch.no_grad():
        O = residual_map()
        perms = hard()
        final = {"residual": O, **perms, **gauges(O, perms)}
    info = {"method": "learned", "perms_only": perms_only, "steps": steps, "lr": lr, "loss": trace,
            "seconds": time.time() - t0, "init": init.info}
    return Transform(exact_elements(final, keep_layernorm), info)
