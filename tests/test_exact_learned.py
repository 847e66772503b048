"""Transforms that come out of learning (learned matching, Dirichlet refinement, refined universes) are
exact group elements: applied to a model in float64 they keep its function to ≤ 1e-10, like weight
matching's (the latents train in float32; the residual map is re-polarised in float64)."""

from __future__ import annotations

import pytest
import torch
from conftest import inputs_for
from test_matching import make
from test_widths import _gpt, _vit

from fedlmc.data.base import ArrayData, TokenData
from fedlmc.matching import learned_matching, weight_matching
from fedlmc.merging.universe import universe_merge
from fedlmc.merging.widths import into_universe
from fedlmc.options import Learning, Refinement, Universe
from fedlmc.symmetry import apply_transform, canonicalize


def _data(model, n=96):
    """Training batches of the model's kind (labels are arbitrary: only exactness is checked here)."""
    g = torch.Generator().manual_seed(5)
    cfg = model.config
    if cfg.arch == "gpt2":
        return TokenData(torch.randint(0, cfg.vocab_size, (n * 4,), generator=g), block_size=8)
    x = torch.randn(n, cfg.channels, cfg.image_size, cfg.image_size, generator=g)
    return ArrayData(x, torch.randint(0, 10, (n,), generator=g))


def _gap(a, b, x) -> float:
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


def _orthogonality(O: torch.Tensor) -> float:
    return float((O.T @ O - torch.eye(O.shape[1], dtype=O.dtype)).abs().max())


@pytest.mark.parametrize("arch", ["gpt2", "vit"])
@pytest.mark.parametrize("keep_layernorm", [False, True])
def test_learned_matching_returns_an_exact_symmetry(arch, keep_layernorm, record):
    A, B = make(arch, 0), make(arch, 1)  # float64, LayerNorm models with every parameter moved
    init = weight_matching(A, B, keep_layernorm=keep_layernorm)
    T = learned_matching(
        A, B, _data(A), init, Learning(steps=8, lr=0.05), keep_layernorm=keep_layernorm, progress=False
    )
    O = T["residual"]
    assert O.dtype == torch.float64 and float((O - init["residual"]).abs().max()) > 1e-4  # O really moved
    record(f"learned {arch}{' +LN' if keep_layernorm else ''}: |OᵀO − I|", _orthogonality(O), 1e-12)
    if keep_layernorm:
        ones = torch.ones(len(O), dtype=O.dtype)
        record(f"learned {arch} +LN: |O·1 − 1|", float((O @ ones - ones).abs().max()), 1e-12)
    x = inputs_for(A)
    record(
        f"learned {arch}{' +LN' if keep_layernorm else ''}: aligned B vs B (float64)",
        _gap(B, apply_transform(B, T), x),
        1e-10,
    )


@pytest.mark.parametrize("make_model", [_vit, _gpt])
@pytest.mark.parametrize("relax", ["ste", "sinkhorn"])
def test_refined_universe_transforms_are_exact_also_for_mixed_widths(make_model, relax, record):
    """Three models, one narrower: every refined transform maps its model into the universe exactly."""
    models = [
        canonicalize(make_model(0)),
        canonicalize(make_model(1)),
        canonicalize(make_model(2, d_model=16, n_head=2, d_ff=40, d_head=8)),
    ]
    _, Ts = universe_merge(
        models,
        refine=Refinement(data=_data(models[0]), steps=6, lr=0.05, relax=relax, check_every=0),
        universe=Universe(iterations=1, keep_layernorm=False),
    )
    assert all(T.info.get("relax", relax) == relax for T in Ts)
    x = inputs_for(models[0])
    arch = models[0].config.arch
    for i, (m, T) in enumerate(zip(models, Ts)):
        O = T.get("residual")  # the universe's anchor may keep its own coordinates (no residual map)
        if O is not None:
            record(f"refined {arch} model {i} (d={m.config.d_model}): |OᵀO − I|", _orthogonality(O), 1e-12)
        else:
            assert i == 0
        record(
            f"refined {arch} model {i} (d={m.config.d_model}): into universe vs model",
            _gap(m, into_universe(m, T), x),
            1e-10,
        )


def test_snapshots_are_the_shorter_runs_and_cosine_is_exact(record):
    """A 6-step run's snapshot at 3 steps is the 3-step run (same batches, constant rates); a cosine
    schedule gives another, still exact, element."""
    A, B = make("gpt2", 0), make("gpt2", 1)
    init = weight_matching(A, B)
    long = learned_matching(A, B, _data(A), init, Learning(steps=6, lr=0.05), snapshots=(3,), progress=False)
    short = learned_matching(A, B, _data(A), init, Learning(steps=3, lr=0.05), progress=False)
    snap = long.info["snapshots"][3]
    assert set(snap.elements) == set(short.elements)
    for k in short.elements:
        assert torch.equal(snap[k], short[k]), k
    assert float((long["residual"] - short["residual"]).abs().max()) > 1e-6  # the later steps moved O
    cos = learned_matching(A, B, _data(A), init, Learning(steps=6, lr=0.05, schedule="cosine"), progress=False)
    assert float((cos["residual"] - long["residual"]).abs().max()) > 1e-6
    record(
        "learned gpt2, cosine schedule: aligned B vs B (float64)",
        _gap(B, apply_transform(B, cos), inputs_for(A)),
        1e-10,
    )
    with pytest.raises(ValueError, match="schedule"):
        Learning(steps=1, schedule="linear")


def test_sinkhorn_is_doubly_stochastic_and_keeps_blocks():
    from fedlmc.matching.optimise import sinkhorn

    g = torch.Generator().manual_seed(0)
    S = sinkhorn(torch.randn(8, 8, generator=g, dtype=torch.float64) / 0.3)
    ones = torch.ones(8, dtype=torch.float64)
    # columns are normalised last (exact); rows after 20 alternations to well under a percent
    assert float((S.T @ ones - ones).abs().max()) < 1e-9 and float((S @ ones - ones).abs().max()) < 1e-3
    B = sinkhorn(torch.randn(8, 8, generator=g, dtype=torch.float64), block=4)
    assert float(B[:4, 4:].abs().max()) == 0.0 and float(B[4:, :4].abs().max()) == 0.0
    assert float((B @ ones - ones).abs().max()) < 1e-3
    perm = torch.eye(8, dtype=torch.float64)[[3, 1, 0, 2, 7, 6, 5, 4]]
    assert float((sinkhorn(perm / 0.1) - perm).abs().max()) < 0.01  # a 0/1 latent starts near its permutation


@pytest.mark.parametrize("arch", ["gpt2", "vit"])
def test_sinkhorn_learned_matching_returns_an_exact_symmetry(arch, record):
    A, B = make(arch, 0), make(arch, 1)
    init = weight_matching(A, B)
    T = learned_matching(
        A, B, _data(A), init, Learning(steps=6, lr=0.05, perm_lr=1.0, relax="sinkhorn"), progress=False
    )
    moved = [k for k in T.elements if T[k].dtype == torch.long and not torch.equal(T[k], init[k])]
    assert T.info["relax"] == "sinkhorn" and float((T["residual"] - init["residual"]).abs().max()) > 1e-4
    record(
        f"learned {arch}, sinkhorn ({len(moved)} permutations moved): aligned B vs B (float64)",
        _gap(B, apply_transform(B, T), inputs_for(A)),
        1e-10,
    )


def test_stopping_on_the_objective_returns_the_best_checked_alignment_exactly(record):
    """With ``check_every`` the refinement scores the aggregate (the merge at the models' weights, on the
    data's first batches) at the start and every few steps, returns the best-scoring alignment — the
    very element a run snapshotted at that step holds — and stops after ``patience`` checks without
    improvement."""
    from fedlmc.matching.optimise import Options, learn_alignments
    from fedlmc.matching.problem import canonical_state
    from fedlmc.symmetry import Transform, canonical_config

    A, B = make("gpt2", 0), make("gpt2", 1)
    data = _data(A)
    init = weight_matching(A, B)
    states = [canonical_state(m, torch.device("cpu"), torch.float32) for m in (A, B)]
    cfg = canonical_config(B.config)

    def run(rates, snapshots=(), steps=18, **kw):
        lr, perm_lr = rates
        opts = Options(
            Learning(steps=steps, lr=lr, perm_lr=perm_lr, batch_size=16, **kw), progress=False, snapshots=snapshots
        )
        return learn_alignments(
            states,
            cfg,
            [Transform(), init],
            data,
            fixed=0,
            sample_weights=lambda: [0.5, 0.5],
            opts=opts,
            check_weights=[0.5, 0.5],
        )

    # The case that matters is a best step that is neither the start nor the last check: rates high enough
    # that the merge's loss goes up again within 18 steps. Where that happens depends on the processor's
    # float32 arithmetic (these random-label batches give a wobbly descent), so the first of a few rates
    # whose best check is inside the run is the one tested.
    for rates in ((1.0, 10.0), (2.0, 20.0), (8.0, 80.0), (1.0, 40.0), (4.0, 40.0)):
        full = run(rates, check_every=3, patience=99, check_sigmas=0.0, snapshots=(3, 6, 9, 12, 15, 18))
        assert sorted(full.checks) == [0, 3, 6, 9, 12, 15, 18] and len(full.trace) == 18
        assert full.best_step == min(full.checks, key=lambda n: (full.checks[n], n))
        if 0 < full.best_step < 18:
            break
    assert 0 < full.best_step < 18, full.checks  # neither the start nor the last step
    for k, v in full.snapshots[full.best_step][1].items():  # the best step's elements, bit for bit
        assert torch.equal(full.elements[1][k], v), k
    # the start's score is the weight-matched merge's loss on the first batches, computed independently
    from fedlmc.merging.averaging import merge
    from fedlmc.train import loss_and_correct

    mid = merge([canonicalize(A).float(), apply_transform(canonicalize(B), init).float()], [0.5, 0.5])
    xs = [b for _, b in zip(range(4), data.batches(16))]
    with torch.no_grad():
        start = sum(float(loss_and_correct(mid(x), y)[0]) for x, y in xs) / len(xs)
    record("objective check at the start vs the weight-matched merge's loss", abs(full.checks[0] - start), 1e-4)
    # patience 1: the descent stops at the first check that does not improve on the best. With room for
    # 36 steps it must stop by step 18 (the full run's best came before its last check), on the same
    # trajectory as the full run
    short = run(rates, check_every=3, patience=1, check_sigmas=0.0, steps=36)
    worse = [
        n for n in sorted(short.checks) if n and short.checks[n] >= min(v for m, v in short.checks.items() if m < n)
    ]
    assert worse and len(short.trace) == worse[0] <= 18
    assert all(short.checks[n] == full.checks[n] for n in short.checks)
    T = Transform(short.elements[1])
    record("stopped on the objective: aligned B vs B (float64)", _gap(B, apply_transform(B, T), inputs_for(A)), 1e-10)
    # an improvement must be significant: no check is 10⁶ standard errors better, so the start is kept
    # (the weight-matched permutations exactly, its residual map through the float32 latent) and the
    # descent stops after ``patience`` checks
    strict = run(rates, check_every=3, patience=2, check_sigmas=1e6)
    assert strict.best_step == 0 and len(strict.trace) == 6 and sorted(strict.checks) == [0, 3, 6]
    for k, v in init.to(dtype=torch.float64).elements.items():
        got = strict.elements[1][k]
        assert torch.equal(got, v) if v.dtype == torch.long else torch.allclose(got, v, atol=1e-5), k
    # at the default 2 standard errors the kept step is one of the checks, and its elements are that step's
    usual = run(rates, check_every=3, patience=99, snapshots=(3, 6, 9, 12, 15, 18))
    assert usual.best_step in usual.checks and usual.checks[usual.best_step] <= usual.checks[0]
    if usual.best_step:
        for k, v in usual.snapshots[usual.best_step][1].items():
            assert torch.equal(usual.elements[1][k], v), k


def test_a_check_improves_only_by_more_than_its_standard_errors():
    """The paired rule: a lower mean loss counts only when the per-example differences' mean exceeds
    ``sigmas`` standard errors; at 0 any lower mean counts, and a single unit cannot be judged otherwise."""
    from fedlmc.matching.optimise import significantly_lower

    best = torch.tensor([2.0, 2.1, 1.9, 2.0])
    consistent = best - 0.01  # every example a little better: zero spread, significant
    noisy = best + torch.tensor([-0.30, 0.25, -0.20, 0.21])  # lower on average (−0.01) but by noise
    assert significantly_lower(consistent, best, 2.0)
    assert not significantly_lower(noisy, best, 2.0) and significantly_lower(noisy, best, 0.0)
    assert not significantly_lower(best + 0.01, best, 0.0)
    assert significantly_lower(torch.tensor([1.0]), torch.tensor([1.5]), 2.0)


@pytest.mark.parametrize("tau, sharp", [(0.01, True), (1.0, False)])
def test_the_relaxed_merge_operand_is_b_under_soft_maps(tau, sharp, record):
    """The relaxed merge: learned matching with Sinkhorn's soft maps keeps B's state under the final soft
    (doubly stochastic) maps. On a planted copy (B = A moved by a random group element, weight matching
    its exact start), sharp maps (τ = 0.01) round to the permutations, so the relaxed operand computes
    A's function; at τ = 1 the soft maps blur neurons and heads together and it does not. The hard
    transform stays an exact symmetry either way."""
    from fedlmc.matching import relaxed_model
    from fedlmc.symmetry import random_transform

    A = canonicalize(_gpt(2))
    B = apply_transform(A, random_transform(A, seed=4, groups=["heads", "ff"]))
    init = weight_matching(A, B)
    T = learned_matching(A, B, _data(A), init, Learning(steps=2, lr=1e-4, relax="sinkhorn", tau=tau), progress=False)
    x = inputs_for(A)
    record(f"relaxed merge τ={tau}: hard T, aligned B vs B", _gap(B, apply_transform(B, T), x), 1e-10)
    gap = _gap(A.float(), relaxed_model(B, T).float(), x)
    if sharp:
        record("relaxed operand at τ = 0.01 vs A (float32 state)", gap, 1e-4)
    else:
        assert gap > 1e-2, gap
    with pytest.raises(ValueError, match="sinkhorn"):
        relaxed_model(B, learned_matching(A, B, _data(A), init, Learning(steps=1), progress=False))


def test_reproduce_s_relaxed_row_starts_at_b_itself():
    """``learned-relaxed``'s curve is λ·A + (1 − λ)·S(B) inside and the real B at λ = 0 (its barrier is
    against the real endpoints); ``learned-sinkhorn`` (the hard maps) is learned alongside."""
    from fedlmc.reproduce import pair_curves

    A, B = _gpt(0), _gpt(1)

    class Splits:
        train = test = _data(A)

    out = pair_curves(
        A.float(),
        B.float(),
        Splits,
        ["average", "learned-relaxed"],
        learned_steps=2,
        progress=False,
        log=lambda s: None,
    )
    assert set(out) == {"average", "learned-relaxed"}
    van, rel = out["average"]["curve"], out["learned-relaxed"]["curve"]
    assert rel["loss"][0] == pytest.approx(van["loss"][0], abs=1e-4)  # B's loss (averaging's λ = 0 is B too)
    assert rel["loss"][-1] == pytest.approx(van["loss"][-1], abs=1e-4)  # A's


def test_reproduce_reuses_a_pair_s_curves_from_any_earlier_set_of_methods(tmp_path):
    """``fedlmc reproduce`` with more methods than an earlier run finds that run's curves for the same
    models and learned steps (written under the earlier set's key) and computes only the rest; other
    models or another learned budget are not taken."""
    import json

    from fedlmc.commands import _cached_pair, _pair_key

    ident = [0, 12.5, 1, 13.0]
    (tmp_path / f"pair-p-0-1-{_pair_key(ident, ['average', 'learned'], 300)}.json").write_text(
        json.dumps({"average": {"barrier": 1.0}, "learned": {"barrier": 0.2}})
    )
    (tmp_path / f"pair-p-0-1-{_pair_key(ident, ['wm-orth-factored'], 100)}.json").write_text(
        json.dumps({"wm-orth-factored": {"barrier": 0.5}})
    )
    got = _cached_pair(tmp_path, "p", (0, 1), ident, ["average", "learned", "wm-orth-factored", "learned-relaxed"], 300)
    assert got == {"average": {"barrier": 1.0}, "learned": {"barrier": 0.2}}
    assert _cached_pair(tmp_path, "p", (0, 1), [0, 12.5, 1, 14.0], ["average"], 300) == {}
