"""The fast paths of weight matching give the exact path's answers: the sparse candidate assignment,
the one-pass objective / residual cross-covariance, one descent for the paper and identity starts."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed
from scipy.optimize import linear_sum_assignment

from fedlmc.matching import weight_matching
from fedlmc.matching.problem import Fixed, Problem, canonical_state
from fedlmc.matching.solvers import Int8Blocks, Int8Rows, sparse_assignment
from fedlmc.matching.steps import similarity
from fedlmc.matching.weight import identity_elements
from fedlmc.models import from_preset
from fedlmc.options import Matching
from fedlmc.symmetry import apply_transform, canonical_config, canonicalize, random_transform


def _dense(score: torch.Tensor) -> torch.Tensor:
    rows, cols = linear_sum_assignment(score.double().numpy(), maximize=True)
    perm = torch.empty(len(rows), dtype=torch.long)
    perm[torch.as_tensor(rows)] = torch.as_tensor(cols)
    return perm


@pytest.mark.parametrize("seed", range(5))
def test_sparse_assignment_equals_the_dense_solver_on_matching_scores(seed):
    """Scores as matching sees them (a hidden permutation plus noise as large as the signal): the
    candidate solver returns the dense solver's optimum."""
    g = torch.Generator().manual_seed(seed)
    n = 400
    truth = torch.randperm(n, generator=g)
    score = torch.randn(n, n, generator=g, dtype=torch.float64)
    score[torch.arange(n), truth] += 2.0
    assert len(torch.unique(score.argmax(1))) < n  # the argmax shortcut does not apply: a real solve
    assert torch.equal(sparse_assignment(score, 32), _dense(score))


def test_sparse_assignment_never_scores_below_the_current_assignment():
    g = torch.Generator().manual_seed(0)
    n = 300
    score = torch.randn(n, n, generator=g, dtype=torch.float64)  # no structure at all: the worst case
    current = torch.randperm(n, generator=g)
    perm = sparse_assignment(score, 4, current)
    value = lambda p: float(score[torch.arange(n), p].sum())  # noqa: E731
    assert sorted(perm.tolist()) == list(range(n))
    assert value(perm) >= value(current)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_candidate_graph_on_host_arrays_equals_torchs_reductions(dtype):
    """On CPU float tensors the candidate graph's argmax, sampled thresholds and masks are numpy's: the
    same graph as torch's ``argmax``, ``topk`` and comparisons give, ties included (scores on a grid of
    a few values, so rows share their best column and the thresholds sit on ties)."""
    from fedlmc.matching.solvers import _obvious, candidate_graph, rank_threshold

    g = torch.Generator().manual_seed(0)
    n, k = 600, 16
    score = torch.randint(0, 40, (n, n), generator=g).to(dtype)
    current = torch.randperm(n, generator=g)
    graph = candidate_graph(score, k, current)
    s = 8 * k
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:s]
    q = round(k * s / n)
    row = score[:, idx].topk(q, dim=1).values[:, -1]
    col = score[idx].topk(q, dim=0).values[-1]
    assert torch.equal(rank_threshold(score, k, 1), row) and torch.equal(rank_threshold(score, k, 0), col)
    mask = (score >= row[:, None]) | (score >= col[None, :])
    mask[torch.arange(n), current] = True
    assert graph.nnz == int(mask.sum()) and graph.has_canonical_format  # CSR built from its own row-major order
    dense = torch.from_numpy(graph.toarray())
    assert torch.equal(dense > 0, mask)
    assert torch.allclose(dense[mask], (score.max() - score + 1.0).double()[mask])
    torchs = candidate_graph(score.bfloat16(), k, current)  # not a host array: torch's own reductions
    assert (torchs != graph).nnz == 0 and torchs.nnz == graph.nnz
    perm = torch.randperm(n, generator=g)
    planted = score.clone()
    planted[torch.arange(n), perm] = 100.0
    assert _obvious(score) is None and torch.equal(_obvious(planted), perm)
    assert torch.equal(_obvious(-planted, maximize=False), perm)
    tied = torch.cat([planted, planted], 1)  # each row's best column twice: the first one counts, as in torch
    assert torch.equal(_obvious(tied), tied.argmax(1)) and torch.equal(_obvious(tied), perm)


def _wide_pair(seed: int = 0):
    """A gpt2 of FF width 256 (so 16 candidates is the sparse path) and a planted, noisy copy."""
    torch.manual_seed(seed)
    A = canonicalize(
        perturbed(
            from_preset("gpt2-tiny", n_layer=2, d_model=32, n_head=4, d_ff=256, vocab_size=20, block_size=16), seed, 0.2
        )
    )
    B = apply_transform(A, random_transform(A, seed=seed + 1, groups=["residual", "heads", "ff"]))
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for p in B.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return A, B


def test_the_candidate_path_finds_the_exact_paths_permutations_on_a_planted_model(monkeypatch):
    import fedlmc.matching.steps as steps

    monkeypatch.setattr(steps, "DENSE_UP_TO", 0)  # FF groups this small are solved densely otherwise
    A, B = _wide_pair()
    fast = weight_matching(A, B, Matching(ff_candidates=16))
    exact = weight_matching(A, B, Matching(ff_candidates=None))
    ff = [k for k in exact.elements if k.startswith("ff.")]
    assert ff and all(
        torch.equal(fast[k], exact[k]) for k in exact.elements if not k.startswith(("residual", "qk", "ov"))
    )
    assert torch.allclose(fast["residual"], exact["residual"], atol=1e-10)
    assert fast.info["objective"] == pytest.approx(exact.info["objective"], rel=1e-12)


def test_profiling_reports_the_ff_candidate_graphs_apart_from_the_solves():
    """A profiled matching of two independent models whose FF layers are solved on candidates names the
    candidate graphs (built from the dense scores) and the sparse solves as two sections; outside
    ``profiling()`` nothing is collected."""
    from fedlmc.matching import profile

    kw = dict(n_layer=2, d_model=32, n_head=4, d_ff=256, vocab_size=20, block_size=16)
    torch.manual_seed(0)
    A = from_preset("gpt2-tiny", **kw)
    torch.manual_seed(1)
    B = from_preset("gpt2-tiny", **kw)
    with profile.profiling() as prof:
        T = weight_matching(A, B, Matching(ff_candidates=16, keep_identity=False))
    assert T.info["ff_steps"]["solved"] >= 2  # 256 neurons > 4 × 16 candidates: each layer's graph is built
    assert prof["FF candidate graphs"] > 0 and prof["assignment solves"] > 0 and prof["FF similarity products"] > 0
    assert profile._totals is None


@pytest.mark.parametrize(
    "precision, dtype, expected",
    [("int8", torch.float32, "int8"), ("bfloat16", torch.float32, "bfloat16"), ("exact", torch.float64, "float64")],
)
def test_weight_matching_records_what_its_ff_scores_were(precision, dtype, expected):
    A, B = _wide_pair()
    T = weight_matching(A, B, Matching(precision=precision, dtype=dtype, descent_iterations=1))
    assert T.info["ff_scores"] == expected


def test_one_pass_objective_and_cross_covariance_match_the_direct_ones():
    """The descent's trace comes from ``moving_objective`` on the transformed B; its last value must be
    the objective of the returned elements computed from scratch."""
    A, B = _wide_pair(1)
    T = weight_matching(A, B, Matching(keep_identity=False, descent_iterations=3))
    P = Problem(
        canonical_state(A, torch.device("cpu"), torch.float64),
        canonical_state(B, torch.device("cpu"), torch.float64),
        canonical_config(B.config),
    )
    direct = P.objective(dict(T.elements))
    assert T.info["objective"]["paper"] == pytest.approx(direct, rel=1e-12)
    trace = T.info["trace"]["paper"]
    assert len(trace) >= 2 and all(
        b <= a for a, b in zip(trace[:-2], trace[1:-1])
    )  # descends (bar a rolled-back last step)
    assert min(trace) == pytest.approx(direct, rel=1e-6)


@pytest.mark.parametrize("groups", [("residual", "heads", "qk", "ov", "ff"), ("residual", "heads")])
def test_the_rest_objective_from_distances_equals_the_cross_covariances_one(groups, record):
    """``Problem.rest_value`` (the descent's last objective, from ``‖A − T(B)‖²`` directly) is the
    cross-covariances' value of the same elements, for random group elements (invertible gauges, which
    change B's norms, too), in float64."""
    A, B = _wide_pair(4)
    cpu = torch.device("cpu")
    P = Problem(
        canonical_state(A, cpu, torch.float64), canonical_state(B, cpu, torch.float64), canonical_config(B.config)
    )
    els = dict(random_transform(A, seed=5, groups=groups).elements)
    O = els["residual"]
    direct, cross = P.rest_value(els, P.rotated(O, ff=False)), P.cross(els, "rest").value(O)
    record(
        f"rest objective: distances vs cross-covariances ({len(groups)} kinds of element)",
        abs(direct - cross) / abs(cross),
        1e-10,
    )
    assert direct > 0


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_the_ff_cross_after_a_few_units_moved_is_the_one_computed_afresh(preset, dtype, rtol, record):
    """After an FF permutation that moved a few units per layer, ``Problem.cross(.., "ff")`` is the last
    one plus the moved units' terms (``_moved_units_cross``): its constant, G and M are those of a
    fresh problem's full products, for GPT-2 (fc1 rows and bias, fc2 columns) and Llama (gate, up,
    down). Moving more than a third of a layer's units takes the full products."""
    torch.manual_seed(0)
    kw = dict(n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=20, block_size=16)
    cfg = from_preset(preset, **kw).config
    A, B = from_preset(preset, **kw), from_preset(preset, **kw)
    cpu = torch.device("cpu")
    sa, sb = canonical_state(A, cpu, dtype), canonical_state(B, cpu, dtype)
    cfg = canonical_config(cfg)
    problem = lambda: Problem(sa, sb, cfg, precision="exact")  # noqa: E731
    P = problem()
    groups = P.spec.layer_groups("ff")
    g = torch.Generator().manual_seed(1)
    first = {x.name: torch.randperm(x.size, generator=g) for x in groups}
    P.cross(first, "ff")
    second = {}
    for x in groups:  # a few units swap partners
        p = first[x.name].clone()
        i = torch.randperm(x.size, generator=g)[:6]
        p[i] = p[i.roll(1)]
        second[x.name] = p
    assert P.fixed.unit_layout is not None
    calls = []
    full = Problem._moved_units_cross
    P._moved_units_cross = lambda *a: calls.append(1) or full(P, *a)
    moved, fresh = P.cross(second, "ff"), problem().cross(second, "ff")
    assert calls and moved is not fresh
    record(
        f"FF cross after a few moved units vs afresh ({preset}, {dtype})",
        abs(moved.constant - fresh.constant) / fresh.constant,
        rtol,
    )
    assert moved.constant == pytest.approx(fresh.constant, rel=rtol)
    assert torch.allclose(moved.G, fresh.G, rtol=rtol, atol=rtol * float(fresh.G.abs().max()))
    assert torch.allclose(moved.M, fresh.M, rtol=rtol, atol=rtol * float(fresh.M.abs().max()))
    many = {x.name: torch.randperm(x.size, generator=g) for x in groups}
    assert P._moved_units_cross(P._last_cross["ff"], [many.get(n) for n in P.fixed.part_groups["ff"]]) is None


def test_a_descent_with_the_moved_units_cross_is_the_one_without(monkeypatch):
    """Weight matching of an independent pair in float64, once as it runs (later iterations take the FF
    cross from the moved units) and once with every FF cross computed afresh: the same permutations,
    residual map and objective trace."""
    torch.manual_seed(0)
    kw = dict(n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=20, block_size=16)
    A, B = from_preset("gpt2-tiny", **kw), from_preset("gpt2-tiny", **kw)
    m = Matching(keep_identity=False, dtype=torch.float64, descent_tol=1e-6, descent_iterations=8)
    used = []
    moved = Problem._moved_units_cross
    monkeypatch.setattr(Problem, "_moved_units_cross", lambda self, *a: used.append(moved(self, *a)) or used[-1])
    T = weight_matching(A, B, m)
    monkeypatch.setattr(Problem, "_moved_units_cross", lambda self, *a: None)
    afresh = weight_matching(A, B, m)
    assert any(c is not None for c in used) and T.info["iterations"] == afresh.info["iterations"]
    assert all(torch.equal(T[k], afresh[k]) for k in T.elements if not T[k].is_floating_point())
    assert torch.allclose(T["residual"], afresh["residual"], atol=1e-10)
    assert T.info["trace"]["paper"] == pytest.approx(afresh.info["trace"]["paper"], rel=1e-10)


def test_a_parts_cross_covariances_are_the_identitys_while_its_own_groups_are_the_identity():
    """The FF part's ``Cross`` depends on the FF permutations only: with those the identity and the
    head permutations and gauges moved, ``Problem.cross`` returns the identity's (no new products), and
    its value is the one computed afresh; the rest's part, which the gauges act on, is computed anew."""
    A, B = _wide_pair(4)
    cpu = torch.device("cpu")
    P = Problem(
        canonical_state(A, cpu, torch.float64), canonical_state(B, cpu, torch.float64), canonical_config(B.config)
    )
    P.objective({})  # the identity's crosses, as weight matching computes them first
    identity = {part: P._identity_cross[part] for part in ("ff", "rest")}
    els = dict(random_transform(A, seed=5, groups=("residual", "heads", "qk", "ov")).elements)
    els.update({g.name: torch.arange(g.size) for g in P.spec.layer_groups("ff")})
    O = els["residual"]
    assert P.cross(els, "ff") is identity["ff"]
    assert P.cross(els, "rest") is not identity["rest"]
    fresh = Problem(
        canonical_state(A, cpu, torch.float64), canonical_state(B, cpu, torch.float64), canonical_config(B.config)
    )
    permuted_ff = dict(els, **{g.name: torch.arange(g.size).flip(0) for g in P.spec.layer_groups("ff")})
    fresh.cross(permuted_ff, "ff")  # another FF permutation first, so the identity's is computed anew below
    assert fresh.cross(els, "ff").value(O) == pytest.approx(identity["ff"].value(O), rel=1e-12)


def test_the_identity_is_the_do_no_harm_candidate_and_a_shared_init_stays_put():
    A, B = _wide_pair(2)
    T = weight_matching(A, B)  # B is A scrambled: the identity transform is hopeless
    assert set(T.info["iterations"]) == {"paper"} and T.info["chosen"] == "paper"
    assert set(T.info["objective"]) == {"paper", "identity"}
    alone = weight_matching(A, B, Matching(keep_identity=False))  # the same descent, no candidate beside it
    assert set(alone.info["objective"]) == {"paper"} and alone.info["trace"]["paper"] == T.info["trace"]["paper"]
    near = canonicalize(A)  # a shared init, slightly moved: the identity start is in the running
    with torch.no_grad():
        for p in near.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    T2 = weight_matching(A, near)  # whichever start wins, it is at least as good as the identity
    assert T2.info["objective"][T2.info["chosen"]] <= T2.info["objective"]["identity"]
    assert all(torch.equal(v, torch.arange(len(v))) for k, v in T2.elements.items() if k.startswith(("ff.", "heads.")))


@pytest.mark.parametrize("seed", range(3))
def test_bfloat16_products_leave_the_objective_near_the_identity_exact(seed, record):
    """A reply trained a little from the model it is aligned to (B = A + 2 % noise) is where
    ``Matching.min_gain`` compares gains of a few percent: with bfloat16 factors the objective there
    must stay as exact as the distances. At the identity it is the distances themselves (bfloat16
    cross-covariances alone were off by 13-50 % of it on these pairs), and under a small rotation
    (gauges beside it) the products' rounding enters only through the change (off by up to 17 %)."""
    states, cfg = _near_pair(seed)
    ref = Problem(*states[torch.float64], cfg)
    fast = Problem(*states[torch.float32], cfg, "bfloat16")
    cpu, g = torch.device("cpu"), torch.Generator().manual_seed(seed + 3)
    # a small rotation and gauges near the identity, as fitting a reply's noise finds them
    near = {
        k: v + 3e-3 * torch.randn(v.shape, generator=g, dtype=v.dtype)
        for k, v in identity_elements(ref.cfg, cpu, torch.float64).items()
        if v.is_floating_point() and k != "residual"
    }
    S = torch.randn(64, 64, dtype=torch.float64, generator=g)
    near["residual"] = torch.linalg.matrix_exp(3e-3 * (S - S.T))
    off = {
        name: abs(fast.objective({k: v.float() for k, v in els.items()}) - ref.objective(els)) / ref.objective(els)
        for name, els in (("identity", {}), ("near", near))
    }
    record(f"bfloat16 objective at the identity, relative error (seed {seed})", off["identity"], 1e-6)
    record(f"bfloat16 objective near the identity, relative error (seed {seed})", off["near"], 5e-3)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_int8_blocks_give_the_difference_cross_covariance_within_its_rounding(seed, transposed, monkeypatch, record):
    """``Int8Blocks.delta_cross``: ``Aᵀ(B − A)`` from int8 codes, over several blocks of rows and pieces
    of the buffer (or in the transposed layout, a tensor whose residual axis is its first), with
    columns at very different scales: about 1 % of the product off, in both layouts."""
    monkeypatch.setattr(Int8Blocks, "ROWS", 96)
    monkeypatch.setattr(Int8Blocks, "CHUNK", 1000)
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(300, 40, generator=g) * torch.logspace(-2, 1, 40)
    B = A + 0.02 * torch.randn(300, 40, generator=g) * A.std(0)
    if transposed:
        A, B = A.T.contiguous().T, B.T.contiguous().T
    codes = Int8Blocks(A)
    assert codes.transposed == transposed and len(codes.blocks) == (1 if transposed else 4)
    exact = A.double().T @ (B.double() - A.double())
    err = float((codes.delta_cross(A, B).double() - exact).norm() / exact.norm())
    layout = "transposed" if transposed else "rows"
    record(f"int8 blocks' difference product, relative error ({layout}, seed {seed})", err, 0.03)


def _near_pair(seed: int, noise: float = 0.02):
    """A d-64 model in float32 and a copy with ``noise`` of each tensor's standard deviation added, as
    canonical states (float32 and float64) and their config."""
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, d_model=64, n_head=4, d_ff=256, vocab_size=512, block_size=64)
    A = canonicalize(perturbed(from_preset("gpt2-tiny", **cfg), seed, 0.2))
    g = torch.Generator().manual_seed(seed + 2)
    B = canonicalize(A)
    with torch.no_grad():
        for p in B.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    cpu = torch.device("cpu")
    states = {dt: (canonical_state(A, cpu, dt), canonical_state(B, cpu, dt)) for dt in (torch.float32, torch.float64)}
    return states, canonical_config(B.config)


@pytest.mark.parametrize("seed", range(3))
def test_difference_products_of_a_near_reply_turn_the_residual_map_as_float64_does(seed, record):
    """A reply near A (2 % noise): its cross-covariances as ``AᵀA + Aᵀ(B − A)`` (A's Grams from its
    bfloat16 copy, the difference in int8) against float64. What turns the residual map, the skew part
    of each residual step's matrix, is off by about 1 % (bfloat16 products of A and B: 10-30 %), and the
    objective near the identity stays as exact as the distances."""
    states, cfg = _near_pair(seed)
    (A32, B32), (A64, B64) = states[torch.float32], states[torch.float64]
    ref = Problem(A64, B64, cfg)
    fast = Problem(A32, B32, cfg, "bfloat16", Fixed(A32, cfg, "bfloat16", delta=True))
    plain = Problem(A32, B32, cfg, "bfloat16")
    assert fast.delta_parts == {"anchor"} and not plain.delta_parts

    def skew_error(P, part):
        got = P.M_anchor if part == "anchor" else P.cross({}, part).M
        want = ref.M_anchor if part == "anchor" else ref.cross({}, part).M
        E, W = got.double() - want, want - want.T
        return float((E - E.T).norm() / W.norm())

    for part in ("anchor", "ff", "rest"):
        err, bf16 = skew_error(fast, part), skew_error(plain, part)
        record(f"difference products' skew part, relative error ({part}, seed {seed})", err, 0.03)
        assert err < bf16 / 4
    assert fast.delta_parts == {"anchor", "ff", "rest"}
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(64, 64, dtype=torch.float64, generator=g)
    O = torch.linalg.matrix_exp(3e-3 * (S - S.T))
    off = abs(fast.objective({"residual": O.float()}) - ref.objective({"residual": O})) / ref.objective({"residual": O})
    record(f"difference products' objective near the identity, relative error (seed {seed})", off, 1e-4)


def test_a_far_reply_keeps_the_direct_products_bit_for_bit():
    """A reply that is not near A (another model) takes the direct products even where the difference
    form is on: its crosses are those of a ``Fixed`` without it, exactly."""
    states, cfg = _near_pair(0)
    A32, B32 = states[torch.float32][0], _near_pair(1, noise=0.0)[0][torch.float32][1]
    on = Problem(A32, B32, cfg, "bfloat16", Fixed(A32, cfg, "bfloat16", delta=True))
    off = Problem(A32, B32, cfg, "bfloat16")
    assert not on.delta_parts
    for part in ("ff", "rest"):
        x, y = on.cross({}, part), off.cross({}, part)
        assert torch.equal(x.G, y.G) and torch.equal(x.M, y.M) and x.constant == y.constant
    assert torch.equal(on.M_anchor, off.M_anchor) and on.anchor_objective(None) == off.anchor_objective(None)
    assert not on.delta_parts


@pytest.mark.parametrize("turn", [3e-3, 0.5])
def test_an_exact_rotation_near_the_identity_takes_only_its_correction_from_the_fast_copy(turn, record):
    """``rotated(O, exact=True)`` with bfloat16 factors: for an O near the identity, ``B + B(O − I)`` with
    the correction from the bfloat16 copy is within 5e-5 of float64's rotation (the bfloat16 rotation:
    ~2e-3); a large O is rotated in float32 (1e-6)."""
    states, cfg = _near_pair(0)
    (A32, B32), (A64, B64) = states[torch.float32], states[torch.float64]
    g = torch.Generator().manual_seed(1)
    S = torch.randn(64, 64, dtype=torch.float64, generator=g)
    O = torch.linalg.matrix_exp(turn * (S - S.T) / 64**0.5)
    fast = Problem(A32, B32, cfg, "bfloat16")
    want = Problem(A64, B64, cfg).rotated(O, ff=False, exact=True)

    def error(exact: bool) -> float:
        got = fast.rotated(O.float(), ff=False, exact=exact)
        return max(float((got[k].double() - w).norm() / w.norm().clamp_min(1e-30)) for k, w in want.items())

    bound = 5e-5 if turn < 0.1 else 1e-6
    record(f"exact rotation with bfloat16 factors, turn {turn}, relative error", error(True), bound)
    assert error(False) > 1e-3  # the bfloat16 rotation's rounding, which the exact one avoids


def test_a_universe_iteration_takes_difference_products_for_near_replies(monkeypatch):
    """Where the difference form is allowed (here forced on a d-64 model) a universe iteration's near
    replies take it, and choose as float32 products do: the same kept identity or transform, the gains
    ``min_gain`` compares within 1 % of their size."""
    import fedlmc.matching.problem as problem_module

    monkeypatch.setattr(problem_module, "delta_crosses", lambda *a: True)
    torch.manual_seed(0)
    cfg = dict(n_layer=2, d_model=64, n_head=4, d_ff=256, vocab_size=512, block_size=64)
    A = canonicalize(perturbed(from_preset("gpt2-tiny", **cfg), 0, 0.2)).float()
    replies = []
    for seed in range(3):
        g = torch.Generator().manual_seed(10 + seed)
        B = canonicalize(A)
        with torch.no_grad():
            for p in B.parameters():
                p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g, dtype=p.dtype))
        replies.append(B)
    reuse: dict = {}
    for B in replies:
        T = weight_matching(A, B, Matching(min_gain=0.5, dtype=torch.float32), reuse=reuse)
        U = weight_matching(A, B, Matching(min_gain=0.5, dtype=torch.float32, precision="exact"))
        assert T.info["difference_products"] == ["anchor", "ff", "rest"] and U.info["difference_products"] == []
        assert T.info["chosen"] == U.info["chosen"]
        gains = [1 - X.info["objective"]["paper"] / X.info["objective"]["identity"] for X in (T, U)]
        assert gains[0] == pytest.approx(gains[1], rel=1e-2)


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_the_fast_path_finds_the_exact_paths_permutations_on_a_planted_model_at_either_fast_precision(precision):
    """bfloat16 factors or int8 FF scores, sampled candidate thresholds, the looser default tolerance
    and the gauges-only finish (the speed path at gpt2-small size) against float32 products, the
    dense solver and a tight tolerance: the same permutations, residual maps within float32 Procrustes
    noise, objectives within the fast factors' rounding."""
    A, B = _wide_pair(3)
    A, B = A.float(), B.float()
    fast = weight_matching(A, B, Matching(precision=precision, ff_candidates=16))  # 256 FF neurons: candidates
    exact = weight_matching(
        A, B, Matching(precision="exact", ff_candidates=None, descent_tol=1e-6, descent_iterations=30)
    )
    perms = [k for k, v in exact.elements.items() if not v.is_floating_point()]
    assert any(k.startswith("ff.") for k in perms)
    assert all(torch.equal(fast[k], exact[k]) for k in perms)
    assert (fast["residual"] - exact["residual"]).abs().max() < 1e-2
    f, e = fast.info["objective"][fast.info["chosen"]], exact.info["objective"][exact.info["chosen"]]
    assert f == pytest.approx(e, rel=1e-2)


@pytest.mark.parametrize("seed", range(3))
def test_int8_rows_scores_are_the_float32_product_within_their_rounding(seed):
    """``Int8Rows`` scores of rows at very different scales: exact int32 sums of the codes, scaled once
    (so within 1e-6 of the dequantised rows' product), and within 2 % (Frobenius) of the float32
    product, as the docstring says; the int32 sum's overflow is refused."""
    g = torch.Generator().manual_seed(seed)
    FA = torch.randn(300, 257, generator=g) * torch.logspace(-3, 2, 300)[:, None]
    FB = torch.randn(200, 257, generator=g) * torch.logspace(1, -2, 200)[:, None]
    qa, qb = Int8Rows(FA), Int8Rows(FB)
    S = qa.scores(qb)
    assert S.dtype == torch.float32 and S.shape == (300, 200)
    dequantised = (qa.codes.double() * qa.scale.double()) @ (qb.codes.double() * qb.scale.double()).T
    assert torch.allclose(S.double(), dequantised, rtol=1e-6, atol=0)
    exact = FA.double() @ FB.double().T
    relative = (S.double() - exact).norm(dim=1) / exact.norm(dim=1)  # per row: the rows' scales differ by 10⁵
    assert relative.max() < 0.02
    assert torch.equal(similarity(qa, FB), S)
    with pytest.raises(ValueError, match="overflow"):
        Int8Rows(torch.ones(2, 2**31 // 127**2 + 1))


def test_auto_precision_takes_int8_scores_only_on_a_cpu_with_int8_but_no_bfloat16_dot_products(monkeypatch):
    """Precision "auto": bfloat16 factors where the CPU has native bfloat16; int8 FF scores where it has native
    int8 dot products only; float32 otherwise; never for float64 problems or small FF groups. The
    problem built by "auto" then holds A's FF features as ``Int8Rows`` and matches as "int8" does."""
    from fedlmc.matching import solvers
    from fedlmc.matching.problem import Fixed

    cpu = torch.device("cpu")
    for bf16, int8, fast, scores in [(True, True, torch.bfloat16, False), (False, True, torch.float32, True),
                                     (False, False, torch.float32, False)]:  # fmt: skip
        monkeypatch.setattr(solvers, "_native_bf16", lambda bf16=bf16: bf16)
        monkeypatch.setattr(solvers, "_native_int8", lambda int8=int8: int8)
        assert solvers.score_dtype(torch.float32, cpu, 1024) == fast
        assert solvers.int8_scores(torch.float32, cpu, 1024) is scores
        assert not solvers.int8_scores(torch.float64, cpu, 1024) and not solvers.int8_scores(torch.float32, cpu, 512)
    monkeypatch.setattr(solvers, "int8_scores", lambda *a: True)  # a small model standing in for a large one
    monkeypatch.setattr("fedlmc.matching.problem.int8_scores", lambda *a: True)
    A, B = _wide_pair(3)
    A, B = A.float(), B.float()
    F = Fixed(canonical_state(A, torch.device("cpu"), torch.float32), canonical_config(A.config), "auto")
    assert F.int8 and F.fast == torch.float32
    groups = F.spec.layer_groups("ff")
    coded = F.score_features(groups)
    assert len(coded) == len(groups) == 2 and all(isinstance(v, Int8Rows) for v in coded.values())
    auto = weight_matching(A, B, Matching())
    int8 = weight_matching(A, B, Matching(precision="int8"))
    assert all(torch.equal(auto[k], int8[k]) for k in int8.elements)


def test_precision_is_checked():
    with pytest.raises(ValueError, match="precision"):
        Matching(precision="half")


def test_refinements_hard_permutations_from_the_pool_are_each_latents_own_optimum():
    """``optimise.hard_all`` solves every latent (whole groups, and "within" groups block by block) in a
    thread pool, the obvious cases on the caller's thread: each answer is that latent's dense optimum,
    and a "within" answer keeps every unit in its block."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from fedlmc.matching.optimise import hard_all

    g = torch.Generator().manual_seed(0)
    drifted = torch.randn(64, 64, generator=g)  # many rows share an argmax: a real solve
    obvious = torch.eye(16)[torch.randperm(16, generator=g)] + 0.01 * torch.randn(16, 16, generator=g)
    within = torch.randn(12, 12, generator=g)
    lat = [
        None,
        SimpleNamespace(p={"ff.0": drifted, "heads.0": obvious}, blocks={}),
        SimpleNamespace(p={"kv.0": within, "ff.0": drifted.T.contiguous()}, blocks={"kv.0": 4}),
    ]
    with ThreadPoolExecutor(2) as pool:
        got = hard_all(lat, pool)
    assert got[0] is None
    assert torch.equal(got[1]["ff.0"], _dense(drifted)) and torch.equal(got[1]["heads.0"], _dense(obvious))
    assert torch.equal(got[2]["ff.0"], _dense(drifted.T))
    blocks = torch.cat([_dense(within[i : i + 4, i : i + 4]) + i for i in range(0, 12, 4)])
    assert torch.equal(got[2]["kv.0"], blocks) and bool((blocks // 4 == torch.arange(12) // 4).all())


def test_a_universe_iteration_builds_the_fixed_models_side_once_and_changes_nothing():
    """``reuse``: every model of a universe iteration aligns to one A, whose side of the problem is
    built once; the transforms and objectives equal fresh matchings' exactly, and a tensor that is zero
    in both models (a canonical bias) adds nothing to the objective, with or without reuse."""
    A, B = _wide_pair(5)
    C = _wide_pair(6)[1]
    with torch.no_grad():
        for m in (A, B, C):
            m.blocks[0].attn.o.bias.zero_()  # an anchor: no unit group touches it
    reuse: dict = {}
    got = [weight_matching(A, X, reuse=reuse) for X in (B, C)]
    fresh = [weight_matching(A, X) for X in (B, C)]
    assert len(reuse) == 1
    ((model, F),) = reuse.values()
    assert model is A and weight_matching(A, B, reuse=reuse) and reuse[next(iter(reuse))][1] is F
    for T, U in zip(got, fresh):
        assert T.info["objective"] == U.info["objective"]
        assert all(torch.equal(T[k], U[k]) for k in U.elements)
    weight_matching(B, C, reuse=reuse)  # another A replaces it: never served from the dict
    assert reuse[next(iter(reuse))][0] is B
    cpu = torch.device("cpu")
    a, b = canonical_state(A, cpu, torch.float64), canonical_state(B, cpu, torch.float64)
    direct = sum(float((a[k] - b[k]).pow(2).sum() / a[k].pow(2).sum()) for k in a if a[k].pow(2).sum() > 0)
    assert Problem(a, b, canonical_config(B.config)).objective({}) == pytest.approx(direct, rel=1e-10)
