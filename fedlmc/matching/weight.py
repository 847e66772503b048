"""Weight matching (data-free): the paper's coordinate descent over the residual map, head
permutations, intra-head gauges and FF permutations, plus a do-no-harm guard for shared inits.

Each step minimises the same weighted Frobenius distance between A and the transformed B given the
others: the residual map by Procrustes (SVD of the cross-covariance of all residual-indexed blocks,
each scaled by 1/√rows), heads by assignment on gauge-invariant circuit distances, gauges by per-head
Procrustes, FF neurons by assignment.
"""
from __future__ import annotations

import time
from typing import Optional, Union

import torch
import torch.nn as nn

from ..averaging import interpolate
from ..symmetry import StateDict, Transform, apply_transform, canonical, canonical_config, spec_for
from ..train import evaluate, pick_device
from .common import (Elements, anchors, apply_elements, as_rows, ff_step, gauge_step, heads_step, residual_cross,
                     residual_element)


def canonical_state(model: nn.Module, device: torch.device, dtype: torch.dtype) -> StateDict:
    """The canonical form's weights, detached, on ``device`` in ``dtype``."""
    c = canonical(model)
    return {k: v.detach().to(device=device, dtype=dtype) for k, v in c.state_dict().items()}


class Problem:
    """One matching problem: A, B, and what stays fixed while the elements change.

    Coordinate descent only transforms the *moving* tensors (those some non-residual group touches);
    anchors enter through their cross-covariances, computed once, and tensors no group touches through
    a constant. That keeps huge embeddings and output heads (e.g. 50k × 768) out of every iteration.
    """

    def __init__(self, A: StateDict, B: StateDict, cfg) -> None:
        self.A, self.B, self.cfg = A, B, cfg
        self.spec = spec_for(cfg)
        moved = {m.param for g in self.spec.groups.values() if g.name != "residual" for m in g.members}
        self.A_mov = {k: A[k] for k in moved}
        self.B_mov = {k: B[k] for k in moved}
        self.anchor_members = anchors(self.spec)
        self.moving_members = [m for m in self.spec.residual.members if m.param in moved]
        self.M_anchor = residual_cross(A, B, self.anchor_members)
        # per-tensor pieces of the objective for tensors outside the moving set
        self._anchor_terms = []
        for m in self.anchor_members:
            a, b = as_rows(A[m.param], m.axis), as_rows(B[m.param], m.axis)
            na = a.pow(2).sum().clamp_min(1e-30)
            self._anchor_terms.append((a.T @ b, float((a.pow(2).sum() + b.pow(2).sum()) / na), na))
        untouched = [k for k in A if k not in moved and k not in {m.param for m in self.anchor_members}]
        self._constant = float(sum((A[k] - B[k]).pow(2).sum() / A[k].pow(2).sum().clamp_min(1e-30) for k in untouched))

    def objective(self, elements: Elements) -> float:
        """``Σ_tensors ‖A − T(B)‖² / ‖A‖²`` (the criterion that compares candidate transforms)."""
        Bt = apply_elements(self.B_mov, self.cfg, elements)
        total = self._constant + float(sum((self.A_mov[k] - Bt[k]).pow(2).sum() / self.A_mov[k].pow(2).sum().clamp_min(1e-30)
                                           for k in self.A_mov))
        O = elements.get("residual")
        if O is None:
            O = torch.eye(self.cfg.d_model, dtype=self.M_anchor.dtype, device=self.M_anchor.device)
        for cross, const, na in self._anchor_terms:
            total += const - 2 * float((cross * O).sum() / na)
        return total


def _changed(old: Elements, new: Elements, tol: float = 1e-6) -> bool:
    for k, v in new.items():
        o = old.get(k)
        if o is None or o.shape != v.shape:
            return True
        if (o.double() - v.double()).abs().max() > tol:  # a moved index differs by ≥ 1
            return True
    return False


def coordinate_descent(P: Problem, elements: Elements, *, residual: str = "orthogonal",
                       keep_layernorm: bool = False, gauge: Optional[str] = "orthogonal", max_iter: int = 15,
                       M_extra: Optional[torch.Tensor] = None, extra_weight: float = 0.0,
                       rtol: float = 1e-3) -> tuple[Elements, int]:
    """Alternate the four steps from ``elements`` until nothing changes, the objective improves by less
    than ``rtol`` (relative) in an iteration, or ``max_iter`` iterations are done.

    ``M_extra`` (e.g. residual activations) is mixed into every residual step with ``extra_weight``.
    """
    cfg, spec, H = P.cfg, P.spec, P.cfg.n_head
    tol = 1e-6 if P.M_anchor.dtype == torch.float64 else 1e-4  # float32 Procrustes jitters at ~1e-6
    last = float("inf")
    it = 0
    for it in range(1, max_iter + 1):
        old = dict(elements)
        # residual map given the permutations and gauges (anchors do not move with them)
        Bp = apply_elements(P.B_mov, cfg, elements, ("heads", "qk", "ov", "ff"))
        M = residual_cross(P.A_mov, Bp, P.moving_members) + P.M_anchor
        if M_extra is not None and extra_weight > 0:
            M = M / M.norm() + extra_weight * M_extra / M_extra.norm()
        elements["residual"] = residual_element(M, residual, keep_layernorm)
        # units given the residual map
        B_res = apply_elements(P.B_mov, cfg, {"residual": elements["residual"]})
        elements.update(heads_step(P.A_mov, B_res, spec, H))
        elements.update(ff_step(P.A_mov, B_res, spec))
        if gauge:
            B_heads = apply_elements(B_res, cfg, {k: v for k, v in elements.items() if k.startswith("heads.")})
            elements.update(gauge_step(P.A_mov, B_heads, spec, H, gauge))
        if not _changed(old, elements, tol):
            break
        value = P.objective(elements)
        if last - value < rtol * abs(value):
            if value > last:  # the last step made things worse: keep the previous elements
                elements = old
            break
        last = value
    return elements, it


def identity_elements(cfg, device, dtype) -> Elements:
    spec = spec_for(cfg)
    out: Elements = {}
    for name, g in spec.groups.items():
        if g.kind == "orthogonal":
            out[name] = torch.eye(g.size, device=device, dtype=dtype)
        elif g.kind == "permutation":
            out[name] = torch.arange(g.size, device=device)
        else:
            out[name] = torch.eye(g.size, device=device, dtype=dtype).expand(g.count, -1, -1).clone()
    return out


def paper_init(P: Problem, *, residual: str, keep_layernorm: bool, M_extra: Optional[torch.Tensor] = None,
               extra_weight: float = 0.0) -> Elements:
    """The paper's start: the residual map from the anchor blocks alone (embeddings, positions, head rows)."""
    M = P.M_anchor
    if M_extra is not None and extra_weight > 0:
        M = M / M.norm() + extra_weight * M_extra / M_extra.norm()
    el = identity_elements(P.cfg, M.device, M.dtype)
    el["residual"] = residual_element(M, residual, keep_layernorm)
    return el


def weight_matching(
    model_a: nn.Module,
    model_b: nn.Module,
    residual: str = "orthogonal",
    keep_layernorm: bool = False,
    max_iter: int = 15,
    starts: str = "both",
    gauge: Optional[str] = "orthogonal",
    guard_data=None,
    guard_batches: int = 4,
    form: str = "factored",
    residual_acts: Optional[torch.Tensor] = None,
    device: Union[str, torch.device, None] = None,
    dtype: Optional[torch.dtype] = None,
    start: Optional[Transform] = None,
) -> Transform:
    """Align ``model_b`` to ``model_a`` without data; returns T so that ``apply_transform(B, T)`` ≈ A.

    ``residual``: "orthogonal" (the paper) or "permutation" (Git Re-Basin-style baseline).
    ``keep_layernorm``: restrict O to O·1 = 1 so the merge can go back to a LayerNorm model.
    ``starts``: "paper" (residual map from the anchor blocks), "identity" (all blocks from the identity
    correspondence) or "both" (run both, keep the lower objective; also compare with the identity
    transform itself, which wins unless a matched transform is better — the do-no-harm guard for models
    sharing an initialisation). With ``guard_data`` (a data set), candidates are finally compared by the
    loss of their λ = 0.5 merge in ``form`` on ``guard_batches`` batches.
    ``residual_acts``: a precomputed activation cross-covariance (see ``activation.residual_activation_cross``)
    added to every residual step (the data-light residual option).
    ``dtype``: float64 below 20M parameters, else float32 (default).
    ``gauge``: how to align the intra-head gauges (needed by the factored merge): "orthogonal"
    (Procrustes), "invertible" (least squares, recovers any invertible gauge) or None.
    ``start``: a transform to descend from *instead of* the paper/identity starts (a warm start, e.g.
    the previous universe iteration's); with ``starts="both"`` the identity is still scored.
    ``T.info`` records the objective of each candidate, which one won, iterations and seconds.
    """

    t0 = time.time()
    canon = dict(norm="rmsnorm", norm_bias=False, norm_eps=model_a.config.norm_eps)  # a lift rescales eps only
    if model_a.config.replace(**canon) != model_b.config.replace(**canon):
        raise ValueError("weight_matching needs two models of the same shape (lift the narrower one first)")
    dev = pick_device(device) if device is None or isinstance(device, str) else device
    if dtype is None:  # float64 is cheap for small models; large ones (gpt2-small) match in float32
        dtype = torch.float64 if sum(p.numel() for p in model_a.parameters()) < 20_000_000 else torch.float32
    cfg = canonical_config(model_b.config)
    P = Problem(canonical_state(model_a, dev, dtype), canonical_state(model_b, dev, dtype), cfg)
    Mx = residual_acts.to(dev, dtype) if residual_acts is not None else None
    opts = dict(residual=residual, keep_layernorm=keep_layernorm, gauge=gauge, max_iter=max_iter,
                M_extra=Mx, extra_weight=1.0 if Mx is not None else 0.0)
    candidates: dict[str, Elements] = {}
    info: dict = {"iterations": {}}
    if start is not None:
        el = identity_elements(cfg, dev, dtype)
        el.update(start.to(dtype=dtype, device=dev).elements)
        candidates["warm"], info["iterations"]["warm"] = coordinate_descent(P, el, **opts)
    if starts in ("paper", "both") and start is None:
        el = paper_init(P, residual=residual, keep_layernorm=keep_layernorm, M_extra=Mx, extra_weight=opts["extra_weight"])
        candidates["paper"], info["iterations"]["paper"] = coordinate_descent(P, el, **opts)
    if starts in ("identity", "both") and start is None:
        el = identity_elements(cfg, dev, dtype)
        candidates["identity-start"], info["iterations"]["identity-start"] = coordinate_descent(P, el, **opts)
    if not candidates:
        raise ValueError(f"starts must be 'paper', 'identity' or 'both', got {starts!r}")
    if starts == "both":
        candidates["identity"] = {}
    scores = {k: P.objective(el) for k, el in candidates.items()}
    info["objective"] = scores
    best = min(scores, key=scores.get)
    if guard_data is not None and len(candidates) > 1:
        losses = {k: midpoint_loss(model_a, model_b, Transform(el), guard_data, form, guard_batches) for k, el in candidates.items()}
        info["midpoint_loss"] = losses
        best = min(losses, key=losses.get)
    info.update(chosen=best, seconds=time.time() - t0, residual=residual, keep_layernorm=keep_layernorm)
    return Transform({k: v.cpu() for k, v in candidates[best].items()}, info)


def midpoint_loss(model_a: nn.Module, model_b: nn.Module, T: Transform, data, form: str = "factored",
                  max_batches: int = 4) -> float:
    """Loss of the λ = 0.5 merge of A and T(B) on the first ``max_batches`` batches of ``data``."""

    b = apply_transform(model_b, T.to(dtype=next(model_b.parameters()).dtype)) if T.elements else model_b
    return evaluate(interpolate(model_a, b, 0.5, form=form), data, max_batches=max_batches)["loss"]
