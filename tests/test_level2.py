"""The semi-permutation level's FF scales (``ffscale.{l}``: ReLU positive, SwiGLU's up signed, none for
GELU): exact actions in float64, composition and inverses with the other groups, and weight matching's
closed-form scale step on planted copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import inputs_for, perturbed

from fedlmc.matching.scales import best_scales
from fedlmc.models import from_preset
from fedlmc.options import Matching
from fedlmc.symmetry import Transform, apply_transform, canonicalize, random_transform, spec_for
from fedlmc.symmetry.random import invert_transform

BOUND = 1e-10
SMALL = {
    "gpt2-tiny-relu": dict(n_layer=2, d_model=24, n_head=3, d_ff=40, vocab_size=17, block_size=16),
    "vit-tiny-relu": dict(n_layer=2, d_model=24, n_head=3, d_ff=40, image_size=12, patch_size=4),
    "llama-tiny": dict(n_layer=2, d_model=24, n_head=4, n_kv_head=2, d_ff=40, vocab_size=17, block_size=16),
}


def make(preset: str, seed: int = 0):
    torch.manual_seed(seed)
    return canonicalize(perturbed(from_preset(preset, **SMALL[preset]), seed, 0.2))


def maxdiff(a, b) -> float:
    return float((a - b).detach().abs().max())


@pytest.mark.parametrize("preset", list(SMALL))
def test_ff_scales_alone_and_with_every_group_are_exact_and_invert(preset, record):
    m = make(preset)
    x = inputs_for(m)
    spec = spec_for(m)
    groups = [g for g in spec.groups.values() if g.kind == "scale"]
    assert len(groups) == m.config.n_layer
    assert {g.structure for g in groups} == {"signed" if preset.startswith("llama") else "positive"}
    alone = random_transform(m, seed=3, groups=["ffscale"])
    moved = apply_transform(m, alone)
    assert any(maxdiff(moved.state_dict()[k], v) > 1e-2 for k, v in m.state_dict().items())
    if preset.startswith("llama"):
        assert any((c < 0).any() for c in alone.elements.values())  # SwiGLU's up takes signs too
    record(f"{preset}: ff scales alone", maxdiff(m(x), moved(x)), BOUND)
    kinds = ["residual", "heads", "qheads", "qk", "ov", "ff", "ffscale"]
    T = random_transform(m, seed=5, groups=kinds)
    assert any(k.startswith("ffscale") for k in T.elements) and any(k.startswith("ff.") for k in T.elements)
    out = apply_transform(m, T)
    record(f"{preset}: every group with ff scales", maxdiff(m(x), out(x)), BOUND)
    back = apply_transform(out, invert_transform(T, spec))
    record(
        f"{preset}: T then T⁻¹ (ff scales after the FF permutation)",
        max(maxdiff(v, back.state_dict()[k]) for k, v in m.state_dict().items()),
        BOUND,
    )


def test_a_gelu_model_has_no_scale_and_a_relu_scale_must_be_positive():
    gelu = canonicalize(perturbed(from_preset("gpt2-tiny", **SMALL["gpt2-tiny-relu"])))
    assert not any(g.kind == "scale" for g in spec_for(gelu).groups.values())
    relu = make("gpt2-tiny-relu")
    c = torch.ones(relu.config.d_ff, dtype=torch.float64)
    c[0] = -1.0
    with pytest.raises(ValueError, match="ffscale.0"):
        apply_transform(relu, Transform({"ffscale.0": c}))


def test_the_closed_form_scale_is_the_minimum_of_each_neurons_objective(record):
    g = torch.Generator().manual_seed(0)
    p, r = torch.randn(200, generator=g, dtype=torch.float64), torch.randn(200, generator=g, dtype=torch.float64)
    q, s = (
        torch.rand(200, generator=g, dtype=torch.float64) + 0.1,
        torch.rand(200, generator=g, dtype=torch.float64) + 0.1,
    )
    grid = torch.linspace(-5, 5, 20001, dtype=torch.float64)
    grid = grid[grid.abs() > 1e-3]
    for signed in (False, True):
        c = best_scales(p, q, r, s, signed)
        f = lambda x: -2 * p[:, None] * x + q[:, None] * x**2 - 2 * r[:, None] / x + s[:, None] / x**2  # noqa: E731
        dense = grid if signed else grid[grid > 0]
        assert signed or bool((c > 0).all())
        gap = float((f(c[:, None])[:, 0] - f(dense[None, :]).min(1).values).max())
        record(f"ff scale: closed form vs a dense grid ({'signed' if signed else 'positive'})", max(gap, 0.0), 1e-6)


@pytest.mark.parametrize("preset", ["gpt2-tiny-relu", "llama-tiny"])
def test_weight_matching_with_ff_scales_recovers_a_rescaled_permuted_copy(preset, record):
    """B = A under a random FF permutation and scale (signs too for SwiGLU), heads and residual map:
    matching with the scales finds the inverse permutation and scales exactly; without them the
    scales stay as a distance."""
    from fedlmc.matching import weight_matching

    a = make(preset, seed=1)
    T = random_transform(a, seed=9, groups=["residual", "heads", "ff", "ffscale"])
    b = apply_transform(a, T)
    inverse = invert_transform(T, spec_for(a))
    found = weight_matching(a, b, Matching(ff_scale=True, keep_identity=False))
    for k, v in inverse.elements.items():
        if k.startswith("ff."):
            assert torch.equal(v, found.elements[k]), k
    err = max(float((v - found.elements[k]).abs().max()) for k, v in inverse.elements.items() if "scale" in k)
    record(f"{preset}: weight matching with ff scales: the planted scales back", err, 1e-10)
    assert found.info["ff_scale"]["paper"]["mean_abs_log_scale"][0] > 0.1
    if preset == "llama-tiny":
        assert 0.2 < found.info["ff_scale"]["paper"]["flipped"][0] < 0.8
    got = apply_transform(b, found)
    with_err = max(maxdiff(v, got.state_dict()[k]) for k, v in a.state_dict().items())
    plain = apply_transform(b, weight_matching(a, b, Matching(keep_identity=False)))
    without_err = max(maxdiff(v, plain.state_dict()[k]) for k, v in a.state_dict().items())
    assert with_err < 1e-2 < without_err, (with_err, without_err)


def test_learned_matching_learns_the_ff_scales_of_its_start_and_stays_exact(record):
    """A weight-matching start with FF scales: learned matching trains their log-magnitudes (the signs
    kept) beside the residual map and permutations, and what it returns keeps B's function."""
    from fedlmc.data.base import TokenData
    from fedlmc.matching import learned_matching, weight_matching
    from fedlmc.options import Learning

    a, b = make("llama-tiny", 0), make("llama-tiny", 1)
    start = weight_matching(a, b, Matching(ff_scale=True))
    g = torch.Generator().manual_seed(5)
    data = TokenData(torch.randint(0, 17, (400,), generator=g), block_size=8)
    T = learned_matching(a, b, data, start, Learning(steps=8, lr=0.05), progress=False)
    moved = max(float((T[k] - start[k]).abs().max()) for k in start.elements if k.startswith("ffscale"))
    assert moved > 1e-4
    assert all(torch.equal(torch.sign(T[k]), torch.sign(start[k])) for k in start.elements if k.startswith("ffscale"))
    x = inputs_for(b)
    record("learned llama with ff scales: aligned B vs B (float64)", maxdiff(b(x), apply_transform(b, T)(x)), BOUND)


def test_a_universe_with_ff_scales_merges_rescaled_copies_back_into_the_model(record):
    """Three copies of one ReLU model under random FF permutations and scales (and heads, residual):
    the universe that matches scales returns the model; the one that does not averages mismatched
    neuron scales and leaves a gap."""
    from fedlmc.merging.universe import universe_merge
    from fedlmc.options import Universe

    a = make("gpt2-tiny-relu", seed=3)
    copies = [
        apply_transform(a, random_transform(a, seed=s, groups=["residual", "heads", "ff", "ffscale"]))
        for s in (1, 2, 3)
    ]
    x = inputs_for(a)
    scaled, _ = universe_merge(
        copies, matching=Matching(ff_scale=True), universe=Universe(iterations=3, keep_layernorm=False)
    )
    plain, _ = universe_merge(copies, universe=Universe(iterations=3, keep_layernorm=False))
    record("gpt2-tiny-relu: universe with ff scales of 3 rescaled copies vs the model", maxdiff(scaled(x), a(x)), 1e-6)
    assert maxdiff(plain(x), a(x)) > 1e-3


@pytest.mark.parametrize("eps", [0.0, 1e-5])
def test_the_residual_global_scale_is_a_symmetry_only_without_the_norm_eps(eps, record):
    """The canonical form's one candidate left for a residual scale: every writer × c. RMSNorm reads
    ``c·x / sqrt(c²·mean(x²) + eps)``, the same only when eps = 0; fedlmc's models (and Hugging Face's)
    have eps > 0, so the global scale is not a group element and nothing solves it."""
    torch.manual_seed(0)
    m = canonicalize(perturbed(from_preset("gpt2-tiny", **{**SMALL["gpt2-tiny-relu"], "norm_eps": eps}), 0, 0.2))
    spec = spec_for(m)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    for member in spec.residual.members:
        if member.role == "writer":
            sd[member.param] = sd[member.param] * 3.0
    scaled = type(m)(m.config).double().eval()
    scaled.load_state_dict(sd)
    x = inputs_for(m)
    gap = maxdiff(scaled(x), m(x))
    if eps == 0:
        record("residual × 3 with eps = 0 (float64)", gap, BOUND)
    else:
        assert gap > 1e-6, gap


def test_the_universe_table_adds_the_merges_that_match_ff_scales(record):
    """``fedlmc universe --ff-scale``'s rows: the universe and the refined universe whose matching also
    solves the FF scales, beside the ones without, on the same models (a tiny run: 2 refinement steps)."""
    from types import SimpleNamespace

    from fedlmc.data.base import TokenData
    from fedlmc.merging.manyway import universe_table
    from fedlmc.options import Refinement

    g = torch.Generator().manual_seed(0)
    data = TokenData(torch.randint(0, 17, (600,), generator=g), block_size=8)
    splits = SimpleNamespace(train=data, test=data)
    models = [make("gpt2-tiny-relu", seed=s) for s in (4, 5, 6)]
    res = universe_table(
        models,
        splits,
        Refinement(steps=2, check_every=0),
        iterations=1,
        progress=False,
        log=lambda s: None,
        ff_scale=True,
    )
    rows = res["rows"]
    assert {"universe", "refined", "universe + FF scales", "refined (α=1) + FF scales"} <= set(rows)
    assert all(np.isfinite(r["loss"]) for r in rows.values())
    assert rows["universe + FF scales"]["loss"] != rows["universe"]["loss"]  # a different merge, not a copy
