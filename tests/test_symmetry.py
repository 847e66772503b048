"""Exactness of the canonical form and every symmetry action (float64, random inputs and elements)."""

from __future__ import annotations

import pytest
import torch
from conftest import inputs_for, perturbed

from fedlmc.models import from_preset
from fedlmc.symmetry import (
    Transform,
    apply_to_state,
    apply_transform,
    canonicalize,
    perm_matrix,
    random_transform,
    residual_offcentre,
    spec_for,
    to_layernorm,
)

BOUND = 1e-10
# Small but non-degenerate shapes; d_model is unique among dims so the spec completeness check can see it.
ARCHS = {
    "gpt2": dict(preset="gpt2-tiny", n_layer=2, d_model=24, n_head=3, d_ff=40, vocab_size=17, block_size=16),
    "vit": dict(preset="vit-tiny", n_layer=2, d_model=24, n_head=3, d_ff=40, image_size=12, patch_size=4),
}


def make(arch: str, seed: int = 0, **over):
    kw = dict(ARCHS[arch])
    preset = kw.pop("preset")
    torch.manual_seed(seed)
    return perturbed(from_preset(preset, **{**kw, **over}), seed)


def maxdiff(a, b) -> float:
    return float((a - b).detach().abs().max())


@pytest.fixture(params=list(ARCHS))
def arch(request):
    return request.param


def test_canonicalize_is_exact(arch, record):
    m = make(arch)
    x = inputs_for(m)
    c = canonicalize(m)
    assert c.config.norm == "rmsnorm" and not any("ln" in k for k in c.state_dict())
    record(f"{arch}: canonicalize", maxdiff(m(x), c(x)), BOUND)
    assert residual_offcentre(c) < 1e-12


def test_canonicalize_into_an_earlier_models_tensors_gives_the_same_model(arch):
    # ``out``: a loop over replies writes each one's canonical form into the last one's memory
    first, second = canonicalize(make(arch, 0)), make(arch, 1)
    fresh = canonicalize(second)
    given = {k: v for k, v in first.state_dict().items()}
    pointers = {v.data_ptr() for v in given.values()}
    into = canonicalize(second, out=given)
    assert fresh.config == into.config
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, into.state_dict()[k]), k  # bit for bit the fresh canonical form
    reused = [k for k, v in into.state_dict().items() if v.data_ptr() in pointers]
    assert {k for k in reused if into.state_dict()[k].numel() > 100} == {
        k for k, v in into.state_dict().items() if v.numel() > 100
    }  # every large tensor went into ``out``'s memory
    # ``out`` of another shape or dtype is not written: fresh memory, the same model
    other = canonicalize(make(arch, 0, d_model=21)).state_dict()
    wrong = {k: v.float() for k, v in first.state_dict().items()}
    for out in (other, wrong):
        ptrs = {v.data_ptr() for v in out.values()}
        again = canonicalize(second, out=out)
        assert all(v.data_ptr() not in ptrs for v in again.state_dict().values())
        assert all(torch.equal(v, again.state_dict()[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("group", ["residual", "heads", "qk", "ov", "ff"])
def test_each_action_alone_is_exact(arch, group, record):
    m = make(arch, seed=1)
    x = inputs_for(m, seed=1)
    c = canonicalize(m)
    T = random_transform(c, seed=7, groups=[group])
    assert T.elements and all(k.split(".")[0] == group for k in T.elements)
    moved = apply_transform(c, T)
    # the action really moved the weights (no test that cannot fail)
    assert any(maxdiff(moved.state_dict()[k], v) > 1e-3 for k, v in c.state_dict().items())
    record(f"{arch}: {group} alone", maxdiff(m(x), moved(x)), BOUND)


def test_all_actions_composed_are_exact(arch, record):
    m = make(arch, seed=2)
    x = inputs_for(m, seed=2)
    c = canonicalize(m)
    out = c
    for s in range(3):  # compose three full random group elements
        out = apply_transform(out, random_transform(c, seed=100 + s))
    record(f"{arch}: all groups, 3 elements composed", maxdiff(m(x), out(x)), BOUND)


def test_residual_permutation_mode(arch, record):
    m = make(arch, seed=3)
    c = canonicalize(m)
    x = inputs_for(m, seed=3)
    T = random_transform(c, seed=4, residual="permutation")
    R = T["residual"]  # the orthogonal group's representation: a permutation matrix
    assert torch.equal(R.sum(0), torch.ones(len(R), dtype=R.dtype)) and set(R.unique().tolist()) == {0.0, 1.0}
    record(f"{arch}: residual permutation + all", maxdiff(m(x), apply_transform(c, T)(x)), BOUND)


@pytest.mark.parametrize("norm_bias", [False, True])
def test_width_lift_is_exact(arch, norm_bias, record):
    m = make(arch, seed=5)
    c = canonicalize(m)
    if norm_bias:  # a biased RMSNorm model: the bias must move (and scale) with the lift
        c = perturbed(
            from_preset(
                ARCHS[arch]["preset"],
                **{k: v for k, v in ARCHS[arch].items() if k != "preset"},
                norm="rmsnorm",
                norm_bias=True,
            ),
            seed=6,
        )
    x = inputs_for(m, seed=5)
    d = c.config.d_model
    for width in (d + 1, 2 * d, 5 * d):
        lifted = apply_transform(c, random_transform(c, seed=width, groups=["residual"], width=width))
        assert lifted.config.d_model == width
        assert abs(lifted.config.norm_eps - c.config.norm_eps * d / width) < 1e-20
        record(f"{arch}: lift {d}->{width}{' (biased RMSNorm)' if norm_bias else ''}", maxdiff(c(x), lifted(x)), BOUND)
        # and the lifted model still carries every other symmetry exactly
        T = random_transform(lifted, seed=9, groups=["residual", "heads", "qk", "ov", "ff"])
        assert maxdiff(lifted(x), apply_transform(lifted, T)(x)) <= BOUND


def test_roundtrip_to_layernorm_is_exact(arch, record):
    m = make(arch, seed=8)
    x = inputs_for(m, seed=8)
    c = canonicalize(m)
    T = random_transform(c, seed=11, fix_ones=True)
    O = T["residual"]
    ones = torch.ones(O.shape[0], dtype=O.dtype)
    assert maxdiff(O @ ones, ones) < 1e-12 and maxdiff(O.T @ O, torch.eye(len(O), dtype=O.dtype)) < 1e-12
    moved = apply_transform(c, T)
    ln = to_layernorm(moved)
    assert ln.config.norm == "layernorm" and isinstance(ln.blocks[0].ln1, torch.nn.LayerNorm)
    record(f"{arch}: canonicalize → O·1=1 transform → LayerNorm", maxdiff(m(x), ln(x)), BOUND)
    # and canonicalize(to_layernorm(.)) is exact again
    record(f"{arch}: LayerNorm → canonicalize again", maxdiff(m(x), canonicalize(ln)(x)), BOUND)


def test_to_layernorm_refuses_an_uncentred_residual(arch):
    c = canonicalize(make(arch))
    rotated = apply_transform(c, random_transform(c, seed=3, groups=["residual"]))
    with pytest.raises(ValueError, match="not centred"):
        to_layernorm(rotated)


def test_residual_action_canonicalises_layernorm_models(arch, record):
    m = make(arch)
    x = inputs_for(m)
    moved = apply_transform(m, random_transform(m, seed=0, groups=["residual"]))
    assert moved.config.norm == "rmsnorm"
    record(f"{arch}: residual on a LayerNorm model (auto-canonical)", maxdiff(m(x), moved(x)), BOUND)
    with pytest.raises(ValueError, match="canonicalize"):  # the state-level API does not guess
        apply_to_state(m.state_dict(), m.config, random_transform(m, seed=0, groups=["residual"]))
    # permutations and gauges need no canonical form and keep LayerNorm
    T = random_transform(m, seed=0, groups=["heads", "qk", "ov", "ff"])
    kept = apply_transform(m, T)
    assert kept.config.norm == "layernorm"
    assert maxdiff(m(x), kept(x)) <= BOUND


def test_spec_covers_every_residual_axis(arch):
    """Every canonical-model tensor with a d_model-sized axis is in the residual group (and vice versa)."""
    c = canonicalize(make(arch, d_head=5))  # inner attention width 15 != d_model 24
    d = c.config.d_model
    spec = spec_for(c)
    sd = c.state_dict()
    declared = {(mem.param, mem.axis) for mem in spec.residual.members}
    found = {(k, a) for k, v in sd.items() for a, n in enumerate(v.shape) if n == d}
    assert declared == found
    assert all(mem.param in sd for g in spec.groups.values() for mem in g.members)
    assert len(spec.layer_groups("heads")) == c.config.n_layer == len(spec.layer_groups("ff"))


def test_spec_for_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="no symmetry spec"):
        spec_for(torch.nn.Linear(2, 2))


def test_transform_rejects_foreign_groups(arch):
    c = canonicalize(make(arch))
    with pytest.raises(ValueError, match="does not have"):
        apply_transform(c, Transform({"ff.99": torch.arange(3)}))


def test_permutations_as_matrices_act_like_indices(arch):
    """Relaxed (matrix) permutations — what learned matching differentiates through — equal index ones."""
    c = canonicalize(make(arch))
    T = random_transform(c, seed=5, groups=["heads", "ff"])
    Tm = Transform({k: perm_matrix(v) for k, v in T.elements.items()})
    a = apply_transform(c, T).state_dict()
    b = apply_to_state(c.state_dict(), c.config, Tm, relaxed=True)[0]
    assert max(maxdiff(a[k], b[k]) for k in a) < 1e-14


def test_elements_have_one_representation_per_kind(arch):
    """The kind comes from the spec: an element in another kind's representation is a clear error."""
    c = canonicalize(make(arch))
    d = c.config.d_model
    with pytest.raises(ValueError, match="residual.*orthogonal"):
        apply_transform(c, Transform({"residual": torch.randperm(d)}))  # an index vector for O
    with pytest.raises(ValueError, match="ff.0.*permutation"):
        apply_transform(c, Transform({"ff.0": torch.eye(c.config.d_ff, dtype=torch.float64)}))  # relaxed, not asked for


@pytest.mark.parametrize(
    "shape,axis,block", [((12, 5), 0, 1), ((5, 12), 1, 1), ((12, 5), 0, 3), ((4, 12, 2), 1, 2), ((12,), 0, 4)]
)
def test_a_straight_through_permutation_gathers_with_the_dense_products_values_and_gradients(shape, axis, block):
    """A relaxed permutation whose value is a permutation matrix (the straight-through estimator) is
    applied by gathering; values and the gradients of the tensor and of the matrix equal the dense
    product's (the Kronecker path every other relaxed element takes)."""
    from fedlmc.symmetry.transform import _as_permutation, _GatherStraightThrough, apply_along

    g = torch.Generator().manual_seed(0)
    n = shape[axis] // block
    latent = torch.randn(n, n, generator=g, dtype=torch.float64, requires_grad=True)
    perm = torch.randperm(n, generator=g)
    P = perm_matrix(perm, torch.float64) + (latent - latent.detach())
    assert torch.equal(_as_permutation(P), perm) and _as_permutation(torch.softmax(latent, 1)) is None
    t = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    dense = apply_along(t, axis, torch.kron(P, torch.eye(block, dtype=P.dtype)))
    fast = _GatherStraightThrough.apply(t, P, perm, axis, block)
    assert torch.equal(fast, dense)
    gd = torch.autograd.grad((dense * w).sum(), (t, latent))
    gf = torch.autograd.grad((fast * w).sum(), (t, latent))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(gd, gf))
