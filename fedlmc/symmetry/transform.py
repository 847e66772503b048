"""A ``Transform`` (one element of the product group: a dict from group name to element; missing groups
are the identity) and its exact action on a state dict.

One representation per group kind, read from the spec (never from a tensor's dtype):
- ``permutation``: an index tensor with the convention ``new[i] = old[perm[i]]`` (the permutation
  matrix P has ``P[i, perm[i]] = 1``);
- ``orthogonal`` (the residual map): a float matrix ``d' × d`` (a residual *permutation*, Git
  Re-Basin's baseline, is its permutation matrix);
- ``gauge``: a float tensor of per-head invertible matrices ``(count, size, size)``;
- ``scale``: a float vector of ``size`` non-zero factors (positive for ``structure="positive"``).
The learned optimiser differentiates through a *relaxed* action (``relaxed=True``) in which a
permutation group's element is a (straight-through) float matrix instead."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn as nn

from fedlmc.models import ARCHS, from_config
from fedlmc.models.layers import TransformerConfig
from fedlmc.symmetry.rope import rope_structured
from fedlmc.symmetry.spec import Group, StateDict, spec_for


@dataclass(frozen=True)
class WidthMap:
    """How a client of another shape enters a wider universe (typed, so nothing downstream reads it out
    of ``info``): the universe's unit sizes it is padded to (``d_model``, ``n_head``, ``d_head``,
    ``d_ff``), the universe's attention scale, and the client's own config (what ``project`` returns to)."""

    shape: dict[str, int]
    attn_scale: float
    client: TransformerConfig
    ff_lift: str = "zeros"  # how its FF entered: zero neurons or its own neurons split (``widths.pad``)
    head_lift: str = "zeros"  # ... and its heads: zero heads or its own heads split (the OV split)

    def to_dict(self) -> dict:
        return {
            "shape": dict(self.shape),
            "attn_scale": self.attn_scale,
            "client": self.client.to_dict(),
            "ff_lift": self.ff_lift,
            "head_lift": self.head_lift,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "WidthMap":
        client = ARCHS[d["client"]["arch"]][0].from_dict(d["client"])
        lifts = (d.get("ff_lift", "zeros"), d.get("head_lift", "zeros"))
        return cls(dict(d["shape"]), float(d["attn_scale"]), client, *lifts)


@dataclass
class Transform:
    """One group element per named group (absent groups act as the identity); ``width_map`` when the
    transform maps a client of another shape into a wider universe; ``info`` is diagnostics only."""

    elements: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict = field(default_factory=dict, compare=False)  # diagnostics from whoever built it
    width_map: Optional[WidthMap] = None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.elements[name]

    def get(self, name: str) -> Optional[torch.Tensor]:
        return self.elements.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.elements

    def to(self, dtype: Optional[torch.dtype] = None, device: Union[str, torch.device, None] = None) -> "Transform":
        """Float elements to ``dtype``/``device``; permutations stay integer."""
        out = {
            k: v.to(device=device, dtype=(dtype or v.dtype) if v.is_floating_point() else v.dtype)
            for k, v in self.elements.items()
        }
        return Transform(out, width_map=self.width_map)


# --------------------------------------------------------------------------------------------------
# The action.


def _matrix(M: torch.Tensor, fn: str) -> torch.Tensor:
    if fn == "M":
        return M
    if fn == "MT":
        return M.transpose(-1, -2)
    if fn == "Minv":
        return torch.linalg.inv(M)
    if fn == "MinvT":
        return torch.linalg.inv(M).transpose(-1, -2)
    raise ValueError(f"unknown member fn {fn!r}")


def apply_along(t: torch.Tensor, axis: int, M: torch.Tensor) -> torch.Tensor:
    """Replace every vector v along ``axis`` by ``M v`` (M may be rectangular)."""
    x = t.movedim(axis, -1)
    return (x @ M.transpose(0, 1).to(x)).movedim(-1, axis)


def _permute_along(t: torch.Tensor, axis: int, perm: torch.Tensor, block: int) -> torch.Tensor:
    perm = perm.to(t.device)
    if block > 1:
        perm = (perm[:, None] * block + torch.arange(block, device=t.device)).reshape(-1)
    return t.index_select(axis, perm)


def _gauge_along(t: torch.Tensor, axis: int, Ms: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block matrices: block h of the vectors along ``axis`` becomes ``Ms[h] @ block_h``."""
    x = t.movedim(axis, -1)
    shape = x.shape
    x = x.reshape(*shape[:-1], Ms.shape[0], block)
    x = torch.einsum("...hj,hij->...hi", x, Ms.to(x))
    return x.reshape(shape).movedim(-1, axis)


class _GatherStraightThrough(torch.autograd.Function):
    """``new = (P ⊗ I_block) old`` along ``axis`` for a matrix P whose *value* is the permutation matrix of
    ``perm`` (a straight-through element): the forward gathers instead of multiplying (the same values:
    products with 0/1 entries are exact), ``old`` gets its gradient scattered back and P the dense
    ``G Xᵀ`` autograd would give it. That drops two of the three products a relaxed FF permutation cost
    per step of learned alignment."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, P: torch.Tensor, perm: torch.Tensor, axis: int, block: int) -> torch.Tensor:
        ctx.save_for_backward(t, perm)
        ctx.axis, ctx.block = axis, block
        return _permute_along(t, axis, perm, block)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        t, perm = ctx.saved_tensors
        n = len(perm)
        grad_t = _permute_along(g, ctx.axis, torch.argsort(perm), ctx.block) if ctx.needs_input_grad[0] else None
        grad_P = None
        if ctx.needs_input_grad[1]:  # rows i·block … i·block + block − 1 of the axis are unit i's
            grad_P = g.movedim(ctx.axis, 0).reshape(n, -1) @ t.movedim(ctx.axis, 0).reshape(n, -1).to(g).T
        return grad_t, grad_P, None, None, None


def _as_permutation(P: torch.Tensor) -> Optional[torch.Tensor]:
    """The index permutation whose matrix ``P``'s value is exactly, else None."""
    v = P.detach()
    perm = v.argmax(1)
    return perm if torch.equal(v, perm_matrix(perm, v.dtype).to(v.device)) else None


def perm_matrix(perm: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The matrix P with ``P[i, perm[i]] = 1`` (so ``P @ old = old[perm]``)."""
    n = len(perm)
    P = torch.zeros(n, n, dtype=dtype, device=perm.device)
    P[torch.arange(n, device=perm.device), perm] = 1
    return P


def within_blocks(perm: torch.Tensor, block: int) -> bool:
    """Whether index permutation ``perm`` maps every block of ``block`` consecutive units onto itself."""
    idx = torch.arange(len(perm), device=perm.device)
    return bool((perm // block == idx // block).all())


def is_identity(element: torch.Tensor) -> bool:
    """Whether a group element (in its kind's representation) is the identity: the index permutation
    ``arange``, or identity matrices (one, or one per head)."""
    if not element.is_floating_point():
        return element.dim() == 1 and torch.equal(element, torch.arange(len(element), device=element.device))
    if element.dim() == 1:  # a scale
        return bool((element == 1).all())
    if element.shape[-1] != element.shape[-2]:
        return False
    eye = torch.eye(element.shape[-1], dtype=element.dtype, device=element.device)
    return torch.equal(element, eye.expand_as(element))


def check_element(group: Group, element: torch.Tensor, relaxed: bool = False) -> None:
    """Raise a clear error unless ``element`` has its group kind's representation (module docstring)."""
    if group.kind == "permutation" and relaxed:
        ok = element.is_floating_point() and element.shape == (group.size, group.size)
    elif group.kind == "permutation":
        ok = element.dim() == 1 and not element.is_floating_point() and len(element) == group.size
        if ok and group.structure == "within":  # every unit stays in its block
            ok = within_blocks(element, group.size // group.count)
    elif group.kind == "orthogonal":
        ok = element.is_floating_point() and element.dim() == 2 and element.shape[1] == group.size
    elif group.kind == "gauge":
        ok = element.is_floating_point() and element.shape == (group.count, group.size, group.size)
        if ok and group.structure == "rope":
            ok = rope_structured(element, rotary=group.rotary)
    elif group.kind == "scale":
        ok = element.is_floating_point() and element.shape == (group.size,) and bool((element != 0).all())
        if ok and group.structure == "positive":
            ok = bool((element > 0).all())
    else:
        raise ValueError(f"unknown group kind {group.kind!r}")
    if not ok:
        raise ValueError(
            f"group {group.name!r} ({group.kind}, size {group.size}) got an element of shape "
            f"{tuple(element.shape)} and dtype {element.dtype}"
        )


def act(sd: StateDict, group: Group, element: torch.Tensor, relaxed: bool = False) -> StateDict:
    """Apply one group element to a state dict (returns a new dict; untouched tensors are shared).
    Members whose tensor is absent from ``sd`` are skipped, so a partial state can be acted on.
    ``relaxed``: permutation elements are (differentiable) matrices P, acting as ``new = P old``."""
    check_element(group, element, relaxed)
    if not relaxed and not element.requires_grad and is_identity(element):
        return dict(sd)  # the identity acts as nothing: no copies
    if group.kind == "orthogonal":
        return _act_orthogonal(sd, group, element)
    out = dict(sd)
    gather = _as_permutation(element) if group.kind == "permutation" and relaxed else None
    for m in group.members:
        if m.param not in sd:  # partial states (matching works on the tensors a step needs)
            continue
        t = sd[m.param]
        if gather is not None:  # a straight-through element: its value is a permutation
            out[m.param] = _GatherStraightThrough.apply(t, element, gather, m.axis, m.block * m.repeat)
        elif group.kind == "permutation" and relaxed:
            size = m.block * m.repeat
            P = (
                torch.kron(element, torch.eye(size, dtype=element.dtype, device=element.device))
                if size > 1
                else element
            )
            out[m.param] = apply_along(t, m.axis, P)
        elif group.kind == "permutation":
            out[m.param] = _permute_along(t, m.axis, element, m.block * m.repeat)
        elif group.kind == "scale":
            c = (element if m.fn == "M" else 1 / element).to(t)
            out[m.param] = t * c.reshape([-1] + [1] * (t.dim() - 1 - m.axis))
        else:
            Ms = _matrix(element, m.fn)
            out[m.param] = _gauge_along(t, m.axis, Ms.repeat_interleave(m.repeat, 0) if m.repeat > 1 else Ms, m.block)
    return out


def _act_orthogonal(sd: StateDict, group: Group, element: torch.Tensor) -> StateDict:
    out = dict(sd)
    d_new, d_old = element.shape
    # A width lift rescales RMSNorm's output by sqrt(d_new/d_old); readers absorb the inverse.
    scale = math.sqrt(d_old / d_new)
    for m in group.members:
        if m.param not in sd:
            continue
        t = apply_along(sd[m.param], m.axis, element)
        if d_new != d_old and m.role == "reader":
            t = t * scale
        elif d_new != d_old and m.role == "norm":  # a biased RMSNorm's output grows by 1/scale too
            t = t / scale
        out[m.param] = t
    return out


def apply_to_state(
    sd: StateDict, cfg: TransformerConfig, transform: Transform, relaxed: bool = False
) -> tuple[StateDict, TransformerConfig]:
    """Apply ``transform`` to a state dict of config ``cfg``; returns the new state dict and config
    (``relaxed``: see ``act``)."""
    spec = spec_for(cfg)
    unknown = set(transform.elements) - set(spec.groups)
    if unknown:
        raise ValueError(f"transform names groups this model does not have: {sorted(unknown)}")
    R = transform.get("residual")
    if R is not None and (cfg.norm != "rmsnorm" or cfg.norm_gain):
        raise ValueError("the residual group acts on the canonical (RMSNorm) form: call canonicalize(model) first")
    for name in sorted(transform.elements, key=lambda n: spec.groups[n].rank):
        sd = act(sd, spec.groups[name], transform.elements[name], relaxed)
    if R is not None and R.shape[0] != R.shape[1]:
        d_new, d_old = R.shape
        cfg = cfg.replace(d_model=d_new, norm_eps=cfg.norm_eps * d_old / d_new)
    return sd, cfg


def rebuild(model: nn.Module, sd: StateDict, cfg: Optional[TransformerConfig] = None, own: bool = False) -> nn.Module:
    """A new model of config ``cfg`` (default: the model's) holding ``sd``, on the model's dtype/device.
    ``own``: the tensors of ``sd`` are the caller's to give (fresh, shared with nothing): the model takes
    them as they are instead of a copy (one model's memory less at the peak)."""
    ref = next(model.parameters())
    with torch.device("meta"):  # no random init of weights that are overwritten right away
        new = from_config(cfg or model.config)
    # copy unless owned: the new model must never share storage with the one it came from
    new.load_state_dict(
        {k: v.detach().to(device=ref.device, dtype=ref.dtype, copy=not own) for k, v in sd.items()}, assign=True
    )
    new.train(model.training)
    if hasattr(model, "meta"):
        new.meta = dict(model.meta)
    return new
