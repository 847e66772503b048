"""The per-group steps of weight matching, written against the symmetry spec: a step reads which
tensors (and axes) a group acts on from the spec, never a parameter name. The residual map, head
permutations (by gauge-invariant circuit distances), intra-head gauges and FF permutations."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Union

import numpy as np
import torch

from fedlmc.matching.profile import section
from fedlmc.matching.solvers import (
    Elements,
    Int8Rows,
    _obvious,
    _sylvester,
    assignment,
    candidate_graph,
    dense_solve,
    grouped_assignment,
    procrustes,
    procrustes_fix_ones,
    solve_graph,
)
from fedlmc.symmetry import Group, StateDict, SymmetrySpec, Transform, apply_to_state, perm_matrix
from fedlmc.symmetry.rope import rope_fit, with_pass


def residual_element(M: torch.Tensor, residual: str, keep_layernorm: bool) -> torch.Tensor:
    """The residual group element maximising ``tr(Oᵀ M)`` in the requested subgroup."""
    if residual == "permutation":  # Git Re-Basin's baseline, as the orthogonal group's matrix
        return perm_matrix(assignment(M), M.dtype).to(M.device)
    if residual != "orthogonal":
        raise ValueError(f"residual must be 'orthogonal' or 'permutation', got {residual!r}")
    return procrustes_fix_ones(M) if keep_layernorm else ones_up(procrustes(M), M)


def ones_up(O: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """``O`` with the all-ones direction u kept (O u = u) where O reverses it and ``tr(Oᵀ M)`` cannot
    tell: a LayerNorm model's canonical form leaves u null in every tensor, so the Procrustes solution's
    sign there is arbitrary and flips on rounding; fixing it makes the answer reproducible."""
    d = M.shape[0]
    u = torch.full((d,), d**-0.5, dtype=M.dtype, device=M.device)
    Ou = O @ u
    if float(Ou @ u) > -0.5 or float((M @ u).norm() + (M.T @ u).norm()) > 1e-6 * float(M.norm()):
        return O
    return O - 2 * torch.outer(Ou, u)  # O (I − 2uuᵀ): the same map on u⊥, and u ↦ −O u ≈ u


def as_rows(t: torch.Tensor, axis: int) -> torch.Tensor:
    """The tensor as a matrix whose columns index ``axis`` (one row per vector along that axis)."""
    return t.movedim(axis, -1).reshape(-1, t.shape[axis])


def anchors(spec: SymmetrySpec) -> list:
    """Residual members no other group touches: they correspond across models before any matching."""
    moved = {m.param for g in spec.groups.values() if g.name != "residual" for m in g.members}
    return [m for m in spec.residual.members if m.param not in moved]


def apply_elements(B: StateDict, cfg, elements: Elements, kinds: Optional[tuple[str, ...]] = None) -> StateDict:
    """``B`` acted on by the elements whose kind is in ``kinds`` (all when None)."""
    T = Transform({k: v for k, v in elements.items() if kinds is None or k.split(".")[0] in kinds})
    return apply_to_state(B, cfg, T)[0]


def head_side(sd: StateDict, group: Group, fns: tuple[str, ...]) -> torch.Tensor:
    """Per-unit factor ``(count, d_head, ·)`` of gauge group ``group`` (``count`` heads, or KV heads under
    grouped-query attention, whose query heads' factors are concatenated): its members with ``fn`` in
    ``fns``, bias-augmented."""
    n = group.count
    parts = [
        sd[m.param].movedim(m.axis, 0).reshape(n, m.repeat, m.block, -1).transpose(1, 2).reshape(n, m.block, -1)
        for m in group.members
        if m.fn in fns
    ]
    return torch.cat(parts, dim=-1)


def cached_side(sd: StateDict, group: Group, fns: tuple[str, ...], cache: Optional[dict]) -> torch.Tensor:
    """``head_side``, memoised in ``cache`` (for a model that stays fixed through a matching)."""
    if cache is None:
        return head_side(sd, group, fns)
    key = (group.name, fns)
    if key not in cache:
        cache[key] = head_side(sd, group, fns)
    return cache[key]


def circuit_inner(XA: torch.Tensor, YA: torch.Tensor, XB: torch.Tensor, YB: torch.Tensor) -> torch.Tensor:
    """``⟨X_Aᵢᵀ Y_Aᵢ, X_Bⱼᵀ Y_Bⱼ⟩_F`` for all head pairs (i, j), without forming the d×d circuits."""
    return (torch.einsum("iak,jbk->ijab", XA, XB) * torch.einsum("iak,jbk->ijab", YA, YB)).sum((-1, -2))


def circuit_norm(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``‖Xᵢᵀ Yᵢ‖²_F`` for every head i, without forming the circuits."""
    return ((X @ X.transpose(1, 2)) * (Y @ Y.transpose(1, 2))).sum((-1, -2))


def circuit_distance(XA, YA, XB, YB, nA: torch.Tensor, nB: torch.Tensor) -> torch.Tensor:
    """Squared circuit distances between all of A's and B's heads, normalised by A's mean circuit norm."""
    return (nA[:, None] + nB[None, :] - 2 * circuit_inner(XA, YA, XB, YB)) / nA.mean().clamp_min(1e-30)


# The two circuits of a head, as (transposed factor, other factor) fns in the qk / ov gauge groups.
CIRCUITS = {"qk": (("MT",), ("Minv",)), "ov": (("MinvT",), ("M",))}


def circuit_norms(sd: StateDict, spec: SymmetrySpec, heads: str) -> dict[str, torch.Tensor]:
    """Each head's squared QK and OV circuit norms (invariant under the residual map, permutations and
    gauges, so a matching computes them once per model)."""
    out = {}
    for kind, (xs, ys) in CIRCUITS.items():
        g = spec.gauges_of(heads)[kind]
        X, Y = head_side(sd, g, xs), head_side(sd, g, ys)
        out[kind] = circuit_norm(X, Y)
    return out


def head_distances(
    A: StateDict,
    B: StateDict,
    spec: SymmetrySpec,
    heads: str,
    norms: Optional[tuple[dict, dict]] = None,
    a_sides: Optional[dict] = None,
) -> torch.Tensor:
    """Squared distances between A's and B's heads of heads group ``heads``: bias-augmented QK and OV
    circuits, each normalised by A's mean circuit norm so that neither dominates. Gauge-invariant.
    ``norms``: A's and B's ``circuit_norms`` when already known; ``a_sides``: a cache of A's factors."""
    D = 0.0
    gauges = spec.gauges_of(heads)
    nAs, nBs = norms or (circuit_norms(A, spec, heads), circuit_norms(B, spec, heads))
    for kind, (xs, ys) in CIRCUITS.items():
        g = gauges[kind]
        XA, YA = cached_side(A, g, xs, a_sides), cached_side(A, g, ys, a_sides)
        XB, YB = head_side(B, g, xs), head_side(B, g, ys)
        D = D + circuit_distance(XA, YA, XB, YB, nAs[kind], nBs[kind])
    return D


def query_side(sd: StateDict, group: Group, fns: tuple[str, ...], n_query: int) -> torch.Tensor:
    """``head_side`` per *query* head under grouped-query attention: ``(n_query, d_head, ·)``, a KV
    head's members repeated for each of its query heads."""
    parts = []
    for m in group.members:
        if m.fn not in fns:
            continue
        t = sd[m.param].movedim(m.axis, 0)
        if m.repeat > 1:
            parts.append(t.reshape(n_query, m.block, -1))
        else:
            parts.append(t.reshape(group.count, m.block, -1).repeat_interleave(n_query // group.count, 0))
    return torch.cat(parts, dim=-1)


def query_distances(A: StateDict, B: StateDict, spec: SymmetrySpec, heads: str, n_query: int) -> torch.Tensor:
    """``head_distances`` between A's and B's query heads (each with its KV head's factors)."""
    D = 0.0
    for kind, (xs, ys) in CIRCUITS.items():
        g = spec.gauges_of(heads)[kind]
        XA, YA = query_side(A, g, xs, n_query), query_side(A, g, ys, n_query)
        XB, YB = query_side(B, g, xs, n_query), query_side(B, g, ys, n_query)
        D = D + circuit_distance(XA, YA, XB, YB, circuit_norm(XA, YA), circuit_norm(XB, YB))
    return D


def heads_step(
    A: StateDict,
    B_res: StateDict,
    spec: SymmetrySpec,
    norms: Optional[dict[str, tuple[dict, dict]]] = None,
    a_sides: Optional[dict] = None,
    groups: Optional[list[Group]] = None,
) -> Elements:
    """Head permutations of every layer (or of ``groups``) from circuit distances (B already carries the residual map);
    ``norms``: each heads group's (A, B) ``circuit_norms``, when known; ``a_sides``: a cache of A's head
    factors (A is fixed through a matching). Under grouped-query attention
    KV heads are matched by their best matching of query heads, which gives the "within" element too."""
    out: Elements = {}
    for g in spec.layer_groups("heads") if groups is None else groups:
        within = spec.within_of(g.name)
        with section("head circuit distances"):
            if within is not None:
                D = query_distances(A, B_res, spec, g.name, within.size)
                out[g.name], out[within.name] = grouped_assignment(-D, within.size // within.count)
                continue
            D = head_distances(A, B_res, spec, g.name, norms[g.name] if norms else None, a_sides)
        out[g.name] = assignment(-D)
    return out


def _free_gauge(XA: torch.Tensor, XB: torch.Tensor, YA: torch.Tensor, YB: torch.Tensor, mode: str) -> torch.Tensor:
    """An unrestricted gauge per head: the Procrustes rotation, or the invertible map of ``gauge_step``."""
    if mode == "orthogonal":
        return procrustes(XA @ XB.transpose(1, 2) + YA @ YB.transpose(1, 2))
    if mode == "invertible":
        return _sylvester(
            YA @ YA.transpose(1, 2), XB @ XB.transpose(1, 2), XA @ XB.transpose(1, 2) + YA @ YB.transpose(1, 2)
        )
    raise ValueError(f"gauge must be 'orthogonal', 'invertible' or None, got {mode!r}")


def gauge_step(
    A: StateDict, B_heads: StateDict, spec: SymmetrySpec, mode: str = "orthogonal", a_sides: Optional[dict] = None
) -> Elements:
    """Per-head intra-head gauges aligning B's Q/K (and V/O) factors to A's.

    Members split into a direct side (fn M or Mᵀ: vectors map by G) and an inverse side (M⁻¹, M⁻ᵀ:
    vectors map by G⁻ᵀ). ``orthogonal``: G⁻ᵀ = G, so G is the Procrustes rotation of both sides stacked.
    ``invertible``: G minimises ‖G X_B − X_A‖² + ‖Gᵀ Y_A − Y_B‖² (the inverse side multiplied through),
    a Sylvester equation ``(Y_A Y_Aᵀ) G + G (X_B X_Bᵀ) = X_A X_Bᵀ + Y_A Y_Bᵀ`` solved in closed form;
    exact whenever B's factors are an invertible gauge of A's. ``a_sides``: a cache of A's factors.
    """
    out: Elements = {}
    for kind in ("qk", "ov"):
        for g in spec.layer_groups(kind):
            direct = tuple(f for f in ("M", "MT") if any(m.fn == f for m in g.members))
            inverse = tuple(f for f in ("Minv", "MinvT") if any(m.fn == f for m in g.members))
            XA, XB = cached_side(A, g, direct, a_sides), head_side(B_heads, g, direct)
            YA, YB = cached_side(A, g, inverse, a_sides), head_side(B_heads, g, inverse)
            if g.structure == "rope":  # only per-frequency-pair (scaled) rotations commute with RoPE
                r = g.rotary or g.size  # partial rotary: the rest is a free block (the objective separates)
                G = rope_fit(XA[:, :r], XB[:, :r], YA[:, :r], YB[:, :r], scaled=mode == "invertible")
                if r < g.size:
                    G = with_pass(G, _free_gauge(XA[:, r:], XB[:, r:], YA[:, r:], YB[:, r:], mode))
            else:
                G = _free_gauge(XA, XB, YA, YB, mode)
            out[g.name] = G.transpose(1, 2) if direct == ("MT",) else G
    return out


def unit_features(sd: StateDict, group: Group) -> torch.Tensor:
    """One row per unit of a permutation group: all its members' slices along the group axis."""
    return torch.cat([sd[m.param].movedim(m.axis, 0).reshape(group.size, -1) for m in group.members], dim=1)


def similarity(FA: Union[torch.Tensor, Int8Rows], FB: torch.Tensor) -> torch.Tensor:
    """``FA FBᵀ``, the FF neurons' similarity scores, in the features' dtype (``score_dtype``: products
    of bfloat16 factors accumulate in float32 and are rounded once; the solvers read any float dtype),
    or, for A's features as ``Int8Rows``, an int8 product with B's features coded the same way."""
    if isinstance(FA, Int8Rows):
        return FA.scores(Int8Rows(FB))
    return FA @ FB.to(FA.dtype).T


# FF groups up to this many neurons are assigned densely whatever ``candidates`` says: a dense solve of
# 2048 units takes a fraction of a second, while the sparse solver on a candidate graph of a few hundred
# units was seen to spend minutes in one call (a trained d = 256 ViT pair, d_ff = 512)
DENSE_UP_TO = 2048


def ff_step(
    A_features: dict[str, Union[torch.Tensor, Int8Rows]],
    B_res: StateDict,
    spec: SymmetrySpec,
    current: Optional[Elements] = None,
    candidates: Optional[int] = None,
    groups: Optional[list[Group]] = None,
) -> Elements:
    """FF permutations of every layer (or of ``groups``) by linear assignment on fc1 rows, fc1 bias and
    fc2 columns.
    ``A_features``: each FF group's ``unit_features`` of A (fixed during a matching, so computed once),
    or their ``Int8Rows`` for int8 scores.
    ``candidates``: solve on each neuron's best candidates only (``sparse_assignment``, starting from
    ``current``) for groups larger than 4 × candidates and ``DENSE_UP_TO``; None: the dense solver everywhere.

    Layer l's assignment is solved in a worker thread (scipy releases the GIL) while layer l + 1's
    similarity is computed, and at most two similarity matrices are alive at once."""
    current = current or {}

    def prepare(S: torch.Tensor, g: Group):
        S = S.float() if S.dtype == torch.bfloat16 else S  # the CPU's elementwise bfloat16 kernels are slower
        if candidates and g.size > max(4 * candidates, DENSE_UP_TO):
            return candidate_graph(S, candidates, current.get(g.name))
        best = _obvious(S)
        return best if best is not None else S.detach().to("cpu", torch.float64).numpy()

    def solve(job) -> torch.Tensor:
        if isinstance(job, torch.Tensor):
            return job
        if not isinstance(job, np.ndarray):  # candidate_graph's sparse graph
            return solve_graph(job)
        with section("assignment solves"):
            return dense_solve(job)

    pending: list[tuple[str, Future]] = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        for g in spec.layer_groups("ff") if groups is None else groups:
            with section("FF similarity products"):
                FA = A_features[g.name]
                S = similarity(FA, unit_features(B_res, g))
            with section("FF candidate graphs"):  # or the obvious answer, or the dense scores
                job = prepare(S, g)
            del S
            if len(pending) >= 1:
                pending[-1][1].result()
            pending.append((g.name, pool.submit(solve, job)))
        return {name: f.result() for name, f in pending}
