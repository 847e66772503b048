"""The intra-head QK gauge of a rotary (RoPE) attention layer.

RoPE rotates each frequency pair of a query/key head — dimensions ``(i, i + d_head/2)`` in the
``rotate_half`` convention of Llama and Hugging Face — by an angle proportional to the position:
``q_p = R_p q``, ``k_s = R_s k``, so ``q_pᵀ k_s = qᵀ R_{s-p} k``. A gauge ``q → Aᵀq, k → A⁻¹k`` keeps
every score iff ``A R_t A⁻¹ = R_t`` for every rotation the layer applies. With distinct frequencies
that is the commutant of the 2×2 rotations: ``A`` acts on each frequency pair as a *scaled rotation*
``[[a, -b], [b, a]]`` (a nonzero complex number) and mixes no pairs. A general invertible map does not
commute (tested), and the OV gauge is untouched by RoPE (values are not rotated).

Partial rotary (GPT-NeoX, Pythia: only the first ``rotary`` dimensions of a head are rotated, paired
``(i, i + rotary/2)``) keeps a block-diagonal gauge: scaled rotations on the rotary block, any invertible
map on the pass-through block, nothing mixing the two.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def _pairs(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if size % 2:
        raise ValueError(f"a rotary head has an even width, got {size}")
    i = torch.arange(size // 2)
    return i, i + size // 2


def rope_gauge(angle: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Gauge matrices ``(count, size, size)`` from per-pair angles and scales ``(count, size/2)``."""
    count, half = angle.shape
    i, j = _pairs(2 * half)
    G = torch.zeros(count, 2 * half, 2 * half, dtype=angle.dtype, device=angle.device)
    c, s = scale * torch.cos(angle), scale * torch.sin(angle)
    G[:, i, i], G[:, j, j], G[:, i, j], G[:, j, i] = c, c, -s, s
    return G


def random_rope_gauge(
    count: int, size: int, generator: torch.Generator, dtype=torch.float64, spread: float = 0.5
) -> torch.Tensor:
    """Random scaled rotations per frequency pair (scales in ``exp([-spread, spread])``)."""
    angle = torch.rand(count, size // 2, generator=generator, dtype=dtype) * 2 * math.pi
    scale = torch.exp((torch.rand(count, size // 2, generator=generator, dtype=dtype) * 2 - 1) * spread)
    return rope_gauge(angle, scale)


def with_pass(rot: torch.Tensor, passing: torch.Tensor) -> torch.Tensor:
    """The block-diagonal gauge of a partially rotary head: ``rot`` on the first dimensions, ``passing``
    on the rest (both batched over heads)."""
    r, p = rot.shape[-1], passing.shape[-1]
    G = rot.new_zeros(rot.shape[0], r + p, r + p)
    G[:, :r, :r], G[:, r:, r:] = rot, passing
    return G


def rope_fit(
    XA: torch.Tensor, XB: torch.Tensor, YA: torch.Tensor, YB: torch.Tensor, scaled: bool = False
) -> torch.Tensor:
    """The RoPE gauge ``G`` (batched over heads) minimising ``‖G X_B − X_A‖² + ‖Gᵀ Y_A − Y_B‖²`` (the
    direct side maps by G, the inverse side by G⁻ᵀ; factors are ``(count, d_head, ·)``). The problem
    separates over frequency pairs and, in each, is linear in ``(a, b)`` of ``[[a, -b], [b, a]]`` with
    orthogonal regressors, so the least-squares solution is closed form. ``scaled=False`` keeps the
    rotation only (for an orthogonal G the two sides' objectives agree, and that angle is optimal)."""
    i, j = _pairs(XA.shape[-2])

    def dot(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (u * v).sum(-1)

    xi, xj, ti, tj = XB[:, i], XB[:, j], XA[:, i], XA[:, j]
    yi, yj, si, sj = YA[:, i], YA[:, j], YB[:, i], YB[:, j]
    a = dot(xi, ti) + dot(xj, tj) + dot(yi, si) + dot(yj, sj)
    b = dot(xi, tj) - dot(xj, ti) + dot(yj, si) - dot(yi, sj)
    norm = dot(xi, xi) + dot(xj, xj) + dot(yi, yi) + dot(yj, yj)
    angle = torch.atan2(b, a)
    scale = torch.hypot(a, b) / norm.clamp_min(1e-30) if scaled else torch.ones_like(angle)
    return rope_gauge(angle, scale)


def rope_structured(G: torch.Tensor, tol: float = 1e-6, rotary: Optional[int] = None) -> bool:
    """Whether every matrix of ``G`` is a scaled rotation on each frequency pair of its first ``rotary``
    dimensions (default: all) and mixes them with no other dimension."""
    r = rotary or G.shape[-1]
    i, j = _pairs(r)
    a, b = G[:, i, i], G[:, j, i]
    rebuilt = G.clone()
    rebuilt[:, :r, :r] = rope_gauge(torch.atan2(b, a), torch.hypot(a, b))
    rebuilt[:, :r, r:], rebuilt[:, r:, :r] = 0, 0
    return bool((rebuilt - G).abs().max() <= tol * G.abs().max().clamp_min(1.0))
