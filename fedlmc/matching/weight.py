"""Weight matching (data-free): the paper's coordinate descent over the residual map, head
permutations, intra-head gauges and FF permutations, plus a do-no-harm guard for shared inits.

Each step minimises the same weighted Frobenius distance between A and the transformed B given the
others: the residual map by Procrustes (SVD of the cross-covariance of all residual-indexed blocks,
each scaled by 1/√rows), heads by assignment on gauge-invariant circuit distances, gauges by per-head
Procrustes, FF neurons by assignment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn

from fedlmc.matching.problem import Cross, Fixed, Problem, canonical_state, changed, full_precision_products
from fedlmc.matching.profile import section
from fedlmc.matching.scales import balancing_scales, ff_scales, weighted_distance
from fedlmc.matching.solvers import Elements
from fedlmc.matching.steps import (
    apply_elements,
    gauge_step,
    residual_element,
)
from fedlmc.merging.averaging import interpolate
from fedlmc.options import Matching
from fedlmc.scale.cpu import fitting_threads
from fedlmc.symmetry import StateDict, Transform, apply_transform, canonical_config, spec_for
from fedlmc.train import evaluate, pick_device


@dataclass
class Descent:
    """What a coordinate descent found: the elements, iterations, the objective after each iteration
    that changed something, and the returned elements' objective (None: unknown)."""

    elements: Elements
    iterations: int
    trace: list[float]
    objective: Optional[float]
    gave_up: bool = False  # stopped above ``give_up``: the caller keeps the identity


def coordinate_descent(
    P: Problem,
    elements: Elements,
    *,
    residual: str = "orthogonal",
    keep_layernorm: bool = False,
    gauge: Optional[str] = "orthogonal",
    iterations: int = 15,
    M_extra: Optional[torch.Tensor] = None,
    extra_weight: float = 0.0,
    tol: float = 2e-3,
    candidates: Optional[int] = None,
    give_up: Optional[float] = None,
) -> "Descent":
    """Alternate the four steps from ``elements`` until nothing changes, the objective improves by less
    than ``tol`` (relative) plus 1e-5 per tensor in an iteration, or ``iterations`` iterations are done.
    When the last unit steps moved no permutation, an iteration first scores its residual step alone
    (free: ``Cross.value``); if that gains less than the tolerance, only the gauges are refitted to the
    new O and the descent stops (``_finish``): the permutations have settled, so the FF and head steps,
    most of an iteration's cost, would not move.

    Every iteration begins with the residual step, the first one too (the paper start's anchor-only O
    is never used for the unit steps: docs/results.md says why).
    Two passes over the moving tensors per iteration: the residual map applied to B (which the unit
    steps read), and the cross-covariance of A with U(B) (``Problem.cross``), which gives both the
    objective for every O and the next residual step's matrix (units commute with the residual map).
    ``M_extra`` (e.g. residual activations) is mixed into every residual step with ``extra_weight``.
    ``candidates``: see ``steps.ff_step``. ``give_up``: an objective that the caller will not take the
    descent's result above (``Matching.min_gain`` keeps the identity there) put at half the required
    gain: once an iteration leaves the permutations as they were and ends above it, the descent stops
    (only continuous steps are left, and their first iteration gained less than half of what the
    identity asks).
    """
    spec = P.spec
    still = 1e-6 if P.M_anchor.dtype == torch.float64 else 1e-4  # float32 Procrustes jitters at ~1e-6
    trace: list[float] = []
    # improvements below this are noise however small the objective (a planted pair ends at its noise
    # level, ~1e-4 per tensor, where a relative test would keep iterating on nothing)
    floor = 1e-5 * (len(P.A_mov) + len(P.anchor_members))
    with section("residual cross-covariances"):
        X_ff, X = _crosses(P, elements)
    it, settled = 0, False
    for it in range(1, iterations + 1):
        old = dict(elements)
        # residual map given the units (anchors do not move with them)
        M = X.M + P.M_anchor
        if M_extra is not None and extra_weight > 0:
            M = M / M.norm() + extra_weight * M_extra / M_extra.norm()
        with section("residual SVD"):
            O = elements["residual"] = residual_element(M, residual, keep_layernorm)
        if trace and settled and trace[-1] - X.value(O) - P.anchor_objective(O) < tol * trace[-1] + floor:
            return _finish(P, elements, old, X_ff, trace, it, gauge)
        with section("apply residual map"):  # exact where the descent may give up (its value from the distances)
            B_res = P.rotated(O, ff=False, exact=give_up is not None)
        # units given the residual map
        elements.update(P.heads_units(O, B_res, old))
        elements.update(P.ff_units(O, old, candidates))
        if gauge:
            with section("gauges"):
                B_heads = apply_elements(B_res, P.cfg, elements, ("heads", "qheads"))
                elements.update(gauge_step(P.A_mov, B_heads, spec, gauge, P.A_sides))
        if trace and not changed(old, elements, still):  # a fixed point: keep the elements whose objective is known
            return Descent(old, it, trace, trace[-1])
        # (a solved permutation comes from the CPU's assignment solver, the identity from the device)
        settled = all(
            torch.equal(old[k], v.to(old[k].device))
            for k, v in elements.items()
            if not v.is_floating_point() and k in old
        )
        limit = give_up if settled else None
        if limit is not None and (not trace or trace[-1] > limit):  # it may give up here: its value first,
            # without the cross-covariances (a descent already below the limit goes on, or stops on its gain)
            value = _settled_value(P, elements, O, B_res)
            end = None if value is None else _ending(trace, value, old, elements, it, tol, floor, limit)
            if end is not None:
                return end
        with section("residual cross-covariances"):
            X_ff, X = _crosses(P, elements)
        value = X.value(O) + P.anchor_objective(O)
        end = _ending(trace, value, old, elements, it, tol, floor, limit)
        if end is not None:
            return end
        trace.append(value)
    return Descent(elements, it, trace, trace[-1] if trace else None)


def _ending(
    trace: list[float],
    value: float,
    old: Elements,
    elements: Elements,
    it: int,
    tol: float,
    floor: float,
    give_up: Optional[float],
) -> Optional["Descent"]:
    """How a descent ends at an iteration of this ``value``, or None if it goes on: on too small a gain
    (with the previous elements if the last step made things worse), or giving up above ``give_up``."""
    if trace and trace[-1] - value < tol * abs(value) + floor:
        if value > trace[-1]:  # the last step made things worse: keep the previous elements
            return Descent(old, it, trace + [value], trace[-1])
        return Descent(elements, it, trace + [value], value)
    if give_up is not None and value > give_up:
        return Descent(elements, it, trace + [value], value, gave_up=True)
    return None


def _settled_value(P: Problem, elements: Elements, O: torch.Tensor, B_res: StateDict) -> Optional[float]:
    """The objective of ``elements`` whose permutations are those of the last crosses (so the FF part's
    ``Cross`` is at hand), the rest's part from the distances themselves (``Problem.rest_value`` of
    ``B_res = rotated(O, ff=False, exact=True)``): the value a descent that may stop needs, without the
    rest's cross-covariances (a product per tensor) that only a further iteration would read. None where
    ``rest_value`` gives none."""
    with section("objective"):
        rest = P.rest_value(elements, B_res, exact=True)
        return None if rest is None else P.cross(elements, "ff").value(O) + rest + P.anchor_objective(O)


def _crosses(P: Problem, elements: Elements) -> tuple[Cross, Cross]:
    """The FF members' ``Cross`` and the whole one (the FF part is what a gauges-only step keeps)."""
    X_ff = P.cross(elements, "ff")
    return X_ff, X_ff + P.cross(elements, "rest")


def _finish(
    P: Problem, elements: Elements, old: Elements, X_ff: Cross, trace: list[float], it: int, gauge: Optional[str]
) -> Descent:
    """The last, continuous step of a descent whose permutations have settled: gauges refitted to the
    new residual map (the permutations would not move, so the FF part of the objective is ``X_ff``'s),
    and the objective of the result (the rest's part from the distances themselves: the residual map
    is final, so no cross-covariance is needed)."""
    O, rest = elements["residual"], None
    if gauge:
        with section("gauges"):
            B_rest = P.rotated(O, ff=False, exact=True)
            B_heads = apply_elements(B_rest, P.cfg, elements, ("heads", "qheads"))
            elements.update(gauge_step(P.A_mov, B_heads, P.spec, gauge, P.A_sides))
        with section("objective"):
            rest = P.rest_value(elements, B_rest, exact=True)
        del B_rest, B_heads
    if rest is None:
        with section("residual cross-covariances"):
            rest = P.cross(elements, "rest").value(O)
    value = X_ff.value(O) + rest + P.anchor_objective(O)
    if value > trace[-1]:
        return Descent(old, it, trace + [value], trace[-1])
    return Descent(elements, it, trace + [value], value)


def identity_elements(cfg, device, dtype) -> Elements:
    spec = spec_for(cfg)
    out: Elements = {}
    for name, g in spec.groups.items():
        if g.kind == "orthogonal":
            out[name] = torch.eye(g.size, device=device, dtype=dtype)
        elif g.kind == "permutation":
            out[name] = torch.arange(g.size, device=device)
        elif g.kind == "gauge":
            out[name] = torch.eye(g.size, device=device, dtype=dtype).expand(g.count, -1, -1).clone()
    return out  # no scales: the descent leaves them to ``ff_scale_step``


def weight_matching(
    model_a: nn.Module,
    model_b: nn.Module,
    matching: Optional[Matching] = None,
    *,
    warm_start: Optional[Transform] = None,
    keep_layernorm: bool = False,
    form: str = "factored",
    guard_data=None,
    guard_batches: int = 4,
    residual_acts: Optional[torch.Tensor] = None,
    device: Union[str, torch.device, None] = None,
    reuse: Optional[dict] = None,
) -> Transform:
    """Align ``model_b`` to ``model_a`` without data; returns T so that ``apply_transform(B, T)`` ≈ A.

    Parameters
    ----------
    model_a, model_b : nn.Module
        Two fedlmc models of one shape (lift the narrower one first).
    matching : Matching or None
        The matching's knobs (residual group, gauges, iterations, tolerance, do-no-harm candidate...);
        default ``Matching()``.
    warm_start : Transform or None
        A transform to descend from instead of the identity units (e.g. the previous universe
        iteration's); the identity is still scored when ``matching.keep_identity``.
    keep_layernorm : bool, default False
        Restrict O to O·1 = 1 so the merge can go back to a LayerNorm model.
    form : {"factored", "circuit"}, default "factored"
        The merge ``guard_data`` scores.
    guard_data : data set or None
        When given, the candidates (descent, identity) are finally compared by the loss of their
        λ = 0.5 merge on ``guard_batches`` of its batches.
    guard_batches : int, default 4
    residual_acts : torch.Tensor or None
        A precomputed activation cross-covariance (``activation.residual_activation_cross``) added to
        every residual step.
    device : str, torch.device or None
        Where to match: CUDA when present, else CPU.
    reuse : dict or None
        Shared by calls that align models to the same ``model_a`` (a universe iteration): what matching
        computes from A alone (``Fixed``) is built once and kept there.

    Returns
    -------
    Transform
        ``info`` records each candidate's objective, which one won, the iterations, the objective after
        each iteration, the seconds and the torch threads it ran with: no more than the host's idle
        cores (``fedlmc.scale.cpu.fitting_threads``).
    """
    # full float32 products even where the caller allows TF32 (``set_float32_matmul_precision("high")``,
    # common in GPU training code): the objective is a difference of nearly equal sums, so TF32's
    # 10-bit products would swamp the gains that ``min_gain`` and the descent's tolerance compare
    with fitting_threads() as threads, full_precision_products():
        m = matching if matching is not None else Matching()
        t0 = time.time()
        _check_same_shape(model_a, model_b)
        dev = pick_device(device) if device is None or isinstance(device, str) else device
        dtype = _problem_dtype(m, model_a)
        cfg = canonical_config(model_b.config)
        F = fixed_side(model_a, cfg, dev, dtype, m.precision, reuse)
        B = canonical_state(model_b, dev, dtype)
        scaled = m.ff_scale and any(g.kind == "scale" for g in spec_for(cfg).groups.values())
        if scaled:  # both models' FF neurons in one scale gauge first
            F, B, s_a, s_b, warm_start = _balanced_pair(F, B, cfg, m.precision, warm_start)
        with section("anchor cross-covariances"):
            P = Problem(F.A, B, cfg, m.precision, F)
        opts = _descent_options(m, keep_layernorm, residual_acts, dev, dtype)
        if m.min_gain > 0 and m.keep_identity and guard_data is None:  # the identity unless the gain is enough
            with section("objective"):
                opts["give_up"] = (1.0 - m.min_gain / 2) * P.objective({})
        found, info = _descents(P, warm_start, m.keep_identity, opts)
        if scaled:
            _scaled_candidates(found, info, F, B, cfg, {**opts, "give_up": None}, s_a, s_b)
        best = _chosen(found, info, m, model_a, model_b, (guard_data, form, guard_batches))
        info.update(chosen=best, seconds=time.time() - t0, residual=m.residual, keep_layernorm=keep_layernorm)
        info.update(
            ff_steps=dict(P.ff_counts),  # layers whose FF step the certificate settled, and solved ones
            heads_steps=dict(P.heads_counts),
            difference_products=sorted(P.delta_parts),  # parts whose cross-covariances were AᵀA + Aᵀ(B − A)
            ff_scores=F.ff_scores,  # what the FF similarity scores were: "int8", "bfloat16", "float32"...
        )
        T = Transform({k: v.cpu() for k, v in found[best].items()}, info)
    T.info["threads"] = threads
    return T


def _descent_options(m: Matching, keep_layernorm: bool, residual_acts, dev, dtype) -> dict:
    """``coordinate_descent``'s options from the matching's knobs (an activation cross-covariance, when
    given, joins every residual step)."""
    Mx = residual_acts.to(dev, dtype) if residual_acts is not None else None
    return dict(
        residual=m.residual,
        keep_layernorm=keep_layernorm,
        gauge=m.gauge,
        iterations=m.descent_iterations,
        M_extra=Mx,
        extra_weight=1.0 if Mx is not None else 0.0,
        candidates=m.ff_candidates,
        tol=m.descent_tol,
    )


def _check_same_shape(model_a: nn.Module, model_b: nn.Module) -> None:
    canon = dict(
        norm="rmsnorm", norm_bias=False, norm_gain=False, norm_eps=model_a.config.norm_eps
    )  # a lift rescales eps only
    if model_a.config.replace(**canon) != model_b.config.replace(**canon):
        raise ValueError("weight_matching needs two models of the same shape (lift the narrower one first)")


def _problem_dtype(m: Matching, model_a: nn.Module) -> torch.dtype:
    """``m.dtype``, else float64 for small models and float32 for large ones (gpt2-small)."""
    if m.dtype is not None:
        return m.dtype
    return torch.float64 if sum(p.numel() for p in model_a.parameters()) < 20_000_000 else torch.float32


def _balanced_pair(F: Fixed, B: StateDict, cfg, precision: str, warm_start: Optional[Transform]):
    """A's fixed side and B with their FF neurons in one scale gauge (``balancing_scales``), both
    gauges' scales, and the warm start without its scales (they belong to the unbalanced B)."""
    spec = spec_for(cfg)
    s_a, s_b = balancing_scales(F.A, spec), balancing_scales(B, spec)
    if warm_start is not None:
        warm_start = Transform({k: v for k, v in warm_start.elements.items() if spec.groups[k].kind != "scale"})
    return Fixed(apply_elements(F.A, cfg, s_a), cfg, precision), apply_elements(B, cfg, s_b), s_a, s_b, warm_start


def _scaled_candidates(found: dict, info: dict, F: Fixed, B: StateDict, cfg, opts: dict, s_a: dict, s_b: dict):
    """Each descent's candidate (in place) with its FF scales solved (``_with_scales``) and composed with
    both balancing gauges into B → A; ``info["ff_scale"]`` records each one's figures."""
    spec = spec_for(cfg)
    for k in [k for k in found if k != "identity"]:
        with section("ff scales"):
            el, record = _with_scales(F, B, cfg, found[k], opts)
        scales = _composed_scales(el, s_a, s_b, spec)
        found[k] = {**el, **scales}
        record.update(
            mean_abs_log_scale=[float(c.abs().log().abs().mean()) for c in scales.values()],  # per layer
            flipped=[float((c < 0).double().mean()) for c in scales.values()],  # the share of sign flips
        )
        info.setdefault("ff_scale", {})[k] = record


def _composed_scales(elements: Elements, s_a: dict, s_b: dict, spec) -> dict[str, torch.Tensor]:
    """B's scale elements from B's own gauge to A's: B's balancing scale (its own order, so after the
    permutation), the solved scale, then A's balancing scale undone."""
    moved = _after_permutations(s_b, elements, spec)
    return {name: moved[name] * elements.get(name, torch.ones_like(c_a)) / c_a for name, c_a in s_a.items()}


def _after_permutations(pre: dict, elements: Elements, spec) -> dict[str, torch.Tensor]:
    """Scales given in B's own unit order as elements, which act after their FF permutation."""
    out = {}
    for name, c in pre.items():
        perm = elements.get(spec.groups[name].heads)
        out[name] = c[perm] if perm is not None else c
    return out


SCALE_ROUNDS = 3  # at most this many (scales, descent) alternations after the first descent


def _with_scales(F: Fixed, B: StateDict, cfg, elements: Elements, opts: dict) -> tuple[Elements, dict]:
    """``elements`` with every FF scale group solved in closed form, then up to ``SCALE_ROUNDS`` more
    descents on B rescaled by the scales so far (warm from the last elements), each followed by the
    scales again, while they lower weight matching's distance to A."""
    spec = spec_for(cfg)
    w = {k: 1.0 / float(v) for k, v in F.a_norms.items()}
    ref = next(iter(B.values()))
    current = {k: v for k, v in elements.items() if spec.groups[k].kind != "scale"}
    pre: dict[str, torch.Tensor] = {}  # the scales so far, in B's own unit order
    before = weighted_distance(F.A, apply_elements(B, cfg, current), w)
    best, after, rounds = current, before, 0
    for rounds in range(1, SCALE_ROUNDS + 2):
        B_scaled = apply_elements(B, cfg, pre) if pre else B
        if rounds > 1:  # the descent again, on B rescaled, from where it was
            start = {**identity_elements(cfg, ref.device, ref.dtype), **current}
            current = coordinate_descent(Problem(F.A, B_scaled, cfg, F.precision, F), start, **opts).elements
        found = ff_scales(F.A, apply_elements(B_scaled, cfg, current), spec, w)
        for name, c in found.items():  # compose, in B's own unit order
            perm = current.get(spec.groups[name].heads)
            pre[name] = pre.get(name, torch.ones_like(c)) * (c[torch.argsort(perm)] if perm is not None else c)
        candidate = {**current, **_after_permutations(pre, current, spec)}
        dist = weighted_distance(F.A, apply_elements(B, cfg, candidate), w)
        if dist >= after * (1 - 1e-6):
            break
        best, after = candidate, dist
    # weight matching's distance to A (both in their balanced gauge) before the solved scales and after
    return best, {"distance_before": before, "distance_after": after, "rounds": rounds}


def _chosen(found: dict, info: dict, m: Matching, model_a: nn.Module, model_b: nn.Module, guard: tuple) -> str:
    """Which candidate ``weight_matching`` returns: the lowest objective, the identity unless the descent
    gained more than ``m.min_gain`` (``info["gain"]``), or with guard data (``guard``: data, form,
    batches) the lowest λ = 0.5 loss (``info["midpoint_loss"]``)."""
    guard_data, form, guard_batches = guard
    obj = info["objective"]
    best = min(obj, key=obj.get)
    if m.min_gain > 0 and "identity" in obj and best != "identity" and guard_data is None:
        gain = 1.0 - obj[best] / max(obj["identity"], 1e-30)
        info["gain"] = gain
        if gain <= m.min_gain:  # the descent only fitted noise: nothing worth applying
            best = "identity"
    if guard_data is not None and len(found) > 1:
        losses = {
            k: midpoint_loss(model_a, model_b, Transform(el), guard_data, form, guard_batches)
            for k, el in found.items()
        }
        info["midpoint_loss"] = losses
        best = min(losses, key=losses.get)
    return best


def fixed_side(
    model_a: nn.Module, cfg, dev: torch.device, dtype: torch.dtype, precision: str, reuse: Optional[dict] = None
) -> Fixed:
    """``Fixed`` for ``model_a`` (its canonical state on ``dev`` in ``dtype``), taken from ``reuse`` when
    it holds one for this very model, device, dtype and precision (else built, and kept there)."""
    key = (str(dev), dtype, precision)
    model, F = reuse.get(key, (None, None)) if reuse is not None else (None, None)
    if model is not model_a:
        A = canonical_state(model_a, dev, dtype)
        with section("anchor cross-covariances"):
            F = Fixed(A, cfg, precision, shared=reuse is not None)
        if reuse is not None:
            reuse[key] = (model_a, F)
    return F


def _descents(
    P: Problem, warm_start: Optional[Transform], keep_identity: bool, opts: dict
) -> tuple[dict[str, Elements], dict]:
    """Run the descent; returns the candidates and ``info`` (iterations, objective traces, each
    candidate's objective).

    The descent starts from the identity units ("paper": its first step recomputes the residual map
    from them, so the paper's anchor-only O is never read) or from ``warm_start`` ("warm");
    ``keep_identity`` adds the identity transform as the do-no-harm candidate."""
    dev, dtype = P.M_anchor.device, P.M_anchor.dtype
    found: dict[str, Elements] = {}
    info: dict = {"iterations": {}, "trace": {}, "objective": {}}
    el = identity_elements(P.cfg, dev, dtype)
    if warm_start is not None:
        el.update(warm_start.to(dtype=dtype, device=dev).elements)
        P.trusted.update(
            g.name for kind in ("ff", "heads") for g in P.spec.layer_groups(kind) if g.name in warm_start.elements
        )
    name = "warm" if warm_start is not None else "paper"
    d = coordinate_descent(P, el, **opts)
    info["iterations"][name], info["trace"][name] = d.iterations, d.trace
    if d.gave_up:
        info["gave_up"] = name
    found[name], info["objective"][name] = d.elements, d.objective
    if keep_identity:
        with section("objective"):
            found["identity"], info["objective"]["identity"] = {}, P.objective({})
    return found, info


def midpoint_loss(
    model_a: nn.Module, model_b: nn.Module, T: Transform, data, form: str = "factored", max_batches: int = 4
) -> float:
    """Loss of the λ = 0.5 merge of A and T(B) on the first ``max_batches`` batches of ``data``."""

    b = apply_transform(model_b, T.to(dtype=next(model_b.parameters()).dtype)) if T.elements else model_b
    return evaluate(interpolate(model_a, b, 0.5, form=form), data, max_batches=max_batches)["loss"]
