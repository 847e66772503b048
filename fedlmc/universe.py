"""Universe merging: M models (mixed widths allowed) aligned by weight matching to one universe,
averaged there, optionally refined (Dirichlet), and projected back to each client's shape."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from .allocator import release_freed_memory
from .averaging import FORMS, REDUCES, merge, robust_merge
from .matching import residual_activation_cross, weight_matching
from .matching.activation import residual_states
from .matching.profile import section
from .matching.refine import dirichlet_refine
from .vocabulary import method_name
from .symmetry.canonical import recentre
from .symmetry import (StateDict, Transform, WidthMap, apply_to_state, apply_transform, canonical, invert_transform,
                       layernorm_native, rebuild, spec_for, to_layernorm)
from .widths import (common_shape, lift_residual, ones_lift, pad, permute_masks, residual_projector, same_shape, unit_masks,
                     unpad)


@dataclass
class Members:
    """The models of a universe, each padded exactly to the common shape (with masks marking its padded
    heads / FF neurons when widths differ) and canonical; ``weights`` sum to one."""

    models: Sequence[nn.Module]
    weights: list[float]
    shape: dict[str, int]
    padded: list[nn.Module]
    masks: list[Optional[dict]]
    attn_scale: Optional[float]  # the universe's attention scale (mixed widths only)
    hetero: bool  # widths differ: models are padded and masked
    # keep_layernorm with mixed widths: the reflection each narrower padded model was turned by so that its
    # stream stays centred in the universe (``widths.ones_lift``); None for the others
    lifts: Optional[list[Optional[torch.Tensor]]] = None

    @property
    def live(self) -> list[int]:
        return [i for i, w in enumerate(self.weights) if w > 0]

    def own(self, i: int, T: Transform) -> Transform:
        """Model i's transform as a map of its zero-padded self (its ones-lift composed in)."""
        U = self.lifts[i] if self.lifts is not None else None
        if U is None:
            return T
        R = T.get("residual")
        els = dict(T.elements)
        els["residual"] = U if R is None else R @ U.to(R)
        return Transform(els, dict(T.info), T.width_map)

    def aligned_masks(self, i: int, T: Transform) -> Optional[dict]:
        """Model i's real heads / FF neurons after its permutations, and the universe subspace its
        residual occupies (so every entry is averaged over the models that hold it)."""
        if self.masks[i] is None:
            return None
        out = permute_masks(self.masks[i], T)
        d_c = self.models[i].config.d_model
        if d_c < self.shape["d_model"]:
            out["residual"] = residual_projector(self.own(i, T), d_c, self.shape["d_model"])
        return out

    def merge(self, transforms: list[Transform], form: str = "factored", reduce: str = "mean",
              trim: float = 0.2) -> nn.Module:
        """The weighted average of the live models, each aligned by its transform (``reduce``: or their
        coordinate-wise median / trimmed mean, see ``averaging.robust_state``)."""
        live = self.live
        if reduce != "mean":
            return robust_merge([apply_transform(self.padded[i], transforms[i]) for i in live], reduce, trim)
        if form == "factored" and not self.hetero:
            return self._streamed_average(transforms)
        aligned = [apply_transform(self.padded[i], transforms[i]) for i in live]
        return merge(aligned, [self.weights[i] for i in live], form=form,
                     masks=[self.aligned_masks(i, transforms[i]) for i in live])

    def _streamed_average(self, transforms: list[Transform]) -> nn.Module:
        """The plain weighted average, aligning one model at a time: the server holds the M models plus
        two (the running sum and one aligned model), not 2M (at gpt2-small size, 8 × 650 MB saved).
        Aligned state dicts are summed as they come, never built into models. The heap's freed pages go
        back to the kernel first: the retaining heap's holes from the matchings (or a refinement) would
        otherwise not fit these allocations and grow the peak (``allocator.release_freed_memory``)."""
        release_freed_memory()
        acc: Optional[StateDict] = None
        for i in self.live:
            sd = {k: v.detach() for k, v in self.padded[i].state_dict().items()}
            sd = apply_to_state(sd, self.padded[i].config, transforms[i])[0]
            w = self.weights[i]
            if acc is None:
                acc = {k: v * w for k, v in sd.items()}
            else:
                for k, v in sd.items():
                    acc[k].add_(v, alpha=w)
            del sd
        return rebuild(self.padded[self.live[0]], acc)

    def client_transforms(self, transforms: list[Transform]) -> list[Transform]:
        """Each model's map from *its own* shape into the universe (a rectangular residual map for a
        narrower model; ``info`` records the shapes ``project`` needs)."""
        if not self.hetero:
            return transforms
        out = []
        for i, (m, T) in enumerate(zip(self.models, transforms)):
            if m.config.d_model != self.shape["d_model"]:
                T = lift_residual(self.own(i, T), m.config.d_model)
            out.append(Transform(T.elements, T.info, WidthMap(dict(self.shape), self.attn_scale, m.config)))
        return out


def members(models: Sequence[nn.Module], weights: Optional[Sequence[float]], start: Optional[nn.Module],
            keep_layernorm: bool) -> Members:
    """Validate and prepare the models of a universe (see ``Members``)."""
    if not models:
        raise ValueError("universe_merge needs at least one model")
    n = len(models)
    w = [1.0 / n] * n if weights is None else [float(x) for x in weights]
    if len(w) != n or any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"weights must be {n} non-negative numbers with a positive sum, got {weights}")
    configs = [m.config for m in models] + ([start.config] if start is not None else [])
    shape = common_shape(configs)
    canon = [canonical(m) for m in models]
    if same_shape(configs):
        return Members(models, [x / sum(w) for x in w], shape, canon, [None] * n, None, False)
    if any(getattr(c, "n_kv_head", None) is not None for c in configs):
        # zero-padding a rotary head changes which dimensions RoPE pairs; GQA groups need their own masks
        raise ValueError("mixed widths are not supported for Llama-style models (RoPE, grouped-query attention) yet")
    scale = next((c.attn_scale for c in configs if c.d_head == shape["d_head"]), shape["d_head"] ** -0.5)
    padded = [pad(m, shape, attn_scale=scale) for m in canon]
    lifts = None
    if keep_layernorm and len({c.d_model for c in configs}) > 1:  # keep every padded stream centred
        D = shape["d_model"]
        lifts = [ones_lift(m.config.d_model, D) if m.config.d_model < D else None for m in models]
        padded = [apply_transform(p, Transform({"residual": U.to(next(p.parameters()).dtype)})) if U is not None else p
                  for p, U in zip(padded, lifts)]
    return Members(models, [x / sum(w) for x in w], shape, padded, [unit_masks(m.config, shape) for m in models],
                   scale, True, lifts)


def universe_merge(models: Sequence[nn.Module], method: str = "aligned", iterations: int = 5,
                   weights: Optional[Sequence[float]] = None, start: Optional[nn.Module] = None,
                   form: str = "factored", keep_layernorm: bool = False, tol: float = 1e-4,
                   data=None, alpha: float = 1.0, refine_steps: int = 200, refine_lr: float = 1e-3,
                   progress: bool = False, loss_fn=None, reduce: str = "mean", trim: float = 0.2,
                   relax: str = "ste", anchor: str = "heaviest", residual_data=None, refine_check_every: int = 0,
                   refine_patience: int = 2, refine_check_data=None, refine_check_sigmas: float = 2.0,
                   **matching: Any) -> tuple[nn.Module, list[Transform]]:
    """Merge M models in a shared "universe" (many-model weight matching), optionally refined.

    Start from ``start`` (e.g. the previous global model) or the ``anchor`` model: the largest-weight one
    ("heaviest") or the one closest to all others after pairwise weight matching ("central", M(M−1)/2
    extra matchings); align every model
    to the universe with weight matching; set the universe to the (``weights``-weighted) mean of the
    aligned models; repeat until it moves by less than ``tol`` (relative) or ``iterations`` are done;
    from the second iteration on, each model's matching descends from its previous transform (the
    identity is still scored as the do-no-harm candidate). ``residual_data``: a few batches whose
    residual-stream activations (universe vs model) join the residual map's objective, as in
    ``weight_matching(residual_acts=...)``. ``method="refined"`` then learns every
    model's alignment with Dirichlet(``alpha``) refinement on ``data`` (``refine_steps`` steps, see
    ``matching.refine``; ``loss_fn(outputs, targets)`` replaces its cross-entropy; ``relax="sinkhorn"``
    refines with soft permutations; ``refine_check_every`` > 0 stops on the objective, keeping the best
    alignment checked: ``dirichlet_refine``'s ``check_every``, ``patience``, ``check_data`` and
    ``check_sigmas``).

    Models may differ in width (residual ``d_model``, ``d_ff``, ``n_head``, ``d_head``; depth and
    architecture must agree): each is padded exactly into the largest shape (``widths.pad``), its
    padded heads and FF neurons are masked out of the averages, and its transform maps *its own*
    shape into the universe (a rectangular residual map; ``T.width_map`` records the shapes), so
    ``project(universe, T)`` returns a model of the client's shape.

    ``reduce="median"`` or ``"trimmed"`` (``trim``: the fraction cut at each end) replaces every
    iteration's weighted mean by a coordinate-wise robust combination of the aligned models (unweighted,
    as Flower's FedMedian / FedTrimmedAvg): robust aggregation modulo the symmetries. Same-width models,
    factored form, no refinement.

    Returns the merged model in ``form`` (``keep_layernorm`` converts it back to LayerNorm; it only
    applies to LayerNorm models: an RMSNorm model such as Llama has no centring to keep) and each
    model's transform. ``matching`` options go to ``weight_matching``.
    """
    keep_layernorm = keep_layernorm and all(layernorm_native(m.config) for m in models)
    if "init" in matching:
        warnings.warn("universe_merge(init=...) is deprecated: use start=", DeprecationWarning, stacklevel=2)
        start = matching.pop("init")
    method = method_name(method, ("aligned", "refined"))
    if method == "refined" and data is None:
        raise ValueError("method='refined' needs data (a small training set) for the Dirichlet refinement")
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; choose one of {FORMS}")
    reduce = method_name(reduce, REDUCES, "reduce")
    if reduce != "mean" and (method == "refined" or form != "factored"):
        raise ValueError("a robust reduce combines aligned models coordinate-wise: factored form, method='aligned'")
    mem = members(models, weights, start, keep_layernorm)
    if reduce != "mean" and mem.hetero:
        raise ValueError("a robust reduce needs models of one shape (mixed widths are averaged over their holders)")
    if keep_layernorm:
        matching.setdefault("keep_layernorm", True)
    if start is not None:
        universe = pad(start, mem.shape, attn_scale=mem.attn_scale) if mem.hetero else start
    else:
        universe = mem.padded[anchor_index(mem, anchor, matching)]
    universe, transforms = _iterate(canonical(universe), mem, iterations, tol, reduce, trim, residual_data, progress,
                                    matching)
    live = mem.live
    if method == "refined" and len(live) > 1:
        refined = dirichlet_refine([mem.padded[i] for i in live], [transforms[i] for i in live], data,
                                   masks=[mem.masks[i] for i in live], weights=[mem.weights[i] for i in live],
                                   alpha=alpha, steps=refine_steps, lr=refine_lr, form=form,
                                   keep_layernorm=keep_layernorm, reference=universe, progress=progress,
                                   device=matching.get("device"), loss_fn=loss_fn, relax=relax,
                                   check_every=refine_check_every, patience=refine_patience,
                                   check_data=refine_check_data, check_sigmas=refine_check_sigmas)
        for i, T in zip(live, refined):
            transforms[i] = T
        universe = mem.merge(transforms)
    if form == "circuit":  # the last aligned models, merged as circuits
        universe = mem.merge(transforms, form="circuit")
    if keep_layernorm and reduce != "mean":  # a median of centred streams is not centred: project it back
        universe = recentre(universe)
    return (to_layernorm(universe) if keep_layernorm else universe), mem.client_transforms(transforms)


def anchor_index(mem: Members, anchor: str, matching: dict) -> int:
    """The model a universe starts from: the heaviest, or the "central" one (least summed relative
    distance to the others, each weight-matched to it)."""
    if anchor not in ("heaviest", "central"):
        raise ValueError(f"anchor must be 'heaviest' or 'central', got {anchor!r}")
    live = mem.live
    if anchor == "heaviest" or len(live) < 3:
        return max(range(len(mem.padded)), key=lambda i: mem.weights[i])
    dist = {i: 0.0 for i in live}
    for n, i in enumerate(live):
        for j in live[n + 1:]:
            T = weight_matching(mem.padded[i], mem.padded[j], **matching)
            d = _relative_change(mem.padded[i], apply_transform(mem.padded[j], T))
            dist[i] += d
            dist[j] += d
    return min(live, key=lambda i: dist[i])


def _iterate(universe: nn.Module, mem: Members, iterations: int, tol: float, reduce: str, trim: float,
             residual_data, progress: bool, matching: dict) -> tuple[nn.Module, list[Transform]]:
    """Align every model to the universe, average there, repeat (the warm start is the last transform)."""
    transforms: list[Transform] = [Transform() for _ in mem.padded]
    for it in range(max(1, iterations)):
        states = residual_states(universe, residual_data) if residual_data is not None else None
        reuse: dict = {}  # every model aligns to this universe: what matching computes from it alone is built once
        for i, m in enumerate(mem.padded):
            if mem.weights[i] <= 0 or (it == 0 and m is universe):  # the anchor itself: the identity, exactly
                continue
            acts = residual_activation_cross(universe, m, residual_data, states_a=states) if states is not None else None
            transforms[i] = weight_matching(universe, m, start=transforms[i] if it else None, residual_acts=acts,
                                            reuse=reuse, **matching)
        reuse.clear()  # before the average, the merge's peak of memory
        with section("universe averages"):
            new = mem.merge(transforms, reduce=reduce, trim=trim)
            moved = _relative_change(universe, new)
        universe = new
        if progress:
            print(f"universe iteration {it + 1}: moved {moved:.2e}")
        if moved < tol:
            break
    return universe, transforms


def _relative_change(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    num = sum(float((sa[k] - sb[k]).pow(2).sum()) for k in sa)
    den = sum(float(sa[k].pow(2).sum()) for k in sa)
    return (num / max(den, 1e-30)) ** 0.5


def project(universe: nn.Module, transform: Transform) -> nn.Module:
    """A client's own-width model from the universe: the inverse of the client's transform into it.

    ``transform`` maps the client (width d_c) into the universe (width d_u ≥ d_c); its residual element
    is ``d_u × d_c`` with orthonormal columns, so the projection is its transpose (and every other group
    is inverted too, returning the client's own unit order). A transform from a mixed-width
    ``universe_merge`` also records the client's shape: padded heads and FF neurons are dropped.
    Exact on a lifted model.
    """
    wm = transform.width_map
    if wm is not None and universe.config.d_head != wm.shape["d_head"]:
        raise ValueError("project needs the universe in the factored form (a circuit merge changed the head width)")
    out = apply_transform(universe, invert_transform(transform, spec_for(universe))) if transform.elements else universe
    return unpad(out, wm.client) if wm is not None else out
