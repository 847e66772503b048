"""A certificate that a permutation is still the optimal assignment, without the n × n similarity product.

The FF step of weight matching solves ``max_π Σ_i S[i, π(i)]`` with ``S = F_A F_Bᵀ`` (one row of
features per neuron). Computing S costs n² · f multiply-adds per layer, most of a descent iteration.
When B's neurons, taken in the order of the current permutation π, already lie near A's, π is the
answer, and that can be proved from quantities that cost O(n · f) per reply:

    S[i, π(j)] = ⟨a_i, b_j⟩ = K_ij + ⟨a_i, b_j − a_j⟩ ≤ K_ij + ‖a_i‖ ‖b_j − a_j‖     (Cauchy–Schwarz)

with ``K = F_A F_Aᵀ`` A's own Gram matrix (one product per model A, shared by every reply aligned to
it), ``a_i`` A's rows and ``b_j = F_B[π(j)]``. If every row's own entry ``S[i, π(i)] = ⟨a_i, b_i⟩``
beats the bound on all the others, each row's maximum is its own column, the row maxima are distinct,
and π is the unique optimal assignment: the same permutation the solver would return.

B's features may wait for a residual rotation O that has not been applied yet: rotating each slice
along the residual axis moves it by at most ``‖O − I‖₂`` of its norm (``rotation_size``), which enters
both sides of the test (a lower bound for the own entry, an upper bound for the others). Rows the coarse test cannot
settle are computed exactly (their rows of S only). Nothing is certified within a margin of rounding
of the fast dtype, so the certified permutation is the one the full product would give.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from fedlmc.matching.profile import section

# of a layer's rows, at most this fraction is computed exactly; more, and the full product is cheaper
EXACT_ROWS = 1 / 8
# a residual map further than this from the identity is applied before the test, not bounded
ROTATE_FIRST = 0.1
# rows of the quick look that decides whether the whole test is worth making
SAMPLE = 256


def rows_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the certificate computes in: float64 for float64 features, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# rows of A per block of its Gram matrix (``gram_row_max``)
GRAM_BLOCK = 256


def gram_row_max(FA: torch.Tensor) -> torch.Tensor:
    """An upper bound of ``max_{j ≠ i} ⟨a_i, a_j⟩`` for every row i of ``FA`` (A's Gram matrix off its
    diagonal, rounded up by the output rounding of ``FA``'s dtype). The matrix is symmetric: each block
    of rows is multiplied by the rows from its own on, and gives its rows' and its columns' maxima (half
    the products of the whole matrix)."""
    with section("FF certificate Gram"):
        n = len(FA)
        top = torch.full((n,), float("-inf"), dtype=FA.dtype, device=FA.device)
        for i in range(0, n, GRAM_BLOCK):
            stop = min(n, i + GRAM_BLOCK)
            K = FA[i:stop] @ FA[i:].T
            own = torch.arange(stop - i, device=K.device)
            K[own, own] = float("-inf")
            top[i:stop] = torch.maximum(top[i:stop], K.max(1).values)
            top[i:] = torch.maximum(top[i:], K.max(0).values)
        top = top.to(rows_dtype(FA.dtype))  # a single row's maximum stays -inf (it has no other row)
        return top + 2 * torch.finfo(FA.dtype).eps * top.abs().nan_to_num(posinf=0.0)


def rotation_size(O: torch.Tensor, u: Optional[torch.Tensor] = None) -> tuple[float, float]:
    """How far a square (near-)orthogonal O moves vectors: ``(ε⊥, εᵤ)`` with ``ε⊥`` an upper bound of
    ``‖(O − I)(I − uuᵀ)‖₂`` where that is at most ``ROTATE_FIRST`` (above it, some number above
    ``ROTATE_FIRST``: all the FF step needs to know) and ``εᵤ = ‖(O − I)u‖``, for a unit vector u
    (default: none, ``ε⊥`` bounds ``‖O − I‖₂``). A vector v then moves by at most
    ``ε⊥ ‖v‖ + εᵤ |⟨v, u⟩|``. With u the all-ones direction, which every tensor of a LayerNorm model's
    canonical form leaves null, the sign a residual map gives that direction (arbitrary: matching
    cannot see it) costs nothing.

    Cheap bounds first: the Frobenius norm bounds the spectral norm from above, the largest column
    norm from below. Else the largest eigenvalue of ``Q(2I − O − Oᵀ)Q`` (Q = I − uuᵀ), which is
    ``‖(O − I)Q‖₂²`` for an orthogonal O; the slack covers O's own rounding away from orthogonality."""
    d = O.shape[0]
    eye = torch.eye(d, dtype=torch.float64, device=O.device)
    O64 = O.to(torch.float64)
    D = O64 - eye
    Q = eye if u is None else eye - torch.outer(u.to(D), u.to(D))
    eps_u = 0.0 if u is None else float((D @ u.to(D)).norm())
    DQ = D @ Q
    defect = float((O64.T @ O64 - eye).abs().sum(1).max())  # ‖OᵀO − I‖∞ ≥ its spectral norm
    frob = float(DQ.norm())
    if frob <= ROTATE_FIRST:
        return frob, eps_u
    column = float(DQ.norm(dim=0).max())
    if column > ROTATE_FIRST:
        return column, eps_u
    top = float(torch.linalg.eigvalsh(-(Q @ (D + D.T) @ Q))[-1].clamp_min(0.0))
    return (top + 2 * defect) ** 0.5 + defect, eps_u


def certify(
    FA: torch.Tensor,
    FB: torch.Tensor,
    gram_max: Callable[[], torch.Tensor],
    move: Optional[torch.Tensor] = None,
    rotated: Optional[Callable[[], torch.Tensor]] = None,
) -> bool:
    """Whether the identity is the unique optimal assignment of ``S = FA · FB_rotᵀ`` (so the permutation
    that ordered ``FB``'s rows is the FF step's answer).

    ``FB``: B's features in the order under test, before a rotation that moves row i by at most
    ``move[i]`` (None: ``FB`` is final); ``gram_max``: ``gram_row_max(FA)``, called only when a quick
    look leaves a chance (it is a product per model A; the caller keeps it); ``rotated``: ``FB`` after
    the rotation, called when the bounds would be too loose or for the rows they cannot settle (None:
    ``FB`` itself, so ``move`` must be None).
    """
    with section("FF certificate"):
        dt = rows_dtype(FA.dtype)
        b = FB.to(dt).norm(dim=1)
        move = torch.zeros_like(b) if move is None else move.to(b)
        if rotated is not None and float((move / b.clamp_min(1e-30)).max()) > ROTATE_FIRST:
            FB, rotated = rotated(), None  # the bound would be too loose: rotate first
            move = torch.zeros_like(b)
        unit = 4 * torch.finfo(FA.dtype).eps
        # a quick look at a sample of rows: its reach is a lower bound of the whole one, so if even a
        # zero Gram bound leaves too many of its rows open, so would the full test (not worth A's Gram)
        step = max(1, len(FA) // SAMPLE)
        As, Bs, ms = FA[::step].to(dt), FB[::step].to(dt), move[::step]
        a_s = As.norm(dim=1)
        reach = ((Bs - As).norm(dim=1) + ms).max()
        own = (As * Bs).sum(1) - a_s * ms
        if float((own - a_s * reach <= unit * a_s * (a_s + b.max())).float().mean()) > EXACT_ROWS:
            return False
        A, B = FA.to(dt), FB.to(dt)
        a = A.norm(dim=1)
        own = (A * B).sum(1) - a * move  # ≤ the rotated own entry
        reach = ((B - A).norm(dim=1) + move).max()  # ≥ ‖b_rot_j − a_j‖ for every j
        # rounding: the full product rounds each entry to the fast dtype; certify only beyond twice that
        margin = unit * a * (a + b.max() + move.max())
        open_rows = (own - gram_max() - a * reach <= margin).nonzero().flatten()
        if len(open_rows) == 0:
            return True
        if len(open_rows) > EXACT_ROWS * len(a):
            return False
        Bf = B if rotated is None else rotated().to(dt)
        S = A[open_rows] @ Bf.T
        idx = torch.arange(len(open_rows), device=S.device)
        mine = S[idx, open_rows]
        S[idx, open_rows] = float("-inf")
        other = S.max(1).values
        tol = 4 * torch.finfo(FA.dtype).eps * (mine.abs() + other.abs())
        return bool((mine - other > tol).all())


def circuit_gram(XA: torch.Tensor, YA: torch.Tensor) -> torch.Tensor:
    """``⟨X_Aᵢᵀ Y_Aᵢ, X_Aⱼᵀ Y_Aⱼ⟩`` for all head pairs of one circuit kind (A's side of the heads
    certificate, once per model A), as float64."""
    return (torch.einsum("iak,jbk->ijab", XA, XA) * torch.einsum("iak,jbk->ijab", YA, YA)).sum((-1, -2)).double()


# relative rounding the heads certificate allows its float32 products (their actual error is ~1e-6)
HEADS_SLACK = 1e-5


def certify_heads(circuits: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the identity is the unique optimal head assignment of ``steps.head_distances`` (B's heads
    in the order under test), without its H² circuit products.

    ``circuits``: per circuit kind (QK, OV), ``(XA, YA, XB, YB, K)``: the heads' factors
    ``(H, d_head, ·)`` of A and of B (residual map applied) and ``circuit_gram(XA, YA)``. The step
    maximises ``Σ_c (2⟨C_Aᵢ, C_Bⱼ⟩ − ‖C_Bⱼ‖²) / mean_k ‖C_Ak‖²`` over assignments, and
    ``⟨C_Aᵢ, C_Bⱼ⟩ ≤ K_ij + ‖C_Aᵢ‖ ‖C_Bⱼ − C_Aⱼ‖``: only the H own pairs are computed. Every product
    is allowed a relative error ``HEADS_SLACK`` in the bounds' favour, and nothing is certified within
    1e-4 of the scores' scale, far beyond the step's own rounding.
    """
    with section("heads certificate"):
        own, bound = 0.0, 0.0
        for XA, YA, XB, YB, K in circuits:
            XB, YB = XB.to(XA.dtype), YB.to(XA.dtype)
            inner = ((XA @ XB.transpose(1, 2)) * (YA @ YB.transpose(1, 2))).sum((-1, -2)).double()
            nB = ((XB @ XB.transpose(1, 2)) * (YB @ YB.transpose(1, 2))).sum((-1, -2)).double()
            nA = K.diagonal().clamp_min(0.0)
            scale = nA.mean().clamp_min(1e-300)
            # ‖C_Bⱼ − C_Aⱼ‖ and ⟨C_Aᵢ, C_Aⱼ⟩, rounded up
            apart = ((nA + nB - 2 * inner).clamp_min(0.0) + 4 * HEADS_SLACK * (nA + nB)).sqrt()
            gram = K + HEADS_SLACK * (nA[:, None] * nA[None, :]).sqrt()
            own = own + (2 * inner - nB) / scale
            bound = bound + (2 * (gram + nA.sqrt()[:, None] * apart[None, :]) - nB[None, :]) / scale
        bound = bound.clone()
        bound.fill_diagonal_(float("-inf"))
        other = bound.max(1).values
        return bool((own - other > 1e-4 * (own.abs() + other.abs() + 1.0)).all())
