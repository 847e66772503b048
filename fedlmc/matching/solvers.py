"""The solvers every matching method shares: linear assignment (dense, sparse on candidate edges,
many at once in a thread pool, blocks of units), orthogonal Procrustes, the Sylvester equation of
invertible gauges, exact group elements from learned latents, and the precision of the large products
(native bfloat16 on CPUs that have it, else int8 FF scores where the CPU has int8 dot products).
Nothing here reads a symmetry spec's parameters."""

from __future__ import annotations

import functools
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from fedlmc.matching.profile import section
from fedlmc.symmetry import SymmetrySpec

if TYPE_CHECKING:
    from scipy.sparse import csr_matrix

# scipy's solvers are imported where they are called: importing scipy.optimize takes about a second,
# and a deployment's ClientApp (a new process per message) reaches this module without solving anything

Elements = dict[str, torch.Tensor]


def procrustes(M: torch.Tensor) -> torch.Tensor:
    """The orthogonal (or orthonormal-column) R maximising ``tr(Rᵀ M)``: ``U Vᵀ`` from ``M = U S Vᵀ``."""
    U, _, Vh = torch.linalg.svd(M, full_matrices=False)
    return U @ Vh


def procrustes_fix_ones(M: torch.Tensor) -> torch.Tensor:
    """Procrustes restricted to ``O·1 = 1`` (square): identity on 1/√d, free on its complement. In the
    basis of the Householder reflection H that swaps 1/√d and e₁ (applied in O(d²), not as products)."""
    d = M.shape[0]
    v = torch.full((d,), d**-0.5, dtype=M.dtype, device=M.device)
    v[0] -= 1.0  # H = I − 2vvᵀ/‖v‖² maps 1/√d to e₁ and back
    if d == 1 or float(v @ v) == 0.0:
        return torch.ones(1, 1, dtype=M.dtype, device=M.device) if d == 1 else procrustes(M)
    w = v * (2.0 / (v @ v)) ** 0.5

    def reflect(X: torch.Tensor) -> torch.Tensor:  # H X H, with H = I − w wᵀ
        Xw, wX = X @ w, w @ X
        return X - torch.outer(Xw, w) - torch.outer(w, wX) + (w @ Xw) * torch.outer(w, w)

    X = torch.zeros_like(M)
    X[0, 0] = 1.0
    X[1:, 1:] = procrustes(reflect(M)[1:, 1:])
    return reflect(X)


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


def _host_array(x: torch.Tensor) -> Optional[np.ndarray]:
    """``x`` as a numpy array without a copy where it is a CPU float32/float64 tensor, else None: on a
    CPU's large score matrices numpy's one-thread argmax, partition and comparisons beat torch's argmax,
    topk and comparisons, and the other core is left to the assignment solver's thread."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return None
    return x.detach().numpy()


def _obvious(score: torch.Tensor, maximize: bool = True) -> Optional[torch.Tensor]:
    """The assignment when every row's best column is distinct (then it is optimal, no solver needed)."""
    if not torch.isfinite(score.sum()) and not torch.isfinite(score).all():  # the sum: 40× cheaper, same answer
        raise ValueError("assignment scores contain NaN/Inf")
    a = _host_array(score)
    if a is not None:  # the first best column of each row, as torch's argmax gives it
        best = torch.from_numpy(a.argmax(1) if maximize else a.argmin(1))
    else:
        best = (score.argmax(1) if maximize else score.argmin(1)).cpu()
    return best if len(torch.unique(best)) == len(best) else None


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
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(score, maximize=maximize)
    return _perm(rows, cols, len(rows))


def assignments(scores: Sequence[torch.Tensor], pool: Executor) -> list[torch.Tensor]:
    """``assignment`` (maximising) of every score matrix, the solves spread over ``pool``'s threads
    (scipy's solver releases the GIL). Only the solver runs there: the torch steps (the obvious-case
    check, the conversion) stay on the caller's thread, because torch ops in extra threads start
    OpenMP teams whose spinning slows the caller's own work."""
    out: list[Optional[torch.Tensor]] = [_obvious(s) for s in scores]
    futures = {
        i: pool.submit(dense_solve, s.detach().to("cpu", torch.float64).numpy())
        for i, s in enumerate(scores)
        if out[i] is None
    }
    with section("assignment solves"):
        for i, f in futures.items():
            out[i] = f.result()
    return out


def sparse_assignment(score: torch.Tensor, candidates: int, current: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``assignment`` restricted to about ``candidates`` best partners of each row and each column, plus
    ``current`` (so a full matching always exists and the result never scores below ``current``).

    Exact whenever the optimal assignment uses only candidate edges, which on matching scores it does
    with a wide margin (a neuron's partner ranks far above its 64th-best alternative; tested against the
    dense solver).
    """
    graph = candidate_graph(score, candidates, current)
    return graph if isinstance(graph, torch.Tensor) else solve_graph(graph)


def candidate_graph(score: torch.Tensor, candidates: int, current: Optional[torch.Tensor] = None):
    """``sparse_assignment``'s torch half: the obvious assignment when there is one, else the sparse
    cost graph of the candidate edges for ``solve_graph`` (which needs no torch, so it can run in
    another thread without starting OpenMP teams there). ``steps.ff_step`` profiles it as "FF
    candidate graphs" (several passes over the dense scores), apart from the solve."""
    best = _obvious(score)
    if best is not None:
        return best
    from scipy.sparse import csr_matrix

    n = score.shape[0]
    row, col = rank_threshold(score, candidates, 1), rank_threshold(score, candidates, 0)
    a = _host_array(score)
    if a is None:
        mask = (score >= row[:, None]) | (score >= col[None, :])
        if current is not None:
            mask[torch.arange(n, device=score.device), current.to(score.device)] = True
        rows, cols = mask.nonzero(as_tuple=True)
        vals = score[rows, cols].to("cpu", torch.float64)
        cost = (vals.max() - vals + 1.0).numpy()  # positive: the sparse solver reads 0 as "no edge"
        return csr_matrix((cost, (rows.cpu().numpy(), cols.cpu().numpy())), shape=(n, n))
    m = np.greater_equal(a, row.numpy()[:, None])
    m |= np.greater_equal(a, col.numpy()[None, :])
    if current is not None:
        m[np.arange(n), current.cpu().numpy()] = True
    # the edges in row-major order (flat indices: one pass, where a 2-D nonzero takes two), which is
    # CSR's own order, so the rows' offsets come from their counts
    flat = np.flatnonzero(m)
    rows, cols = np.divmod(flat, n)
    vals = a.ravel()[flat].astype(np.float64)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n), out=indptr[1:])
    return csr_matrix((vals.max() - vals + 1.0, cols, indptr), shape=(n, n))


def solve_graph(graph: csr_matrix) -> torch.Tensor:
    """The minimum-cost full matching of a ``candidate_graph``, as a permutation."""
    from scipy.sparse.csgraph import min_weight_full_bipartite_matching

    with section("assignment solves"):
        r, c = min_weight_full_bipartite_matching(graph)
    return _perm(r, c, graph.shape[0])


def rank_threshold(score: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """About the ``k``-th largest score along ``dim`` of every row (dim 1) or column (dim 0), read off a
    fixed sample of 8k entries: a rank statistic of a sample costs a fraction of a full ``topk`` (on
    large matrices, more than the assignment it prepares). The candidate count per unit then
    varies around ``k``; the ``current`` edges keep the matching feasible whatever the sample."""
    n = score.shape[dim]
    s = min(n, 8 * k)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:s].to(score.device)
    q = max(1, min(s, round(k * s / n)))
    sample = score.index_select(dim, idx)
    a = _host_array(sample)
    if a is None:
        return sample.topk(q, dim=dim).values.select(dim, q - 1)
    a = a if dim == 1 else sample.T.contiguous().numpy()  # numpy partitions contiguous rows fastest
    # contiguous: strided thresholds slow the masks' comparisons
    return torch.from_numpy(np.partition(a, s - q, axis=1)[:, s - q].copy())


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
            sub = score[a * block : (a + 1) * block, b * block : (b + 1) * block]
            inner[a, b] = assignment(sub)
            pair[a, b] = float(sub[rows, inner[a, b].to(sub.device)].sum())
    sigma = assignment(pair)
    tau = torch.cat([inner[a, int(sigma[a])] + a * block for a in range(nb)])
    return sigma, tau


def _sylvester(P: torch.Tensor, S: torch.Tensor, C: torch.Tensor, ridge: float = 1e-9) -> torch.Tensor:
    """Solve ``P G + G S = C`` for symmetric PSD P, S (batched) through their eigenbases."""
    lp, Up = torch.linalg.eigh(P)
    ls, Us = torch.linalg.eigh(S)
    scale = (lp.abs().mean(-1) + ls.abs().mean(-1))[:, None, None]
    Gt = (Up.transpose(1, 2) @ C @ Us) / (lp[:, :, None] + ls[:, None, :] + ridge * scale)
    return Up @ Gt @ Us.transpose(1, 2)


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def _native_bf16() -> bool:
    """Whether this CPU has native bfloat16 dot products (AVX512-BF16 or AMX)."""
    flags = _cpu_flags()
    return " avx512_bf16" in flags or " amx_bf16" in flags


@functools.cache
def _native_int8() -> bool:
    """Whether this CPU has native int8 dot products (AVX512-VNNI or AVX-VNNI) and torch multiplies
    int8 matrices on it (``torch._int_mm``)."""
    flags = _cpu_flags()
    if " avx512_vnni" not in flags and " avx_vnni" not in flags:
        return False
    try:
        a = torch.ones(32, 32, dtype=torch.int8)
        return bool((torch._int_mm(a, a) == 32).all())
    except (RuntimeError, AttributeError):
        return False


def score_dtype(dtype: torch.dtype, device: torch.device, size: int) -> torch.dtype:
    """The dtype of weight matching's large products (see ``weight.Problem``): bfloat16 for float32
    problems of ``size`` ≥ 1024 on a CPU with native bfloat16 dot products, else ``dtype``. Float64
    problems (small models, hence every reproduction table) and GPUs compute exactly."""
    if dtype == torch.float32 and device.type == "cpu" and size >= 1024 and _native_bf16():
        return torch.bfloat16
    return dtype


def int8_scores(dtype: torch.dtype, device: torch.device, size: int) -> bool:
    """Whether the FF similarity scores are int8 products (``Int8Rows``): for float32 problems of
    ``size`` ≥ 1024 on a CPU with native int8 but no native bfloat16 dot products (where the
    alternative is a slower float32 product)."""
    return dtype == torch.float32 and device.type == "cpu" and size >= 1024 and not _native_bf16() and _native_int8()


def delta_crosses(dtype: torch.dtype, device: torch.device, size: int) -> bool:
    """Whether the cross-covariances of a model near A are taken as ``AᵀA + Aᵀ(B − A)``, the second
    term an int8 product (``Int8Blocks``): for float32 problems of ``size`` ≥ 1024 on a CPU with native
    int8 dot products."""
    return dtype == torch.float32 and device.type == "cpu" and size >= 1024 and _native_int8()


class Int8Blocks:
    """A tall matrix A (rows × d) as int8 codes with a float32 scale per column (each column's largest
    entry coded as ±127) over blocks of rows, for products ``Aᵀ X`` that contract over the rows:
    ``Σ_blocks diag(s_A) (codesᵀ codes_X) diag(s_X)``, each block's int8 product summed exactly in
    int32 (``torch._int_mm``: at most ``ROWS · 127²`` < 2³¹ per block). An A that is the transpose of a
    contiguous matrix (a tensor whose residual axis is its first) is one block, coded in its own layout.

    ``delta_cross(A, B)`` gives ``Aᵀ(B − A)`` so. Near A (B trained a little from it) the difference
    is small, and its int8 rounding, about 1 % of the difference, is far below the rounding of
    ``AᵀB`` in bfloat16 (about 0.3 % of the whole product)."""

    ROWS = 4096
    CHUNK = 1 << 18  # elements of the float buffer that a difference is formed in, a piece at a time

    def __init__(self, A: torch.Tensor) -> None:
        self.transposed = A.shape[0] > 1 and not A.is_contiguous() and A.T.is_contiguous()
        if self.transposed:  # d × rows underneath: codes in that layout, a scale per row of it
            if A.shape[0] > 2**31 // 127**2:
                raise ValueError(f"{A.shape[0]} rows could overflow an int32 sum of int8 products")
            T = A.T
            s = _scale(T, 1)
            self.blocks = [((T / s[:, None]).round_().to(torch.int8), s)]
        else:
            blocks = [(x, _scale(x, 0)) for x in A.split(self.ROWS)]
            self.blocks = [((x / s).round_().to(torch.int8).T.contiguous(), s) for x, s in blocks]

    def delta_cross(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """``Aᵀ(B − A)`` (float32, d × d) for this A (rows × d, laid out as at coding) and a B of its
        shape and layout: the difference formed a piece at a time in one small buffer, its scales
        found in a first pass over a block and its codes written in a second."""
        d, dev = A.shape[1], A.device
        if self.transposed:  # a scale per row of the d × rows layout: one pass, a piece of rows at a time
            (qa, sa), (TA, TB) = self.blocks[0], (A.T, B.T)
            codes = torch.empty(TA.shape, dtype=torch.int8, device=dev)
            s = torch.empty(d, dtype=torch.float32, device=dev)
            step = max(1, self.CHUNK // TA.shape[1])
            buf = torch.empty(min(step, d), TA.shape[1], dtype=torch.float32, device=dev)
            for i in range(0, d, step):
                diff = torch.sub(TB[i : i + step], TA[i : i + step], out=buf[: min(step, d - i)])
                s[i : i + step] = _scale(diff, 1)
                codes[i : i + step].copy_(diff.div_(s[i : i + step, None]).round_())
            return torch._int_mm(qa, codes.T).float().mul_(sa[:, None]).mul_(s[None, :])
        step = max(1, self.CHUNK // d)
        buf = torch.empty(min(step, A.shape[0]), d, dtype=torch.float32, device=dev)
        codes = torch.empty(min(self.ROWS, A.shape[0]), d, dtype=torch.int8, device=dev)
        out = None
        for (qa, sa), x, y in zip(self.blocks, A.split(self.ROWS), B.split(self.ROWS)):
            pieces = list(zip(x.split(step), y.split(step)))
            top = torch.zeros(d, dtype=torch.float32, device=dev)
            for xp, yp in pieces:  # the block's scales
                diff = torch.sub(yp, xp, out=buf[: len(xp)])
                torch.maximum(top, _scale(diff, 0), out=top)
            for k, (xp, yp) in enumerate(pieces):  # its codes
                diff = torch.sub(yp, xp, out=buf[: len(xp)])
                codes[k * step : k * step + len(xp)].copy_(diff.div_(top).round_())
            C = torch._int_mm(qa, codes[: len(x)]).float().mul_(sa[:, None]).mul_(top[None, :])
            out = C if out is None else out.add_(C)
        return out


def _scale(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The largest magnitude along ``dim`` over 127 (at least float32's smallest normal)."""
    top = torch.maximum(x.amax(dim), x.amin(dim).neg_()).float()
    return top.div_(127.0).clamp_min_(torch.finfo(torch.float32).tiny)


class Int8Rows:
    """A matrix's rows as int8 codes and a float32 scale per row (``row ≈ scale · code``, the largest
    entry of each row coded as ±127), for similarity scores ``F_A F_Bᵀ`` as one int8 product
    accumulated exactly in int32 (``torch._int_mm``) and scaled once. Each factor is rounded to about
    0.4 % of its row's largest entry; the errors average out over a row's length, so a score is off by
    about 1 % of a typical score, which decides only between near-ties."""

    def __init__(self, F: torch.Tensor) -> None:
        if F.shape[1] > 2**31 // 127**2:
            raise ValueError(f"rows of {F.shape[1]} entries could overflow an int32 sum of int8 products")
        F = F.float()
        self.scale = (F.abs().amax(1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        self.codes = torch.round(F / self.scale).to(torch.int8)

    def scores(self, other: "Int8Rows") -> torch.Tensor:
        """``self · otherᵀ`` in float32."""
        return torch._int_mm(self.codes, other.codes.T).float().mul_(self.scale).mul_(other.scale.T)
