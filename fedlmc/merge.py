"""Merging aligned models: interpolation in three forms (more merges — universe, refinement — build on it).

* ``form="factored"`` (default) — plain interpolation of the (aligned) weights: a model of the same
  shape, which is what a federated client must receive. Matching aligns the intra-head gauges too, so
  Q/K and V/O factors are comparable.
* ``form="circuit"`` — the paper's merge: each head's bias-augmented QK circuit ``Q̃ᵀK̃`` and OV circuit
  ``O Ṽ`` are interpolated exactly, by concatenating the two models' heads (head width doubles, the
  attention scale is kept). Invariant to the intra-head gauges.
* ``keep_layernorm=True`` — the merged canonical model is converted back to an ordinary LayerNorm model
  (exact when the residual maps fixed the all-ones direction, as ``keep_layernorm`` matching does).

Both models must share one architecture and width. LayerNorm models are canonicalised when mixed
with canonical ones or merged as circuits; two LayerNorm models in the factored form are averaged as
they are, so the identity transform gives exactly plain averaging (FedAvg).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from .canonical import canonicalize, to_layernorm
from .symmetry import StateDict, Transform, rebuild, spec_for

FORMS = ("factored", "circuit")


def _check_same_shape(models: Sequence[nn.Module]) -> None:
    first = models[0].config
    for m in models[1:]:
        if m.config.replace(norm=first.norm, norm_bias=first.norm_bias) != first:
            raise ValueError(f"models differ in shape:\n  {first}\n  {m.config}\n(lift or project them to one width first)")


def weighted_state(states: Sequence[StateDict], weights: Sequence[float]) -> StateDict:
    """``Σ w_m θ_m`` tensor by tensor."""
    return {k: sum(w * sd[k] for w, sd in zip(weights, states)) for k in states[0]}


def circuit_state(states: Sequence[StateDict], weights: Sequence[float], cfg) -> tuple[StateDict, object]:
    """Merge heads as circuits: concatenate every model's heads, weighting one factor of each circuit."""
    spec = spec_for(cfg)
    H, dh = cfg.n_head, cfg.d_head
    out = weighted_state(states, weights)
    for kind in ("qk", "ov"):
        for g in spec.layer_groups(kind):
            for m in g.members:
                # the transposed side (Q of QK, O of OV) carries the weights; the other side is shared
                scaled = m.fn in ("MT", "MinvT")
                parts = []
                for w, sd in zip(weights, states):
                    t = sd[m.param].movedim(m.axis, 0)
                    parts.append((t * w if scaled else t).reshape(H, dh, *t.shape[1:]))
                cat = torch.cat(parts, dim=1)
                out[m.param] = cat.reshape(H * dh * len(states), *cat.shape[2:]).movedim(0, m.axis)
    return out, cfg.replace(d_head=dh * len(states), attn_scale=cfg.attn_scale)


def merge(models: Sequence[nn.Module], weights: Sequence[float], form: str = "factored",
          keep_layernorm: bool = False) -> nn.Module:
    """``Σ w_m θ_m`` of same-shape (already aligned) models, in the given form."""
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; choose one of {FORMS}")
    if len(models) != len(weights) or not models:
        raise ValueError("merge needs one weight per model")
    _check_same_shape(models)
    if form == "circuit" or not all(m.config.norm == "layernorm" for m in models):
        models = [canonicalize(m) if m.config.norm == "layernorm" else m for m in models]
    # else: LayerNorm models in the factored form are averaged as they are (exactly FedAvg; the result
    # is a LayerNorm model, so keep_layernorm holds without a conversion)
    ref = models[0]
    states = [{k: v.detach().to(next(ref.parameters())) for k, v in m.state_dict().items()} for m in models]
    if form == "circuit":
        sd, cfg = circuit_state(states, weights, ref.config)
    else:
        sd, cfg = weighted_state(states, weights), ref.config
    out = rebuild(ref, sd, cfg)
    return to_layernorm(out) if keep_layernorm and out.config.norm != "layernorm" else out


def interpolate(model_a: nn.Module, model_b: nn.Module, lam: float, form: str = "factored",
                keep_layernorm: bool = False) -> nn.Module:
    """``λ·A + (1−λ)·B`` of two same-shape models (B already aligned to A), in the given ``form``."""
    return merge([model_a, model_b], [lam, 1.0 - lam], form=form, keep_layernorm=keep_layernorm)


def universe_merge(models: Sequence[nn.Module], method: str = "wm", iterations: int = 5,
                   weights: Optional[Sequence[float]] = None, init: Optional[nn.Module] = None,
                   form: str = "factored", keep_layernorm: bool = False, tol: float = 1e-4,
                   **matching: Any) -> tuple[nn.Module, list[Transform]]:
    """Merge M same-shape models in a shared "universe" (many-model weight matching).

    Start from ``init`` (e.g. the previous global model) or the first model; align every model to the
    universe with weight matching; set the universe to the (``weights``-weighted) mean of the aligned
    models; repeat until it moves by less than ``tol`` (relative) or ``iterations`` are done. Returns
    the merged model in ``form`` (``keep_layernorm`` converts it back to LayerNorm) and each model's
    transform into the universe. ``matching`` options go to ``weight_matching``.
    """
    from .matching import weight_matching
    from .symmetry import apply_transform

    if method != "wm":
        raise ValueError(f"universe_merge supports method='wm' (Dirichlet refinement is not built yet), got {method!r}")
    if not models:
        raise ValueError("universe_merge needs at least one model")
    n = len(models)
    w = [1.0 / n] * n if weights is None else [float(x) for x in weights]
    if len(w) != n or any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"weights must be {n} non-negative numbers with a positive sum, got {weights}")
    w = [x / sum(w) for x in w]
    _check_same_shape(list(models) + ([init] if init is not None else []))
    canon = [canonicalize(m) if m.config.norm == "layernorm" else m for m in models]
    universe = init if init is not None else canon[int(max(range(n), key=lambda i: w[i]))]
    universe = canonicalize(universe) if universe.config.norm == "layernorm" else universe
    if keep_layernorm:
        matching.setdefault("keep_layernorm", True)
    transforms: list[Transform] = []
    kept_w = [wi for wi in w if wi > 0]
    for _ in range(max(1, iterations)):
        transforms = [weight_matching(universe, m, **matching) if wi > 0 else Transform() for m, wi in zip(canon, w)]
        kept = [apply_transform(m, T) for m, T, wi in zip(canon, transforms, w) if wi > 0]
        new = merge(kept, kept_w)
        moved = _relative_change(universe, new)
        universe = new
        if moved < tol:
            break
    if form == "circuit":  # the last iteration's aligned models, merged as circuits
        universe = merge(kept, kept_w, form="circuit")
    return (to_layernorm(universe) if keep_layernorm else universe), transforms


def _relative_change(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    num = sum(float((sa[k] - sb[k]).pow(2).sum()) for k in sa)
    den = sum(float(sa[k].pow(2).sum()) for k in sa)
    return (num / max(den, 1e-30)) ** 0.5


def project(universe: nn.Module, transform: Transform) -> nn.Module:
    """A client's own-width model from the universe: the inverse of the client's transform into it.

    ``transform`` maps the client (width d_c) into the universe (width d_u ≥ d_c); its residual element
    is ``d_u × d_c`` with orthonormal columns, so the projection is its transpose (and every other group
    is inverted too, returning the client's own unit order). Exact on a lifted model.
    """
    from .symmetry import apply_transform, invert_transform

    return apply_transform(universe, invert_transform(transform))
