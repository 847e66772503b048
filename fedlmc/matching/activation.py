"""Activation matching (the baseline of Verma & Elbayad 2024) and residual-activation statistics.

Units are matched by the correlation of what they compute on a data batch: the residual map from
residual-stream states (after the embeddings and after every block), heads from their contributions
to the residual stream, FF neurons from their post-GELU activations. Probe points come from the spec.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Optional

import torch
import torch.nn as nn

from fedlmc.matching.problem import canonical_state
from fedlmc.matching.solvers import assignment, grouped_assignment
from fedlmc.matching.steps import apply_elements, gauge_step, residual_element
from fedlmc.matching.weight import identity_elements
from fedlmc.symmetry import Transform, canonical, canonical_config, spec_for


@contextmanager
def _hooks(model: nn.Module, spec) -> Iterable[dict]:
    store: dict[str, list[torch.Tensor]] = {}
    handles = []
    mods = dict(model.named_modules())

    def keep(name, t):
        store.setdefault(name, []).append(t.detach().reshape(-1, t.shape[-1]))

    first = spec.residual_probes[0] if spec.residual_probes else None
    for p in spec.residual_probes:
        handles.append(mods[p].register_forward_hook(lambda m, i, o, p=p: keep(p, o)))
    if first is not None:  # the stream before the first block: embeddings (+ positions, CLS)
        handles.append(mods[first].register_forward_pre_hook(lambda m, i: keep("input", i[0])))
    for g in spec.groups.values():
        if g.probe:  # the group's units are the probe module's input
            handles.append(mods[g.probe].register_forward_pre_hook(lambda m, i, n=g.name: keep(n, i[0])))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def activations(model: nn.Module, batches, device=None) -> dict[str, torch.Tensor]:
    """Probe activations of the canonical model on ``batches`` (an iterable of (x, y)), rows = tokens."""
    c = canonical(model)
    c.eval()
    dev = device or next(c.parameters()).device
    spec = spec_for(c)
    with _hooks(c, spec) as store:
        for x, _ in batches:
            x = x.to(dev)
            c(x.to(next(c.parameters()).dtype) if x.is_floating_point() else x)
    return {k: torch.cat(v).double() for k, v in store.items()}


def _batches(data, n_batches: int, batch_size: int):
    out = []
    for i, b in enumerate(data.batches(batch_size)):
        if i >= n_batches:
            break
        out.append(b)
    if not out:
        raise ValueError("no data batches to compute activations on")
    return out


def _residual_cross(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], probes) -> torch.Tensor:
    """``Σ X_Aᵀ X_B / N`` over the residual-stream states among ``a``'s keys (input and ``probes``)."""
    return sum(a[k].T @ b[k] / len(a[k]) for k in a if k == "input" or k in probes)


def residual_states(model: nn.Module, data, n_batches: int = 4, batch_size: int = 64) -> dict[str, torch.Tensor]:
    """The model's residual-stream states (its input and every residual probe) on the first batches."""
    acts = activations(model, _batches(data, n_batches, batch_size))
    return {k: v for k, v in acts.items() if k == "input" or k in spec_for(model).residual_probes}


def residual_activation_cross(
    model_a: nn.Module,
    model_b: nn.Module,
    data,
    n_batches: int = 4,
    batch_size: int = 64,
    states_a: Optional[dict[str, torch.Tensor]] = None,
) -> torch.Tensor:
    """``Σ_probes X_Aᵀ X_B / N`` over residual states: the data term of the residual Procrustes.
    ``states_a``: A's ``residual_states`` on the same batches, when already known (a universe
    compares every model with one A)."""
    a = states_a if states_a is not None else residual_states(model_a, data, n_batches, batch_size)
    b = residual_states(model_b, data, n_batches, batch_size)
    return _residual_cross(a, b, spec_for(model_b).residual_probes)


def activation_matching(
    model_a: nn.Module,
    model_b: nn.Module,
    data,
    n_batches: int = 4,
    batch_size: int = 64,
    residual: str = "orthogonal",
    keep_layernorm: bool = False,
    gauge: Optional[str] = "orthogonal",
) -> Transform:
    """Align B to A from activation correlations on a few batches of ``data``; gauges (for the factored
    merge) then come from the weights, as in weight matching."""
    batches = _batches(data, n_batches, batch_size)
    a, b = activations(model_a, batches), activations(model_b, batches)
    cfg = canonical_config(model_b.config)
    spec = spec_for(cfg)
    M = _residual_cross(a, b, spec.residual_probes)
    O = residual_element(M, residual, keep_layernorm)
    el = identity_elements(cfg, M.device, M.dtype)
    el["residual"] = O
    B = canonical_state(model_b, M.device, M.dtype)
    A = canonical_state(model_a, M.device, M.dtype)
    for g in spec.layer_groups("heads"):
        # each (query) head's contribution to the residual stream, B's mapped into A's frame by O
        within = spec.within_of(g.name)
        H, dh = (within or g).size, g.members[0].block
        out = next(m.param for m in g.members if m.role == "out")  # the out projection (d, H·dh)
        Wo_a, Wo_b = A[out], B[out]
        ya, yb = a[g.name].reshape(-1, H, dh), b[g.name].reshape(-1, H, dh)
        ca = torch.einsum("nhk,dhk->hnd", ya, Wo_a.reshape(-1, H, dh))
        cb = torch.einsum("nhk,dhk->hnd", yb, (O @ Wo_b).reshape(-1, H, dh))
        ca, cb = ca / ca.norm(dim=(1, 2), keepdim=True), cb / cb.norm(dim=(1, 2), keepdim=True)
        score = torch.einsum("ind,jnd->ij", ca, cb)
        if within is not None:  # KV heads by their best matching of query heads
            el[g.name], el[within.name] = grouped_assignment(score, H // g.size)
        else:
            el[g.name] = assignment(score)
    for g in spec.layer_groups("ff"):
        ha, hb = a[g.name], b[g.name]
        ha = (ha - ha.mean(0)) / ha.std(0).clamp_min(1e-8)
        hb = (hb - hb.mean(0)) / hb.std(0).clamp_min(1e-8)
        el[g.name] = assignment(ha.T @ hb / len(ha))
    if gauge:
        B_heads = apply_elements(B, cfg, el, ("residual", "heads", "qheads"))
        el.update(gauge_step(A, B_heads, spec, gauge))
    return Transform({k: v.cpu() for k, v in el.items()}, {"method": "activation", "tokens": len(a["input"])})
