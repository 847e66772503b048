"""The FF certificate: when it says the current permutation is the optimal assignment, the full
product's solver says so too; it says so in the common round (replies near the universe) and for a
recovered planted model; and weight matching with it returns exactly what it returns without it."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

import fedlmc.matching.problem as problem
from fedlmc.matching import weight_matching
from fedlmc.matching.certify import ROTATE_FIRST, certify, certify_heads, circuit_gram, gram_row_max, rotation_size
from fedlmc.matching.steps import circuit_distance, circuit_norm
from fedlmc.models import from_preset
from fedlmc.options import Matching
from fedlmc.symmetry import apply_transform, canonicalize, random_transform


def _optimal(S: torch.Tensor) -> torch.Tensor:
    rows, cols = linear_sum_assignment(S.double().numpy(), maximize=True)
    perm = torch.empty(len(rows), dtype=torch.long)
    perm[torch.as_tensor(rows)] = torch.as_tensor(cols)
    return perm


def _rotation(d: int, angle: float, g: torch.Generator) -> torch.Tensor:
    """An orthogonal d × d matrix ``exp(angle · K)`` for a random skew K of unit spectral norm."""
    X = torch.randn(d, d, generator=g, dtype=torch.float64)
    K = X - X.T
    return torch.linalg.matrix_exp(angle * K / torch.linalg.matrix_norm(K, 2))


def _features(W1: torch.Tensor, b1: torch.Tensor, W2: torch.Tensor) -> torch.Tensor:
    """FF features as ``steps.unit_features`` builds them: fc1 row, fc1 bias, fc2 column."""
    return torch.cat([W1, b1[:, None], W2.T], dim=1)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(8, 96),
    noise=st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.5, 1.0, 3.0]),
    angle=st.sampled_from([0.0, 0.01, 0.05, ROTATE_FIRST / 2, 0.5]),
    correlated=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
)
def test_what_the_certificate_certifies_is_the_optimal_assignment(seed, n, noise, angle, correlated, dtype):
    """B's neurons (in the order under test) are A's moved by ``noise`` and a residual rotation of size
    ``angle`` not yet applied; whenever the certificate says yes, the dense solver on the rotated
    features' exact similarity returns the identity, and the row maxima are the diagonal."""
    g = torch.Generator().manual_seed(seed)
    d = 12
    W1 = torch.randn(n, d, generator=g, dtype=torch.float64)
    if correlated:  # neurons that nearly repeat each other: a large Gram bound, open rows
        W1[1::2] = W1[::2][: len(W1[1::2])] + 0.3 * torch.randn(len(W1[1::2]), d, generator=g, dtype=torch.float64)
    b1 = torch.randn(n, generator=g, dtype=torch.float64)
    W2 = torch.randn(d, n, generator=g, dtype=torch.float64)
    O = _rotation(d, angle, g)

    def moved(x):
        return x + noise * torch.randn(x.shape, generator=g, dtype=torch.float64) * x.std()

    V1, c1, V2 = moved(W1), moved(b1), moved(W2)
    FA = _features(W1, b1, W2).to(dtype)
    FB = _features(V1, c1, V2).to(dtype)
    FB_rot = _features(V1 @ O.T, c1, O @ V2).to(dtype)  # the residual map on fc1's input and fc2's output
    eps, _ = rotation_size(O)
    assert (
        eps >= float(torch.linalg.matrix_norm(O - torch.eye(d, dtype=torch.float64), 2)) - 1e-12 or eps > ROTATE_FIRST
    )
    ok = certify(FA, FB, lambda: gram_row_max(FA), eps * FB.double().norm(dim=1), lambda: FB_rot)
    if ok:
        S = FA.double() @ FB_rot.double().T
        assert torch.equal(_optimal(S), torch.arange(n))
        assert torch.equal(S.argmax(1), torch.arange(n))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_certificate_holds_for_near_copies_and_fails_for_strangers(dtype):
    """It is not an answer that is always no: a 2 % move of 512 random neurons is certified (with and
    without a small pending rotation), a stranger or a wrong order is not."""
    g = torch.Generator().manual_seed(0)
    n, d = 512, 64
    W1, b1, W2 = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((n, d), (n,), (d, n)))
    FA = _features(W1, b1, W2).to(dtype)
    near = FA.double() + 0.02 * torch.randn(FA.shape, generator=g, dtype=torch.float64)
    O = _rotation(d, 0.02, g)
    near_rot = _features(near[:, :d] @ O.T, near[:, d], O @ near[:, d + 1 :].T).to(dtype)
    gram = lambda: gram_row_max(FA)  # noqa: E731
    assert certify(FA, near.to(dtype), gram)
    move = rotation_size(O)[0] * near.norm(dim=1)
    assert certify(FA, near.to(dtype), gram, move, lambda: near_rot)
    stranger = torch.randn(FA.shape, generator=g, dtype=torch.float64).to(dtype)
    assert not certify(FA, stranger, gram)
    shuffled = near[torch.randperm(n, generator=g)].to(dtype)
    assert not certify(FA, shuffled, gram)


def test_rows_the_bound_leaves_open_are_settled_by_their_exact_rows():
    """16 of 256 neurons in near-duplicate pairs (cosine 0.995): A's Gram bound cannot separate them,
    their exact rows can (the rest are settled by the bound, so only those rows are computed); the
    answer is the solver's."""
    g = torch.Generator().manual_seed(0)
    n, f = 256, 40
    W = torch.randn(n, f, generator=g, dtype=torch.float64)
    W = W / W.norm(dim=1, keepdim=True)
    W[1:17:2] = W[0:16:2] + 0.1 * torch.randn(8, f, generator=g, dtype=torch.float64) / f**0.5
    W = W / W.norm(dim=1, keepdim=True)
    B = W + 0.0005 * torch.randn(n, f, generator=g, dtype=torch.float64)
    asked = []
    assert certify(W, B, lambda: gram_row_max(W), None, lambda: asked.append(1) or B)
    assert asked == [1] and torch.equal(_optimal(W @ B.T), torch.arange(n))
    swapped = B.clone()
    swapped[[0, 1]] = B[[1, 0]]  # the near-duplicates' order is wrong: only their exact rows can tell
    assert not certify(W, swapped, lambda: gram_row_max(W), None, lambda: swapped)


@pytest.mark.parametrize("n", [1, 2, 255, 256, 257, 700])
def test_gram_row_max_from_the_upper_triangle_equals_the_whole_products(n):
    """The Gram matrix's off-diagonal row maxima from blocks of its upper triangle are the whole
    product's, whichever block a row's maximum lies in (above, below or beside the diagonal), with
    duplicated rows and a row whose every inner product is negative."""
    g = torch.Generator().manual_seed(n)
    FA = torch.randn(n, 24, generator=g, dtype=torch.float64)
    if n > 3:
        FA[:, 0] = FA[:, 0].abs() + 1.0
        FA[0] *= 10.0
        FA[n - 1] = FA[0]  # a row's maximum in the last block's columns, the other's in the first
        FA[n // 2] = 0.0
        FA[n // 2, 0] = -1.0  # every inner product of this row is negative
    K = FA @ FA.T
    K.fill_diagonal_(float("-inf"))
    whole = K.max(1).values
    got = gram_row_max(FA)
    assert got.shape == (n,)
    if n == 1:
        assert torch.isinf(got).all() and (got < 0).all()
        return
    assert torch.allclose(got, whole + 2 * torch.finfo(torch.float64).eps * whole.abs(), rtol=1e-12, atol=1e-12)
    if n > 3:
        assert whole[n // 2] < 0 and torch.allclose(whole[[0, n - 1]], (FA[0] @ FA[0]).expand(2), rtol=1e-12)


def test_rotation_size_bounds_how_far_vectors_move():
    """``ε⊥ ‖v‖ + εᵤ |⟨v, u⟩|`` bounds ``‖(O − I)v‖`` (ε⊥ is exact enough below ``ROTATE_FIRST`` and
    above it otherwise), also when O flips the direction u that every tensor leaves null."""
    g = torch.Generator().manual_seed(1)
    d = 64
    u = torch.full((d,), d**-0.5, dtype=torch.float64)
    Q = torch.eye(d, dtype=torch.float64) - torch.outer(u, u)
    flip = torch.eye(d, dtype=torch.float64) - 2 * torch.outer(u, u)  # a reflection of u alone
    for angle in (0.0, 1e-3, 0.03, 0.09, 0.3, 1.0, 3.0):
        R = Q @ _rotation(d, angle, g) @ Q + torch.outer(u, u)  # rotates 1⊥, keeps u
        for O in (R, R @ flip):
            eps, eps_u = rotation_size(O.float(), u)
            true = float(torch.linalg.matrix_norm((O - torch.eye(d, dtype=torch.float64)) @ Q, 2))
            assert (eps >= true - 1e-6) if true <= ROTATE_FIRST else eps > ROTATE_FIRST
            if eps <= ROTATE_FIRST:
                v = torch.randn(200, d, generator=g, dtype=torch.float64)
                moved = (v @ (O - torch.eye(d, dtype=torch.float64)).T).norm(dim=1)
                assert bool((moved <= eps * v.norm(dim=1) + eps_u * (v @ u).abs() + 1e-5).all())
        assert rotation_size(R @ flip, u)[1] == pytest.approx(2.0)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    heads=st.integers(2, 12),
    noise=st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.5, 2.0]),
    similar=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32]),
)
def test_what_the_heads_certificate_certifies_is_the_optimal_head_assignment(seed, heads, noise, similar, dtype):
    """Heads' QK and OV factors of A, and B's as A's moved by ``noise`` (``similar``: heads that nearly
    repeat each other); whenever ``certify_heads`` says yes, the dense solver on the exact circuit
    distances (``steps.circuit_distance``, float64) returns the identity."""
    g = torch.Generator().manual_seed(seed)
    dh, k = 4, 9

    def factors():
        X = torch.randn(heads, dh, k, generator=g, dtype=torch.float64)
        if similar:
            X[1:] = X[:1] + 0.2 * torch.randn(heads - 1, dh, k, generator=g, dtype=torch.float64)
        return X

    A = [factors() for _ in range(4)]  # X, Y of the QK circuit, then of the OV circuit
    B = [x + noise * torch.randn(x.shape, generator=g, dtype=torch.float64) * x.std() for x in A]
    circuits = [
        (
            A[i].to(dtype),
            A[i + 1].to(dtype),
            B[i].to(dtype),
            B[i + 1].to(dtype),
            circuit_gram(A[i].to(dtype), A[i + 1].to(dtype)),
        )
        for i in (0, 2)
    ]
    if certify_heads(circuits):
        D = sum(
            circuit_distance(A[i], A[i + 1], B[i], B[i + 1], circuit_norm(A[i], A[i + 1]), circuit_norm(B[i], B[i + 1]))
            for i in (0, 2)
        )
        assert torch.equal(_optimal(-D), torch.arange(heads))


def test_the_heads_certificate_holds_for_near_copies_and_fails_for_a_wrong_order():
    g = torch.Generator().manual_seed(3)
    A = [torch.randn(12, 16, 65, generator=g) for _ in range(4)]
    near = [x + 0.02 * x.std() * torch.randn(x.shape, generator=g) for x in A]
    grams = [circuit_gram(A[i], A[i + 1]) for i in (0, 2)]
    assert certify_heads([(A[i], A[i + 1], near[i], near[i + 1], grams[i // 2]) for i in (0, 2)])
    order = torch.roll(torch.arange(12), 1)
    assert not certify_heads([(A[i], A[i + 1], near[i][order], near[i + 1][order], grams[i // 2]) for i in (0, 2)])


def _gpt(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return canonicalize(
        perturbed(
            from_preset("gpt2-tiny", n_layer=2, d_model=32, n_head=4, d_ff=256, vocab_size=20, block_size=16), seed, 0.2
        )
    )


def _uncertified(monkeypatch):
    monkeypatch.setattr(problem, "certify", lambda *a, **k: False)
    monkeypatch.setattr(problem, "certify_heads", lambda *a, **k: False)


@pytest.mark.parametrize("case", ["common", "planted"])
@pytest.mark.parametrize("precision", ["auto", "bfloat16", "int8"])
def test_weight_matching_with_the_certificate_returns_what_it_returns_without(case, precision, monkeypatch, record):
    """A reply trained a little from A (the common round) and a planted copy of A: the certificate
    settles FF steps (the common one's every step, the planted one's after the first), and the
    transform, objective and trace are those of the descent that computes every similarity."""
    A = _gpt(0)
    if case == "common":
        B = canonicalize(A)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in B.parameters():
                p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    else:
        B = apply_transform(A, random_transform(A, seed=2, groups=["residual", "heads", "ff"]))
        with torch.no_grad():
            for p in B.parameters():
                p.add_(0.01 * p.std() * torch.randn_like(p))
    A, B = A.float(), B.float()
    monkeypatch.setattr("fedlmc.matching.steps.DENSE_UP_TO", 0)  # the candidate path, as at large widths
    m = Matching(precision=precision, ff_candidates=16)
    got = weight_matching(A, B, m)
    for kind in ("ff_steps", "heads_steps"):
        steps = got.info[kind]
        assert steps["certified"] >= (2 * steps["solved"] if case == "common" else 1), kind
        if case == "common":
            assert steps["solved"] == 0, kind
    with monkeypatch.context() as mp:
        _uncertified(mp)
        full = weight_matching(A, B, m)
    assert full.info["ff_steps"]["certified"] == full.info["heads_steps"]["certified"] == 0
    assert got.info["trace"] == full.info["trace"] and got.info["objective"] == full.info["objective"]
    assert set(got.elements) == set(full.elements)
    record(
        f"certified vs full descent, {case} ({precision}): elements max |Δ|",
        max(float((got[k].double() - full[k].double()).abs().max()) for k in full.elements),
        0.0,
    )
