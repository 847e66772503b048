"""Random group elements (Haar orthogonal maps, permutations, invertible gauges) and inverses."""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.nn as nn

from fedlmc.models.layers import TransformerConfig
from fedlmc.symmetry.canonical import apply_transform
from fedlmc.symmetry.rope import random_rope_gauge, with_pass
from fedlmc.symmetry.spec import SymmetrySpec, spec_for
from fedlmc.symmetry.transform import Transform, perm_matrix


def random_orthogonal(
    d_new: int, d: int, generator: torch.Generator, dtype=torch.float64, fix_ones: bool = False
) -> torch.Tensor:
    """A Haar-random ``d_new x d`` matrix with orthonormal columns. ``fix_ones`` requires d_new == d and O·1 = 1."""
    if fix_ones:
        if d_new != d:
            raise ValueError("fix_ones needs a square residual map")
        Q = ones_basis(d, dtype)
        R = random_orthogonal(d - 1, d - 1, generator, dtype)
        return Q @ torch.block_diag(torch.ones(1, 1, dtype=dtype), R) @ Q.T
    A = torch.randn(d_new, d, generator=generator, dtype=dtype)
    Q, r = torch.linalg.qr(A)
    return Q * torch.sign(torch.diagonal(r))  # sign fix makes the distribution Haar


def ones_basis(d: int, dtype=torch.float64) -> torch.Tensor:
    """An orthogonal matrix whose first column is 1/sqrt(d) (the rest span the centred subspace)."""
    A = torch.eye(d, dtype=dtype)
    A[:, 0] = 1.0
    Q, _ = torch.linalg.qr(A)
    return Q * torch.sign(Q[0, 0])


def random_invertible(
    count: int, k: int, generator: torch.Generator, dtype=torch.float64, spread: float = 0.5
) -> torch.Tensor:
    """``count`` well-conditioned random ``k x k`` matrices (singular values in ``exp([-spread, spread])``)."""
    U = torch.linalg.qr(torch.randn(count, k, k, generator=generator, dtype=dtype))[0]
    V = torch.linalg.qr(torch.randn(count, k, k, generator=generator, dtype=dtype))[0]
    s = torch.exp((torch.rand(count, k, generator=generator, dtype=dtype) * 2 - 1) * spread)
    return U @ torch.diag_embed(s) @ V


def random_scale(
    size: int, generator: torch.Generator, dtype=torch.float64, signed: bool = False, spread: float = 0.5
) -> torch.Tensor:
    """``size`` factors in ``exp([-spread, spread])``, each with a random sign when ``signed``."""
    c = torch.exp((torch.rand(size, generator=generator, dtype=dtype) * 2 - 1) * spread)
    if signed:
        c = c * (torch.randint(0, 2, (size,), generator=generator) * 2 - 1).to(dtype)
    return c


def random_transform(
    model: Union[nn.Module, TransformerConfig],
    seed: int = 0,
    groups: Iterable[str] = ("residual", "heads", "qheads", "qk", "ov", "ff"),
    width: Optional[int] = None,
    fix_ones: bool = False,
    residual: str = "orthogonal",
    dtype: torch.dtype = torch.float64,
) -> Transform:
    """Draw a random element of the model's symmetry group.

    ``groups`` picks which kinds to draw (the rest stay identity); ``width`` > d draws a rectangular
    residual lift; ``fix_ones`` restricts O to O·1 = 1 (keeps a centred residual centred, so the model
    can go back to LayerNorm); ``residual="permutation"`` draws a residual permutation instead.
    """
    spec = spec_for(model)
    g = torch.Generator().manual_seed(seed)
    kinds = set(groups)
    out: dict[str, torch.Tensor] = {}
    for name, grp in spec.groups.items():
        kind = name.split(".")[0]
        if kind not in kinds:
            continue
        if grp.kind == "orthogonal":
            if residual == "permutation":
                out[name] = perm_matrix(torch.randperm(grp.size, generator=g), dtype)
            else:
                out[name] = random_orthogonal(width or grp.size, grp.size, g, dtype, fix_ones)
        elif grp.kind == "permutation" and grp.structure == "within":
            block = grp.size // grp.count
            out[name] = torch.cat([torch.randperm(block, generator=g) + i * block for i in range(grp.count)])
        elif grp.kind == "permutation":
            out[name] = torch.randperm(grp.size, generator=g)
        elif grp.kind == "scale":
            out[name] = random_scale(grp.size, g, dtype, signed=grp.structure == "signed")
        elif grp.structure == "rope":
            r = grp.rotary or grp.size
            out[name] = random_rope_gauge(grp.count, r, g, dtype)
            if r < grp.size:  # partial rotary: any invertible map on the pass-through dimensions
                out[name] = with_pass(out[name], random_invertible(grp.count, grp.size - r, g, dtype))
        else:
            out[name] = random_invertible(grp.count, grp.size, g, dtype)
    return Transform(out)


def invert_transform(transform: Transform, spec: SymmetrySpec) -> Transform:
    """The inverse element: ``apply_transform(apply_transform(m, T), invert_transform(T, spec_for(m)))`` computes m's
    function in m's coordinates. A semi-orthogonal residual ``O`` (``d' x d``) inverts to ``Oᵀ`` (the
    projection back to width d, exact on lifted models). Gauges act after their layer's head
    permutation, so the inverse gauges are re-indexed by the inverse permutation."""
    out: dict[str, torch.Tensor] = {}
    for name, el in transform.elements.items():
        group = spec.groups[name]
        if group.kind == "orthogonal":
            out[name] = el.transpose(0, 1)
        elif group.structure == "within":
            out[name] = _invert_within(el, transform.elements.get(group.heads), group)
        elif group.kind == "permutation":
            out[name] = torch.argsort(el)
        elif group.kind == "scale":  # x_new[i] = c[i] x_old[π[i]]  ⇒  x_old[j] = x_new[σ[j]] / c[σ[j]]
            perm = transform.elements.get(group.heads)
            out[name] = 1 / (el[torch.argsort(perm)] if perm is not None else el)
        else:  # gauge: x_new[i] = G[i] x_old[π[i]]  ⇒  x_old[j] = G[σ[j]]⁻¹ x_new[σ[j]], σ = π⁻¹
            perm = transform.elements.get(group.heads)
            sigma = torch.argsort(perm) if perm is not None else torch.arange(el.shape[0])
            out[name] = torch.linalg.inv(el[sigma])
    return Transform(out)


def _invert_within(tau: torch.Tensor, sigma: Optional[torch.Tensor], group) -> torch.Tensor:
    """The inverse of a "within" permutation ``tau`` that acts after its heads group's ``sigma``.

    The two do not commute: with ``s`` the unit map of ``sigma`` (unit i of block b comes from unit
    i of block ``sigma[b]``), the forward map is ``s[tau]``; the inverse acts as ``argsort(sigma)``
    followed by ``s[argsort(s[tau])]``, which again keeps every unit in its block."""
    block = group.size // group.count
    idx = torch.arange(group.size, device=tau.device)
    s = idx if sigma is None else sigma.to(tau.device)[idx // block] * block + idx % block
    return s[torch.argsort(s[tau])]


def planted_copies(
    base: nn.Module, n: int, noise: float = 0.05, groups: Iterable[str] = ("residual", "heads", "ff"), seed: int = 10
) -> list[nn.Module]:
    """``n`` copies of the canonical model ``base``, copy ``s`` moved by ``random_transform(seed=seed + s)``
    over ``groups`` and then perturbed by Gaussian noise at ``noise`` times each tensor's standard
    deviation (generator seeded ``s``): replies whose alignment is known up to the noise."""
    out = []
    for s in range(n):
        c = apply_transform(base, random_transform(base, seed=seed + s, groups=groups))
        g = torch.Generator().manual_seed(s)
        with torch.no_grad():
            for p in c.parameters():
                p.add_(noise * p.std() * torch.randn(p.shape, generator=g, dtype=p.dtype))
        out.append(c)
    return out
