"""Models of different shapes in one space: exact zero-padding lifts, unit masks and projections.

A narrower model joins a wider "universe" exactly:

* residual width ``d → d_u``: the semi-orthogonal lift ``[I; 0]`` (readers absorb RMSNorm's rescaling,
  see ``symmetry.act``); matching then rotates it freely, so the client's map into the universe is a
  rectangular ``d_u × d`` matrix with orthonormal columns;
* FF neurons ``d_ff → d_ff_u``: zero neurons (zero input row and bias, zero output column: GELU(0) = 0),
  or (``ff_lift="split"``, a semi-permutation) the client's own neurons split: unit ``k`` copies neuron
  ``k mod d_ff``'s input row and bias, and the copies of a neuron share its output column equally
  (exact for any elementwise nonlinearity: the copies compute the same activation). A split model has
  no padding to mask; ``unpad`` merges the copies back (their share-weighted mean input, their summed
  output: exact on a split model);
* heads ``H → H_u``: zero heads (zero Q, K, V, O: uniform attention over zero values writes nothing),
  or (``head_lift="split"``, the OV split) the client's own heads split: head ``k`` copies head
  ``k mod H``'s Q, K and V (one QK circuit, so the copies attend alike) and the copies share its O
  columns (exact for any attention); ``unpad`` merges them back as FF splits are;
* head width ``d_head → d_head_u``: zero dimensions inside each head (Q·K and V·O unchanged); Q absorbs
  the change of attention scale so every padded model shares the universe's ``attn_scale``.

The padded units are marked in ``unit_masks``; a merge averages each FF neuron and head only over the
models that really have it (a smaller model's units map onto a *subset* of the universe's), instead of
diluting it with zeros. Head-width padding and the residual lift are rotated by matching, so they are
averaged plainly. ``unpad`` is the inverse (exact on padded models): it slices a universe-shaped model
back to a client's shape.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from fedlmc.models import from_config
from fedlmc.models.layers import TransformerConfig, is_rotary
from fedlmc.options import FF_LIFTS, one_of
from fedlmc.symmetry import StateDict, Transform, apply_transform, rebuild, spec_for

SHAPE = ("d_model", "n_head", "d_ff", "d_head")


def shape_of(cfg: TransformerConfig) -> dict[str, int]:
    """The fields that may differ between models of one federation."""
    return {k: int(getattr(cfg, k)) for k in SHAPE}


def common_shape(configs: Sequence[TransformerConfig]) -> dict[str, int]:
    """The smallest shape every config fits in (field-wise maximum). Everything else must agree."""
    first = configs[0]
    for c in configs[1:]:
        if c.arch != first.arch or c.n_layer != first.n_layer:
            raise ValueError(
                f"models must share architecture and depth to be merged: {first.arch}×{first.n_layer} "
                f"vs {c.arch}×{c.n_layer}"
            )
        other = {
            k: v
            for k, v in c.to_dict().items()
            if k not in SHAPE + ("norm", "norm_bias", "norm_gain", "norm_eps", "attn_scale")
        }
        mine = {k: v for k, v in first.to_dict().items() if k in other}
        if other != mine:
            diff = sorted(k for k in other if other[k] != mine[k])
            raise ValueError(
                f"models differ in more than width ({', '.join(diff)}); only {', '.join(SHAPE)} may differ"
            )
    return {k: max(int(getattr(c, k)) for c in configs) for k in SHAPE}


def same_shape(configs: Sequence[TransformerConfig]) -> bool:
    return all(shape_of(c) == shape_of(configs[0]) for c in configs)


def _pad_axis(t: torch.Tensor, axis: int, units: int, block: int, new_units: int, new_block: int) -> torch.Tensor:
    """Zero-pad ``units`` blocks of ``block`` entries along ``axis`` to ``new_units`` blocks of ``new_block``."""
    x = t.movedim(axis, 0)
    rest = x.shape[1:]
    x = x.reshape(units, block, *rest)
    out = x.new_zeros(new_units, new_block, *rest)
    out[:units, :block] = x
    return out.reshape(new_units * new_block, *rest).movedim(0, axis)


def _slice_axis(t: torch.Tensor, axis: int, units: int, block: int, keep_units: int, keep_block: int) -> torch.Tensor:
    x = t.movedim(axis, 0)
    rest = x.shape[1:]
    x = x.reshape(units, block, *rest)[:keep_units, :keep_block]
    return x.reshape(keep_units * keep_block, *rest).movedim(0, axis)


def split_sources(d_ff: int, new_d_ff: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split lift's semi-permutation of ``d_ff`` units (FF neurons or heads) into ``new_d_ff``: which
    unit each new one copies (``k mod d_ff``) and the share of that unit's output each copy carries (1 /
    its number of copies)."""
    src = torch.arange(new_d_ff) % d_ff
    return src, 1.0 / torch.bincount(src, minlength=d_ff)[src].double()


def _split_axis(
    t: torch.Tensor, axis: int, units: int, new_units: int, output: bool, grow: bool, block: int = 1
) -> torch.Tensor:
    """Split ``units`` units (blocks of ``block`` entries) along ``axis`` into ``new_units`` (``grow``), or
    merge them back. The output side (``output``: an FF writer's or a head's O columns) carries the
    shares; the input side is copied, and merged as the share-weighted mean of its copies."""
    narrow, wide = (units, new_units) if grow else (new_units, units)
    src, share = split_sources(narrow, wide)
    x = t.movedim(axis, 0)
    rest = x.shape[1:]
    x = x.reshape(units, block, *rest)
    share = share.to(x.dtype).to(x.device).reshape(-1, *[1] * (x.dim() - 1))
    if grow:
        out = x[src.to(x.device)] * (share if output else 1)
    else:
        out = x.new_zeros(new_units, block, *rest).index_add_(0, src.to(x.device), x * (1 if output else share))
    return out.reshape(new_units * block, *rest).movedim(0, axis)


def _resize_head(t: torch.Tensor, axis: int, cfg, n_head: int, d_head: int, grow: bool, head_lift: str):
    """One head-indexed tensor resized to ``n_head`` heads of width ``d_head``: zero heads, or
    (``head_lift="split"``) the model's own heads split, their width padded or sliced apart from that."""
    H, dh = cfg.n_head, cfg.d_head
    if head_lift != "split" or n_head == H:
        return (_pad_axis if grow else _slice_axis)(t, axis, H, dh, n_head, d_head)
    if getattr(cfg, "n_kv_head", H) != H:
        raise ValueError("head_lift='split' needs one KV head per query head (grouped-query attention shares them)")
    if grow:
        return _split_axis(_pad_axis(t, axis, H, dh, H, d_head), axis, H, n_head, axis == 1, True, d_head)
    return _slice_axis(_split_axis(t, axis, H, n_head, axis == 1, False, dh), axis, n_head, dh, n_head, d_head)


def _resize_units(
    model: nn.Module,
    n_head: int,
    d_head: int,
    d_ff: int,
    attn_scale: float,
    grow: bool,
    ff_lift: str = "zeros",
    head_lift: str = "zeros",
) -> nn.Module:
    cfg = model.config
    if d_head != cfg.d_head and is_rotary(cfg) and getattr(cfg, "rotary_dims", None) is None:
        # a fully rotary head pairs dimension i with i + d_head/2: another width pairs them differently
        raise ValueError(f"a {cfg.arch} head's width cannot change: RoPE pairs its dimensions by the head width")
    spec = spec_for(cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    resize = _pad_axis if grow else _slice_axis
    for g in spec.layer_groups("qk"):
        # the query side (q → Aᵀq) absorbs the change of attention scale, so scores stay the same
        for m in g.members:
            if m.fn == "MT":
                sd[m.param] = sd[m.param] * (cfg.attn_scale / attn_scale)
    for g in spec.layer_groups("heads"):
        for m in g.members:  # a head's O columns (axis 1) are its output side
            sd[m.param] = _resize_head(sd[m.param], m.axis, cfg, n_head, d_head, grow, head_lift)
    for g in spec.layer_groups("ff"):
        for m in g.members:  # an FF writer's columns (axis 1 of fc2 / down) are the neurons' output side
            if ff_lift == "split" and d_ff != cfg.d_ff:
                sd[m.param] = _split_axis(sd[m.param], m.axis, cfg.d_ff, d_ff, output=m.axis == 1, grow=grow)
            else:
                sd[m.param] = resize(sd[m.param], m.axis, cfg.d_ff, 1, d_ff, 1)
    kv = {"n_kv_head": n_head} if getattr(cfg, "n_kv_head", None) == cfg.n_head else {}  # one KV head per head
    return rebuild(model, sd, cfg.replace(n_head=n_head, d_head=d_head, d_ff=d_ff, attn_scale=attn_scale, **kv))


def residual_lift(d_small: int, d_large: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[I; 0]``: the ``d_large × d_small`` lift onto the first ``d_small`` residual coordinates."""
    return torch.eye(d_large, d_small, dtype=dtype)


def pad(
    model: nn.Module,
    shape: dict[str, int],
    residual: bool = True,
    attn_scale: Optional[float] = None,
    ff_lift: str = "zeros",
    head_lift: str = "zeros",
) -> nn.Module:
    """``model`` zero-padded exactly into ``shape`` (fields of ``SHAPE``; missing ones are kept).

    ``residual=False`` pads only the units (heads, head width, FF), leaving the residual lift to a
    transform (``align`` does that). ``attn_scale`` defaults to ``1/sqrt(shape['d_head'])`` when the
    head width grows. ``ff_lift="split"`` fills a wider FF with the model's own neurons split (module
    docstring) instead of zero neurons, ``head_lift="split"`` more heads with its own heads split. A
    LayerNorm model is canonicalised when its residual is lifted.
    """
    one_of(ff_lift, FF_LIFTS, "ff lift")
    one_of(head_lift, FF_LIFTS, "head lift")
    cfg = model.config
    target = {**shape_of(cfg), **{k: int(v) for k, v in shape.items() if v is not None}}
    for k in SHAPE:
        if target[k] < getattr(cfg, k):
            raise ValueError(f"cannot pad {k}={getattr(cfg, k)} into a smaller {target[k]}")
    scale = (
        attn_scale
        if attn_scale is not None
        else (cfg.attn_scale if target["d_head"] == cfg.d_head else target["d_head"] ** -0.5)
    )
    out = model
    if (target["n_head"], target["d_head"], target["d_ff"]) != (
        cfg.n_head,
        cfg.d_head,
        cfg.d_ff,
    ) or scale != cfg.attn_scale:
        out = _resize_units(model, target["n_head"], target["d_head"], target["d_ff"], scale, True, ff_lift, head_lift)
    if residual and target["d_model"] != cfg.d_model:
        ref = next(out.parameters())
        out = apply_transform(out, Transform({"residual": residual_lift(cfg.d_model, target["d_model"], ref.dtype)}))
    return out


def unpad(model: nn.Module, client: TransformerConfig, ff_lift: str = "zeros", head_lift: str = "zeros") -> nn.Module:
    """Slice a universe-shaped model to ``client``'s shape (the inverse of ``pad``; exact on padded models).

    The residual is projected onto its first ``client.d_model`` coordinates (the transpose of the lift),
    heads, head dimensions and FF neurons keep their first entries (``ff_lift="split"``: each neuron's
    copies are merged back; ``head_lift="split"``: each head's too), and the client's attention scale and
    norm eps are restored.
    """
    cfg = model.config
    out = model
    if cfg.d_model != client.d_model:
        ref = next(out.parameters())
        out = apply_transform(out, Transform({"residual": residual_lift(client.d_model, cfg.d_model, ref.dtype).T}))
    c = out.config
    if (c.n_head, c.d_head, c.d_ff, c.attn_scale) != (client.n_head, client.d_head, client.d_ff, client.attn_scale):
        out = _resize_units(
            out, client.n_head, client.d_head, client.d_ff, client.attn_scale, False, ff_lift, head_lift
        )
    if out.config.norm_eps != client.norm_eps:
        out = rebuild(out, out.state_dict(), out.config.replace(norm_eps=client.norm_eps))
    return out


def unit_masks(
    cfg: TransformerConfig, shape: dict[str, int], device=None, ff_lift: str = "zeros", head_lift: str = "zeros"
) -> dict[str, torch.Tensor]:
    """Which heads and FF neurons of a model padded into ``shape`` are real (True) or padding (False);
    a split FF (``ff_lift="split"``) or split heads (``head_lift="split"``) have no padding."""
    spec = spec_for(cfg)
    heads = shape["n_head"] if head_lift == "split" else cfg.n_head
    out = {g.name: torch.arange(shape["n_head"], device=device) < heads for g in spec.layer_groups("heads")}
    ff = shape["d_ff"] if ff_lift == "split" else cfg.d_ff
    out.update({g.name: torch.arange(shape["d_ff"], device=device) < ff for g in spec.layer_groups("ff")})
    return out


def permute_masks(masks: dict[str, torch.Tensor], transform: Transform) -> dict[str, torch.Tensor]:
    """The masks after ``transform``'s head and FF permutations (``new = old[perm]``)."""
    out = dict(masks)
    for name, mask in masks.items():
        perm = transform.get(name)
        if perm is not None:
            out[name] = mask[perm.to(mask.device)]
    return out


def into_universe(model: nn.Module, transform: Transform) -> nn.Module:
    """Apply a client's transform into the universe: pad its units to the universe's sizes (from the
    transform's ``width_map``), then apply the elements (whose residual may be rectangular)."""
    wm = transform.width_map
    if wm is not None:
        model = pad(model, wm.shape, residual=False, attn_scale=wm.attn_scale, ff_lift=wm.ff_lift)
    return apply_transform(model, transform)


def lift_residual(transform: Transform, d_small: int) -> Transform:
    """Compose a square residual map found on a residual-padded model with the ``[I; 0]`` lift, giving
    the client's own rectangular map (``d_u × d_small``)."""
    R = transform.get("residual")
    if R is None:
        return transform
    els = dict(transform.elements)
    els["residual"] = R[:, :d_small].clone()
    return Transform(els, dict(transform.info), transform.width_map)


def ones_lift(d_small: int, d_large: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The ``d_large × d_large`` reflection taking ``[1; 0]/√d_small`` to ``1/√d_large``. After zero-padding
    it lifts a centred (LayerNorm) stream of width ``d_small`` to one that is centred in ``d_large``, so
    models of several widths can share a LayerNorm universe and be projected back to LayerNorm models."""
    a = torch.zeros(d_large, dtype=dtype)
    a[:d_small] = d_small**-0.5
    v = a - torch.full((d_large,), d_large**-0.5, dtype=dtype)
    if float(v.norm()) < 1e-12:
        return torch.eye(d_large, dtype=dtype)
    return torch.eye(d_large, dtype=dtype) - 2 * torch.outer(v, v) / v.dot(v)


def residual_projector(transform: Transform, d_small: int, d_large: int) -> torch.Tensor:
    """``P = O Oᵀ`` with ``O`` the first ``d_small`` columns of a padded model's square residual map
    (identity when the transform has none): the subspace of the universe the narrower model occupies."""
    R = transform.get("residual")
    if R is None:
        R = torch.eye(d_large, dtype=torch.float64)
    O = R[:, :d_small].to(torch.float64)
    return O @ O.T


# --------------------------------------------------------------------------------------------------
# HeteroFL-style index slicing (the baseline for mixed widths): no alignment, prefixes of every axis.


def width_config(cfg: TransformerConfig, factor: float) -> TransformerConfig:
    """A client's config at ``1/factor`` of the width: ``d_model`` and ``d_ff`` shrink, heads keep their
    number and width (so prefixes of Q/K/V rows stay whole heads)."""
    if factor == 1:
        return cfg
    d, f = int(round(cfg.d_model / factor)), int(round(cfg.d_ff / factor))
    if d < 1 or f < 1:
        raise ValueError(f"width factor {factor} leaves nothing of d_model={cfg.d_model}, d_ff={cfg.d_ff}")
    return cfg.replace(d_model=d, d_ff=f, d_head=cfg.d_head, attn_scale=cfg.attn_scale)


def slice_prefix(model: nn.Module, client: TransformerConfig) -> nn.Module:
    """HeteroFL's sub-model: every tensor's leading block of the client's sizes (no alignment)."""
    template = from_config(
        client.replace(norm=model.config.norm, norm_bias=model.config.norm_bias, norm_gain=model.config.norm_gain)
    )
    src = model.state_dict()
    sd = {}
    for k, t in template.state_dict().items():
        s = src[k]
        if s.dim() != t.dim() or any(a < b for a, b in zip(s.shape, t.shape)):
            raise ValueError(f"{k}: cannot slice {tuple(s.shape)} down to {tuple(t.shape)}")
        sd[k] = s[tuple(slice(0, n) for n in t.shape)].clone()
    return rebuild(model, sd, template.config)


def prefix_average(states: Sequence[StateDict], weights: Sequence[float], previous: StateDict) -> StateDict:
    """HeteroFL aggregation: each entry of the global tensors is the weighted mean over the clients whose
    sub-model contains it (zero-padded prefixes; a shallower client's first blocks); entries no client
    holds keep their previous value."""
    out = {}
    for k, g in previous.items():
        num = torch.zeros_like(g, dtype=torch.float64)
        den = torch.zeros_like(g, dtype=torch.float64)
        for w, sd in zip(weights, states):
            if k not in sd:  # a block the client's (shallower) model does not have
                continue
            idx = tuple(slice(0, n) for n in sd[k].shape)
            num[idx] += w * sd[k].to(torch.float64)
            den[idx] += w
        out[k] = torch.where(den > 0, num / den.clamp_min(1e-30), g.to(torch.float64)).to(g.dtype)
    return out
