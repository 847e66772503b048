"""Averages of aligned models, with no matching inside: plain / weighted (``weighted_state``), masked
(``unit_weighted``: each head, FF neuron and residual direction averaged over the models that hold
it), and circuit (``circuit_state``) — and ``merge`` / ``interpolate`` on models, in three forms.

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

from typing import Iterable, Optional, Sequence

import torch
import torch.nn as nn

from fedlmc.models.layers import TransformerConfig, is_rotary
from fedlmc.options import FORMS, REDUCES
from fedlmc.symmetry import StateDict, apply_to_state, canonical, layernorm_native, rebuild, spec_for, to_layernorm


def _check_same_shape(models: Sequence[nn.Module]) -> None:
    first = models[0].config
    for m in models[1:]:
        # a width lift rescales eps by d/d_u (see apply_to_state); at 1e-5 that is immaterial to a merge
        if m.config.replace(norm=first.norm, norm_bias=first.norm_bias, norm_eps=first.norm_eps) != first:
            raise ValueError(
                f"models differ in shape:\n  {first}\n  {m.config}\n(lift or project them to one width first)"
            )


def weighted_state(states: Sequence[StateDict], weights: Sequence[float]) -> StateDict:
    """``Σ w_m θ_m`` tensor by tensor."""
    return {k: sum(w * sd[k] for w, sd in zip(weights, states)) for k in states[0]}


def aligned_state(model: nn.Module, T) -> StateDict:
    """The state dict of ``model`` (canonical) aligned by the transform ``T``."""
    return apply_to_state({k: v.detach() for k, v in model.state_dict().items()}, model.config, T)[0]


class RunningSum:
    """``Σ w_m θ_m`` built one state dict at a time (a streamed weighted mean holds the sum and one
    model, whatever M is); ``add`` sums in the order given, ``mean()`` divides by the weights added.
    ``dtype``: sum in this dtype (e.g. float64, so that the order of the terms hardly shows), else in
    each tensor's own."""

    def __init__(self, dtype: Optional[torch.dtype] = None) -> None:
        self.state: Optional[StateDict] = None
        self.weight = 0.0
        self.dtype = dtype

    def add(self, state: StateDict, w: float) -> None:
        if self.state is None:
            self.state = {k: v.to(self.dtype or v.dtype) * w for k, v in state.items()}
        else:
            for k, v in state.items():
                self.state[k].add_(v.to(self.state[k].dtype), alpha=w)
        self.weight += w

    def add_sum(self, state: StateDict, weight: float) -> None:
        """Add another partial sum (of models whose weights add up to ``weight``)."""
        if self.state is None:
            self.state = {k: v.clone() for k, v in state.items()}
        else:
            for k, v in state.items():
                self.state[k].add_(v)
        self.weight += weight

    def mean(self) -> StateDict:
        """The weighted mean (in place: the sum is divided unless the weights added sum to one)."""
        if self.state is None:
            raise ValueError("nothing was added")
        if abs(self.weight - 1.0) > 1e-12:
            for v in self.state.values():
                v.div_(self.weight)
        return self.state


def add_move(acc: RunningSum, model: nn.Module, T, w: float) -> None:
    """Add ``w (T(model) − model)`` to ``acc`` (``model`` canonical), nothing for the identity: where a
    universe is the models' plain weighted mean (weights summing to one), adding these sums to it gives
    the mean of the aligned models, and the models that keep the identity cost nothing."""
    if T.elements:
        acc.add(aligned_state(model, T), w)
        acc.add({k: v.detach() for k, v in model.state_dict().items()}, -w)


def streamed_mean(models: Iterable[nn.Module], weights: Sequence[float]) -> nn.Module:
    """``Σ w_m θ_m / Σ w_m`` over models given one at a time (e.g. read from disk as the loop asks): the
    sum and one model in memory, whatever their number."""
    acc, first = RunningSum(), None
    for model, w in zip(models, weights):
        acc.add({k: v.detach() for k, v in model.state_dict().items()}, w)
        first = model if first is None else first
    if first is None:
        raise ValueError("streamed_mean needs at least one model")
    return rebuild(first, acc.mean(), own=True)


def robust_state(states: Sequence[StateDict], reduce: str = "median", trim: float = 0.2) -> StateDict:
    """Coordinate-wise robust combination, unweighted as Flower's ``FedMedian`` / ``FedTrimmedAvg``:
    ``median`` (the mean of the two middle values for an even count), or ``trimmed`` (the mean after
    dropping the ``⌊trim·M⌋`` largest and smallest values of every coordinate). On aligned models this
    is the robust aggregate *modulo the symmetries*; on raw ones it is Flower's."""
    if reduce not in ("median", "trimmed"):
        raise ValueError(f"reduce must be one of {REDUCES[1:]}, got {reduce!r}")
    M = len(states)
    k = int(trim * M) if reduce == "trimmed" else (M - 1) // 2
    if reduce == "trimmed" and not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    out: StateDict = {}
    for key in states[0]:
        ordered = torch.stack([sd[key] for sd in states]).sort(dim=0).values
        out[key] = ordered[k : M - k].mean(0)  # median: the middle one or two values
    return out


def robust_merge(models: Sequence[nn.Module], reduce: str, trim: float = 0.2) -> nn.Module:
    """``robust_state`` of same-shape models, as a model (on raw replies: Flower's FedMedian / FedTrimmedAvg)."""
    return rebuild(models[0], robust_state([m.state_dict() for m in models], reduce, trim))


def check_circuit(cfg) -> None:
    """The circuit form concatenates each head's dimensions across models; rotary position embeddings
    (Llama, GPT-NeoX) pair and rotate dimensions by their place in the head, so there the concatenated
    head computes other scores: such models merge in the factored form only."""
    if is_rotary(cfg):
        raise ValueError(
            f"the circuit form is not exact for rotary {cfg.arch} models (concatenated heads change which "
            "dimensions RoPE pairs and at which frequencies): merge them in the factored form"
        )


def circuit_state(
    states: Sequence[StateDict],
    weights: Sequence[float],
    cfg,
    masks: Optional[Sequence[Optional[dict[str, torch.Tensor]]]] = None,
) -> tuple[StateDict, object]:
    """Merge heads as circuits: concatenate every model's heads, weighting one factor of each circuit.
    ``masks`` (see ``widths.unit_masks``) weight each head and FF neuron only over the models having it."""
    check_circuit(cfg)
    spec = spec_for(cfg)
    H, dh = cfg.n_head, cfg.d_head
    if masks is not None and any(m is not None for m in masks):
        out = unit_weighted(states, weights, masks, cfg)
    else:
        out = weighted_state(states, weights)
    for kind in ("qk", "ov"):
        for g in spec.layer_groups(kind):
            head_w = _head_weights(weights, masks, g.heads, H, states[0][g.members[0].param])
            for m in g.members:
                # the transposed side (Q of QK, O of OV) carries the weights; the other side is shared
                scaled = m.fn in ("MT", "MinvT")
                parts = []
                for i, sd in enumerate(states):
                    t = sd[m.param].movedim(m.axis, 0).reshape(H, dh, *sd[m.param].movedim(m.axis, 0).shape[1:])
                    if scaled:
                        t = t * head_w[i].reshape(H, *([1] * (t.dim() - 1)))
                    parts.append(t)
                cat = torch.cat(parts, dim=1)
                out[m.param] = cat.reshape(H * dh * len(states), *cat.shape[2:]).movedim(0, m.axis)
    return out, cfg.replace(d_head=dh * len(states), attn_scale=cfg.attn_scale)


def _head_weights(weights, masks, name: str, H: int, ref: torch.Tensor) -> torch.Tensor:
    """(M, H) per-head merge weights: ``w_m`` renormalised over the models that have each head."""
    W = torch.stack(
        [
            w * ((m[name] if m is not None and name in m else torch.ones(H, dtype=torch.bool)).to(ref))
            for w, m in zip(weights, masks or [None] * len(weights))
        ]
    )
    den = W.sum(0, keepdim=True)
    return torch.where(den > 0, W / den.clamp_min(1e-30), torch.full_like(W, 1.0 / len(weights)))


def merge(
    models: Sequence[nn.Module],
    weights: Sequence[float],
    form: str = "factored",
    keep_layernorm: bool = False,
    masks: Optional[Sequence[Optional[dict[str, torch.Tensor]]]] = None,
) -> nn.Module:
    """``Σ w_m θ_m`` of same-shape (already aligned) models, in the given form.

    ``masks`` (one per model, from ``widths.unit_masks``/``permute_masks``) mark padded heads and FF
    neurons; each unit is then averaged only over the models that really have it."""
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; choose one of {FORMS}")
    if len(models) != len(weights) or not models:
        raise ValueError("merge needs one weight per model")
    _check_same_shape(models)
    if form == "circuit" or not all(m.config.norm == "layernorm" for m in models):
        models = [canonical(m) for m in models]
    # else: LayerNorm models in the factored form are averaged as they are (exactly FedAvg; the result
    # is a LayerNorm model, so keep_layernorm holds without a conversion)
    ref = models[0]
    states = [{k: v.detach().to(next(ref.parameters())) for k, v in m.state_dict().items()} for m in models]
    masked = masks is not None and any(m is not None for m in masks)
    if form == "circuit":
        sd, cfg = circuit_state(states, weights, ref.config, masks if masked else None)
    elif masked:
        sd, cfg = unit_weighted(states, weights, masks, ref.config), ref.config
    else:
        sd, cfg = weighted_state(states, weights), ref.config
    out = rebuild(ref, sd, cfg)
    keep = keep_layernorm and out.config.norm != "layernorm" and layernorm_native(out.config)
    return to_layernorm(out) if keep else out


def interpolate(
    model_a: nn.Module, model_b: nn.Module, lam: float, form: str = "factored", keep_layernorm: bool = False
) -> nn.Module:
    """``λ·A + (1−λ)·B`` of two same-shape models (B already aligned to A), in the given ``form``."""
    return merge([model_a, model_b], [lam, 1.0 - lam], form=form, keep_layernorm=keep_layernorm)


def unit_weighted(
    states: Sequence[StateDict],
    weights: Sequence[float],
    masks: Sequence[Optional[dict[str, torch.Tensor]]],
    cfg: TransformerConfig,
    base: Optional[StateDict] = None,
) -> StateDict:
    """``Σ w_m θ_m`` where every entry is averaged only over the models that hold it.

    Heads and FF neurons: a mask per model (``unit_masks`` after permutation) says which units are its
    own; each unit is averaged over its holders. Residual stream: ``masks[m]["residual"]`` (optional)
    is the projector ``P_m = O_m O_mᵀ`` onto the subspace a narrower model was lifted into; along the
    residual axis the merge is ``(Σ w_m P_m)⁺ Σ w_m θ_m`` — in a direction only the wide models span,
    only they count, instead of being shrunk by the narrow models' zeros. Other tensors: plain averages.
    """
    out = dict(base) if base is not None else weighted_state(states, weights)
    spec = spec_for(cfg)
    res_axis = {m.param: m.axis for m in spec.residual.members}
    projs = [m.get("residual") if m is not None else None for m in masks]
    use_proj = any(P is not None for P in projs)
    unit_of = {}
    for name, g in spec.groups.items():
        if g.kind == "permutation" and name != "residual" and any(m is not None and name in m for m in masks):
            for mem in g.members:
                unit_of[mem.param] = (name, g, mem)
    for k in states[0]:
        raxis = res_axis.get(k) if use_proj else None
        if k not in unit_of and raxis is None:
            continue
        if k not in unit_of:
            out[k] = _combine([sd[k] for sd in states], list(weights), projs, raxis)
            continue
        name, g, mem = unit_of[k]
        held = torch.stack(
            [
                (m[name] if m is not None and name in m else torch.ones(g.size, dtype=torch.bool)).bool().cpu()
                for m in masks
            ]
        )  # (M, units)
        result = torch.empty_like(states[0][k])
        for pattern in torch.unique(held, dim=1).T:
            units = torch.nonzero((held == pattern[:, None]).all(0)).flatten()
            idx = (units[:, None] * mem.block + torch.arange(mem.block)).flatten().to(result.device)
            w = [float(wi) if bool(p) else 0.0 for wi, p in zip(weights, pattern)]
            if sum(w) <= 0:  # a unit no weighted model holds: plain mean
                w = [1.0] * len(states)
            parts = [sd[k].index_select(mem.axis, idx) for sd in states]
            merged = _combine(parts, w, projs, raxis)
            result.index_copy_(mem.axis, idx, merged)
        out[k] = result
    return out


def _combine(ts: Sequence[torch.Tensor], w: Sequence[float], projs, axis: Optional[int]) -> torch.Tensor:
    """``Σ w_i t_i / Σ w_i``, or along the residual ``axis`` ``(Σ w_i P_i)⁺ Σ w_i t_i`` (identity P when None)."""
    acc = sum(wi * t for wi, t in zip(w, ts) if wi)
    if axis is None:
        return acc / sum(w)
    d = ts[0].shape[axis]
    A = torch.zeros(d, d, dtype=torch.float64)
    for wi, P in zip(w, projs):
        if wi:
            A += wi * (P.to(torch.float64).cpu() if P is not None else torch.eye(d, dtype=torch.float64))
    Ainv = torch.linalg.pinv(A, hermitian=True).to(acc)
    return (acc.movedim(axis, -1) @ Ainv).movedim(-1, axis)
