"""The FF scale step of weight matching: the semi-permutation level's diagonal part, in closed form.

Where an FF nonlinearity is homogeneous (ReLU: ``c > 0``; SwiGLU's ``up``: any ``c ≠ 0``), neuron i of
the aligned model B can be rescaled, its in-weights by ``c`` and its out-weights by ``1/c``
(``ffscale.{l}`` groups of the spec). With the permutations and the residual map held, each neuron's
part of weight matching's objective is

    f(c) = Σ_in wₖ ‖aₖ − c·bₖ‖² + Σ_out wₖ ‖aₖ − bₖ/c‖²  =  const − 2pc + qc² − 2r/c + s/c²

(``p``, ``q``: the in-tensors' weighted ⟨a, b⟩ and ‖b‖²; ``r``, ``s``: the out-tensors'), whose
stationary points are the real roots of ``q c⁴ − p c³ + r c − s``. The step takes the root of lowest
``f`` (``c = 1`` among the candidates, so it never does worse than no scaling), per neuron, for every
layer at once (the roots as the eigenvalues of a batch of 4 × 4 companion matrices).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedlmc.symmetry import StateDict
from fedlmc.symmetry.spec import SymmetrySpec


def _unit_rows(t: torch.Tensor, axis: int) -> torch.Tensor:
    """``t`` as (vectors, units): one column per unit along ``axis``."""
    return t.movedim(axis, -1).reshape(-1, t.shape[axis])


def scale_objective(A: StateDict, B: StateDict, spec: SymmetrySpec, weights: Mapping[str, float], name: str):
    """``(p, q, r, s)`` of scale group ``name``, per unit, from A and the aligned B."""
    g = spec.groups[name]
    p = torch.zeros(g.size, dtype=torch.float64, device=next(iter(A.values())).device)
    q, r, s = p.clone(), p.clone(), p.clone()
    for m in g.members:
        a, b = _unit_rows(A[m.param], m.axis).double(), _unit_rows(B[m.param], m.axis).double()
        w = float(weights.get(m.param, 1.0))
        if m.fn == "M":
            p, q = p + w * (a * b).sum(0), q + w * (b * b).sum(0)
        else:
            r, s = r + w * (a * b).sum(0), s + w * (b * b).sum(0)
    return p, q, r, s


def best_scales(p: torch.Tensor, q: torch.Tensor, r: torch.Tensor, s: torch.Tensor, signed: bool) -> torch.Tensor:
    """Per unit, the ``c`` (positive unless ``signed``) of lowest ``−2pc + qc² − 2r/c + s/c²``."""
    n = len(p)
    ok = q > 1e-300
    qq = torch.where(ok, q, torch.ones_like(q))
    C = torch.zeros(n, 4, 4, dtype=torch.float64, device=p.device)  # monic c⁴ − (p/q)c³ + (r/q)c − s/q
    C[:, 0, 0], C[:, 0, 2], C[:, 0, 3] = p / qq, -r / qq, s / qq
    C[:, 1, 0] = C[:, 2, 1] = C[:, 3, 2] = 1.0
    roots = torch.linalg.eigvals(C)
    real = roots.real
    usable = (roots.imag.abs() <= 1e-9 * roots.abs().clamp_min(1e-30)) & (real.abs() > 1e-12)
    if not signed:
        usable &= real > 0
    cands = torch.cat([torch.ones(n, 1, dtype=torch.float64, device=p.device), real], 1)
    usable = torch.cat([torch.ones(n, 1, dtype=torch.bool, device=p.device), usable & ok[:, None]], 1)
    safe = torch.where(usable, cands, torch.ones_like(cands))
    f = -2 * p[:, None] * safe + q[:, None] * safe**2 - 2 * r[:, None] / safe + s[:, None] / safe**2
    f = torch.where(usable, f, torch.full_like(f, float("inf")))
    return safe.gather(1, f.argmin(1, keepdim=True)).squeeze(1)


def ff_scales(A: StateDict, B: StateDict, spec: SymmetrySpec, weights: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """Every scale group's closed-form element for the aligned ``B`` against ``A`` (weights per tensor,
    as weight matching's objective weighs them)."""
    out = {}
    for name, g in spec.groups.items():
        if g.kind == "scale":
            c = best_scales(*scale_objective(A, B, spec, weights, name), signed=g.structure == "signed")
            out[name] = c.to(next(iter(A.values())).dtype)
    return out


def weighted_distance(A: StateDict, B: StateDict, weights: Mapping[str, float]) -> float:
    """``Σₖ wₖ ‖Aₖ − Bₖ‖²`` over the weighted tensors."""
    return sum(float(w) * float(((A[k] - B[k]).double() ** 2).sum()) for k, w in weights.items())


def balancing_scales(state: StateDict, spec: SymmetrySpec) -> dict[str, torch.Tensor]:
    """The scale elements that put every FF neuron of ``state`` in one gauge: its in-weights and
    out-weights of equal norm, and for signed groups (SwiGLU) the sign that makes its ``up`` row point
    along its ``gate`` row (``⟨up, gate⟩ ≥ 0``). Two models in this gauge differ by no scale that
    their permutations do not see: the assignment then compares like with like."""
    out = {}
    for name, g in spec.groups.items():
        if g.kind != "scale":
            continue
        ins = sum((_unit_rows(state[m.param], m.axis).double() ** 2).sum(0) for m in g.members if m.fn == "M")
        outs = sum((_unit_rows(state[m.param], m.axis).double() ** 2).sum(0) for m in g.members if m.fn != "M")
        c = (outs.clamp_min(1e-300) / ins.clamp_min(1e-300)) ** 0.25
        if g.structure == "signed":
            own = {m.param for m in g.members}
            ref = [m for m in spec.groups[g.heads].members if m.param not in own and m.axis == 0]
            ups = [m for m in g.members if m.fn == "M"]
            dot = sum(
                (_unit_rows(state[u.param], 0).double() * _unit_rows(state[r.param], 0).double()).sum(0)
                for u, r in zip(ups, ref)
            )
            c = c * torch.where(dot < 0, -1.0, 1.0).to(c)
        out[name] = c.to(next(iter(state.values())).dtype)
    return out
