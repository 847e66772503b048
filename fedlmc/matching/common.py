"""Pieces every matching method shares: Procrustes, assignment, the head circuits, per-group steps.

All of it is written against the symmetry spec: a step reads which tensors (and axes) a group acts
on from the spec, never a parameter name.
"""
from __future__ import annotations

import functools
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import min_weight_full_bipartite_matching

from .profile import section
from ..symmetry import Group, StateDict, SymmetrySpec, Transform, apply_to_state, ones_basis, perm_matrix
from ..symmetry.rope import rope_fit

Elements = dict[str, torch.Tensor]


def procrustes(M: torch.Tensor) -> torch.Tensor:
    """The orthogonal (or orthonormal-column) R maximising ``tr(Rᵀ M)``: ``U Vᵀ`` from ``M = U S Vᵀ``."""
    U, _, Vh = torch.linalg.svd(M, full_matrices=False)
    return U @ Vh


def procrustes_fix_ones(M: torch.Tensor) -> torch.Tensor:
    """Procrustes restricted to ``O·1 = 1`` (square): identity on 1/√d, free on its complement."""
    d = M.shape[0]
    Q = ones_basis(d, M.dtype).to(M.device)
    R = procrustes((Q.T @ M @ Q)[1:, 1:])
    return Q @ torch.block_diag(torch.ones(1, 1, dtype=M.dtype, device=M.device), R) @ Q.T


def exact_elements(elements: dict[str, torch.Tensor], spec: SymmetrySpec, keep_ones: bool = False) -> Elements:
    """Learned elements as exact group elements, on the CPU in float64.

    Latents train in float32, where the polar factor is orthogonal only to ~1e-6 (enough to change a
    model's outputs by ~1e-5): the residual map is re-polarised in float64 (the nearest orthogonal
    matrix; with ``keep_ones`` the nearest one with O·1 = 1). Permutations stay index tensors; gauges
    act through their exact inverses, so any invertible float64 matrix is exact.
    """
    out: Elements = {}
    for name, el in elements.items():
        el = el.detach().cpu()
        kind = spec.groups[name].kind
        if kind == "permutation":
            out[name] = el
        elif kind == "orthogonal":
            out[name] = (procrustes_fix_ones if keep_ones else procrustes)(el.to(torch.float64))
        else:
            out[name] = el.to(torch.float64)
    return out


def _obvious(score: torch.Tensor, maximize: bool = True) -> Optional[torch.Tensor]:
    """The assignment when every row's best column is distinct (then it is optimal, no solver needed)."""
    if not torch.isfinite(score.sum()) and not torch.isfinite(score).all():  # the sum: 40× cheaper, same answer
        raise ValueError("assignment scores contain NaN/Inf")
    best = score.argmax(1) if maximize else score.argmin(1)
    return best.cpu() if len(torch.unique(best)) == len(best) else None


def _perm(rows, cols, n: int) -> torch.Tensor:
    """``perm[rows] = cols`` as a long tensor (a solver's row/column pairs as ``new[i] = old[perm[i]]``)."""
    perm = torch.empty(n, dtype=torch.long)
    perm[torch.as_tensor(rows, dtype=torch.long)] = torch.as_tensor(cols, dtype=torch.long)
    return perm


def assignment(score: torch.Tensor, maximize: bool = True) -> torch.Tensor:
    """The permutation ``perm`` (``new[i] = old[perm[i]]``) maximising ``Σ_i score[i, perm[i]]``."""
    best = _obvious(score, maximize)
    if best is not None:
        return best
    with section("assignment solves"):
        return dense_solve(score.detach().to("cpu", torch.float64).numpy(), maximize)


def dense_solve(score: np.ndarray, maximize: bool = True) -> torch.Tensor:
    """scipy's dense solver on a float64 array, as a permutation (no torch work before the answer, so
    it can run in a worker thread)."""
    rows, cols = linear_sum_assignment(score, maximize=maximize)
    return _perm(rows, cols, len(rows))


def assignments(scores: Sequence[torch.Tensor], pool: Executor) -> list[torch.Tensor]:
    """``assignment`` (maximising) of every score matrix, the solves spread over ``pool``'s threads
    (scipy's solver releases the GIL). Only the solver runs there: the torch steps (the obvious-case
    check, the conversion) stay on the caller's thread, because torch ops in extra threads start
    OpenMP teams whose spinning slowed the caller's own work (a refinement step by 10 %)."""
    out: list[Optional[torch.Tensor]] = [_obvious(s) for s in scores]
    futures = {i: pool.submit(dense_solve, s.detach().to("cpu", torch.float64).numpy())
               for i, s in enumerate(scores) if out[i] is None}
    with section("assignment solves"):
        for i, f in futures.items():
            out[i] = f.result()
    return out


def sparse_assignment(score: torch.Tensor, candidates: int, current: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``assignment`` restricted to about ``candidates`` best partners of each row and each column, plus
    ``current`` (so a full matching always exists and the result never scores below ``current``).

    Exact whenever the optimal assignment uses only candidate edges, which on matching scores it does
    with a wide margin (a neuron's partner ranks far above its 64th-best alternative; tested against the
    dense solver). With the candidate lists built, ~7× faster than the dense solver at 3072 units.
    """
    graph = candidate_graph(score, candidates, current)
    return graph if isinstance(graph, torch.Tensor) else solve_graph(graph)


def candidate_graph(score: torch.Tensor, candidates: int, current: Optional[torch.Tensor] = None):
    """``sparse_assignment``'s torch half: the obvious assignment when there is one, else the sparse
    cost graph of the candidate edges for ``solve_graph`` (which needs no torch, so it can run in
    another thread without starting OpenMP teams there)."""
    best = _obvious(score)
    if best is not None:
        return best
    n = score.shape[0]
    with section("assignment solves"):
        mask = (score >= rank_threshold(score, candidates, 1)[:, None]) | (score >= rank_threshold(score, candidates, 0)[None, :])
        if current is not None:
            mask[torch.arange(n, device=score.device), current.to(score.device)] = True
        rows, cols = mask.nonzero(as_tuple=True)
        vals = score[rows, cols].to("cpu", torch.float64)
        cost = (vals.max() - vals + 1.0).numpy()  # positive: the sparse solver reads 0 as "no edge"
        return csr_matrix((cost, (rows.cpu().numpy(), cols.cpu().numpy())), shape=(n, n))


def solve_graph(graph: csr_matrix) -> torch.Tensor:
    """The minimum-cost full matching of a ``candidate_graph``, as a permutation."""
    with section("assignment solves"):
        r, c = min_weight_full_bipartite_matching(graph)
    return _perm(r, c, graph.shape[0])


def rank_threshold(score: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """About the ``k``-th largest score along ``dim`` of every row (dim 1) or column (dim 0), read off a
    fixed sample of 8k entries: a rank statistic of a sample costs a fraction of a full ``topk``, which
    on a 3072² matrix took longer than the assignment it prepares. The candidate count per unit then
    varies around ``k``; the ``current`` edges keep the matching feasible whatever the sample."""
    n = score.shape[dim]
    s = min(n, 8 * k)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:s].to(score.device)
    q = max(1, min(s, round(k * s / n)))
    return score.index_select(dim, idx).topk(q, dim=dim).values.select(dim, q - 1)


def residual_element(M: torch.Tensor, residual: str, keep_layernorm: bool) -> torch.Tensor:
    """The residual group element maximising ``tr(Oᵀ M)`` in the requested subgroup."""
    if residual == "permutation":  # Git Re-Basin's baseline, as the orthogonal group's matrix
        return perm_matrix(assignment(M), M.dtype).to(M.device)
    if residual != "orthogonal":
        raise ValueError(f"residual must be 'orthogonal' or 'permutation', got {residual!r}")
    return procrustes_fix_ones(M) if keep_layernorm else procrustes(M)


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
    parts = [sd[m.param].movedim(m.axis, 0).reshape(n, m.repeat, m.block, -1).transpose(1, 2).reshape(n, m.block, -1)
             for m in group.members if m.fn in fns]
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


def head_distances(A: StateDict, B: StateDict, spec: SymmetrySpec, heads: str,
                   norms: Optional[tuple[dict, dict]] = None, a_sides: Optional[dict] = None) -> torch.Tensor:
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


def grouped_assignment(score: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best permutation of blocks of ``block`` units and, inside each matched pair of blocks, of
    their units: ``(sigma, tau)`` with unit i of block b taken from unit ``tau[i]`` (same block) after
    block b was taken from block ``sigma[b]`` (maximises the summed ``score``)."""
    nb = score.shape[0] // block
    inner: dict[tuple[int, int], torch.Tensor] = {}
    pair = torch.empty(nb, nb, dtype=torch.float64)
    rows = torch.arange(block)
    for a in range(nb):
        for b in range(nb):
            sub = score[a * block:(a + 1) * block, b * block:(b + 1) * block]
            inner[a, b] = assignment(sub)
            pair[a, b] = float(sub[rows, inner[a, b].to(sub.device)].sum())
    sigma = assignment(pair)
    tau = torch.cat([inner[a, int(sigma[a])] + a * block for a in range(nb)])
    return sigma, tau


def heads_step(A: StateDict, B_res: StateDict, spec: SymmetrySpec,
               norms: Optional[dict[str, tuple[dict, dict]]] = None, a_sides: Optional[dict] = None) -> Elements:
    """Head permutations of every layer from circuit distances (B already carries the residual map);
    ``norms``: each heads group's (A, B) ``circuit_norms``, when known; ``a_sides``: a cache of A's head
    factors (A is fixed through a matching). Under grouped-query attention
    KV heads are matched by their best matching of query heads, which gives the "within" element too."""
    out: Elements = {}
    for g in spec.layer_groups("heads"):
        within = spec.within_of(g.name)
        with section("head circuit distances"):
            if within is not None:
                D = query_distances(A, B_res, spec, g.name, within.size)
                out[g.name], out[within.name] = grouped_assignment(-D, within.size // within.count)
                continue
            D = head_distances(A, B_res, spec, g.name, norms[g.name] if norms else None, a_sides)
        out[g.name] = assignment(-D)
    return out


def gauge_step(A: StateDict, B_heads: StateDict, spec: SymmetrySpec, mode: str = "orthogonal",
               a_sides: Optional[dict] = None) -> Elements:
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
                G = rope_fit(XA, XB, YA, YB, scaled=mode == "invertible")
            elif mode == "orthogonal":
                G = procrustes(XA @ XB.transpose(1, 2) + YA @ YB.transpose(1, 2))
            elif mode == "invertible":
                G = _sylvester(YA @ YA.transpose(1, 2), XB @ XB.transpose(1, 2),
                               XA @ XB.transpose(1, 2) + YA @ YB.transpose(1, 2))
            else:
                raise ValueError(f"gauge must be 'orthogonal', 'invertible' or None, got {mode!r}")
            out[g.name] = G.transpose(1, 2) if direct == ("MT",) else G
    return out


def _sylvester(P: torch.Tensor, S: torch.Tensor, C: torch.Tensor, ridge: float = 1e-9) -> torch.Tensor:
    """Solve ``P G + G S = C`` for symmetric PSD P, S (batched) through their eigenbases."""
    lp, Up = torch.linalg.eigh(P)
    ls, Us = torch.linalg.eigh(S)
    scale = (lp.abs().mean(-1) + ls.abs().mean(-1))[:, None, None]
    Gt = (Up.transpose(1, 2) @ C @ Us) / (lp[:, :, None] + ls[:, None, :] + ridge * scale)
    return Up @ Gt @ Us.transpose(1, 2)


def unit_features(sd: StateDict, group: Group) -> torch.Tensor:
    """One row per unit of a permutation group: all its members' slices along the group axis."""
    return torch.cat([sd[m.param].movedim(m.axis, 0).reshape(group.size, -1) for m in group.members], dim=1)


@functools.cache
def _native_bf16() -> bool:
    """Whether this CPU has native bfloat16 dot products (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def score_dtype(dtype: torch.dtype, device: torch.device, size: int) -> torch.dtype:
    """The dtype of weight matching's large products (see ``weight.Problem``): bfloat16 for float32
    problems of ``size`` ≥ 1024 on a CPU with native bfloat16 dot products (2.7× faster than float32
    at gpt2-small size), else ``dtype``. Float64 problems (small models, hence every reproduction
    table) and GPUs compute exactly."""
    if dtype == torch.float32 and device.type == "cpu" and size >= 1024 and _native_bf16():
        return torch.bfloat16
    return dtype


def similarity(FA: torch.Tensor, FB: torch.Tensor) -> torch.Tensor:
    """``FA FBᵀ``, the FF neurons' similarity scores, in the features' dtype (``score_dtype``: products
    of bfloat16 factors accumulate in float32 and are rounded once; the solvers read any float dtype)."""
    return FA @ FB.to(FA.dtype).T


def ff_step(A_features: dict[str, torch.Tensor], B_res: StateDict, spec: SymmetrySpec,
            current: Optional[Elements] = None, candidates: Optional[int] = None) -> Elements:
    """FF permutations of every layer by linear assignment on fc1 rows, fc1 bias and fc2 columns.
    ``A_features``: each FF group's ``unit_features`` of A (fixed during a matching, so computed once).
    ``candidates``: solve on each neuron's best candidates only (``sparse_assignment``, starting from
    ``current``) for groups larger than 4 × candidates; None: the dense solver everywhere.

    Layer l's assignment is solved in a worker thread (scipy releases the GIL) while layer l + 1's
    similarity is computed, and at most two similarity matrices are alive at once."""
    current = current or {}

    def prepare(S: torch.Tensor, g: Group):
        S = S.float() if S.dtype == torch.bfloat16 else S  # the CPU's elementwise bfloat16 kernels are slower
        if candidates and g.size > 4 * candidates:
            return candidate_graph(S, candidates, current.get(g.name))
        best = _obvious(S)
        return best if best is not None else S.detach().to("cpu", torch.float64).numpy()

    def solve(job) -> torch.Tensor:
        if isinstance(job, torch.Tensor):
            return job
        if isinstance(job, csr_matrix):
            return solve_graph(job)
        with section("assignment solves"):
            return dense_solve(job)

    pending: list[tuple[str, Future]] = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        for g in spec.layer_groups("ff"):
            with section("FF similarity products"):
                FA = A_features[g.name]
                S = similarity(FA, unit_features(B_res, g))
            job = prepare(S, g)
            del S
            if len(pending) >= 1:
                pending[-1][1].result()
            pending.append((g.name, pool.submit(solve, job)))
        return {name: f.result() for name, f in pending}
