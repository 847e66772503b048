"""Mixed widths: exact padding, masked universe merges and projection back to each client's shape."""

from __future__ import annotations

import pytest
import torch
from conftest import inputs_for, perturbed

from fedlmc.merging.universe import project, universe_merge
from fedlmc.merging.widths import common_shape, pad, shape_of, unit_masks, unpad
from fedlmc.models import from_preset
from fedlmc.options import Universe
from fedlmc.symmetry import apply_transform, canonicalize, random_transform


def _vit(seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4)
    return perturbed(from_preset("vit-tiny", **{**base, **kw}), seed, 0.2)


def _gpt(seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=40, block_size=16)
    return perturbed(from_preset("gpt2-tiny", **{**base, **kw}), seed, 0.2)


@pytest.mark.parametrize("make", [_vit, _gpt])
def test_pad_and_unpad_are_exact(make, record):
    small = make(d_model=16, n_head=2, d_ff=24, d_head=8)
    x = inputs_for(small)
    shape = {"d_model": 40, "n_head": 5, "d_ff": 70, "d_head": 12}
    big = pad(small, shape)
    assert shape_of(big.config) == shape
    with torch.no_grad():
        record(
            f"{small.config.arch}: pad 16/2h/24ff/8dh -> 40/5h/70ff/12dh", float((big(x) - small(x)).abs().max()), 1e-10
        )
        back = unpad(big, small.config)
        assert shape_of(back.config) == shape_of(small.config)
        assert back.config.attn_scale == pytest.approx(small.config.attn_scale)
        record(f"{small.config.arch}: unpad(pad(m))", float((back(x) - small(x)).abs().max()), 1e-10)
        # units only (no residual lift): a LayerNorm model stays LayerNorm
        units = pad(small, {"n_head": 6, "d_ff": 100}, residual=False)
        assert units.config.norm == "layernorm"
        record(f"{small.config.arch}: pad units only", float((units(x) - small(x)).abs().max()), 1e-10)


def test_pad_refuses_to_shrink_and_depths_must_agree():
    m = _vit()
    with pytest.raises(ValueError, match="cannot pad"):
        pad(m, {"d_ff": 8})
    with pytest.raises(ValueError, match="depth"):
        common_shape([m.config, m.config.replace(n_layer=3)])


def test_mixed_width_universe_recovers_and_projects(record):
    """A narrow model and a wide model that *is* the narrow one (padded, moved by a random group element,
    plus noise): the universe computes the narrow model's function, and projecting it back gives a model
    of the narrow shape that computes it too."""
    small = canonicalize(_vit(1, d_model=16, n_head=2, d_ff=40, d_head=8))
    x = inputs_for(small)
    wide = pad(small, {"d_model": 32, "n_head": 4, "d_ff": 64, "d_head": 8})
    g = torch.Generator().manual_seed(3)
    wide = apply_transform(wide, random_transform(wide, seed=3, groups=["residual", "heads", "ff"]))
    with torch.no_grad():
        for p in wide.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-4)
    merged, Ts = universe_merge([wide, small], universe=Universe(iterations=3, keep_layernorm=False))
    assert shape_of(merged.config) == shape_of(wide.config)
    with torch.no_grad():
        ref = small(x).abs().max()
        record(
            "mixed widths: universe vs the narrow model (rel.)", float((merged(x) - small(x)).abs().max() / ref), 1e-2
        )
        back = project(merged, Ts[1])
        assert shape_of(back.config) == shape_of(small.config)
        record(
            "mixed widths: project(universe, T_narrow) vs narrow (rel.)",
            float((back(x) - small(x)).abs().max() / ref),
            1e-2,
        )
        # the narrow model's transform maps it into the universe exactly (its own shape in, universe out)
        from fedlmc.merging.widths import into_universe

        inside = into_universe(small, Ts[1])
        record(
            "mixed widths: into_universe(narrow) keeps its function", float((inside(x) - small(x)).abs().max()), 1e-10
        )
    # FF neurons present in only the wide model are averaged over it alone (mask), not halved by zeros
    masks = unit_masks(small.config, shape_of(wide.config))
    assert int(masks["ff.0"].sum()) == 40 and int(masks["heads.0"].sum()) == 2


def test_mixed_width_one_hot_weight_returns_the_narrow_model(record):
    small = _vit(2, d_model=16, n_head=2, d_ff=32, d_head=8)
    big = _vit(3)
    x = inputs_for(small)
    merged, Ts = universe_merge([big, small], weights=[0, 1], universe=Universe(iterations=5, keep_layernorm=False))
    with torch.no_grad():
        record("mixed widths, one-hot weight on the narrow model", float((merged(x) - small(x)).abs().max()), 1e-10)
        record("... projected back", float((project(merged, Ts[1])(x) - small(x)).abs().max()), 1e-10)


def test_residual_directions_only_wide_models_span_are_not_diluted():
    """Averaging a wide model with a narrower one lifted into its first 16 coordinates: the last 16
    residual coordinates are the wide model's own (not halved by the narrow model's zeros); the first
    16 are the mean of both."""
    from fedlmc.merging.averaging import merge

    wide = canonicalize(_vit(1))
    narrow = pad(canonicalize(_vit(2, d_model=16, n_head=4, d_ff=64, d_head=8)), {"d_model": 32})
    P = torch.zeros(32, 32, dtype=torch.float64)
    P[:16, :16] = torch.eye(16, dtype=torch.float64)
    merged = merge([wide, narrow], [0.5, 0.5], masks=[None, {"residual": P}])
    a, b, m = (x.state_dict()["patch_emb.weight"] for x in (wide, narrow, merged))  # writer: residual axis 0
    assert torch.allclose(m[16:], a[16:], atol=1e-12)
    assert torch.allclose(m[:16], (a[:16] + b[:16]) / 2, atol=1e-12)
    r_a, r_m = wide.state_dict()["blocks.0.mlp.fc1.weight"], merged.state_dict()["blocks.0.mlp.fc1.weight"]
    assert torch.allclose(r_m[:, 16:], r_a[:, 16:], atol=1e-12)  # reader: residual axis 1


@pytest.mark.parametrize("make", [_vit, _gpt])
def test_layernorm_universe_of_mixed_widths(make, record):
    """LayerNorm clients of two widths (independent, and so using every direction of their streams)
    merged with ``keep_layernorm``: each narrower padded model is first turned by ``ones_lift`` so its
    stream stays centred in the universe; the universe comes back as a LayerNorm model and every client's
    projection converts to LayerNorm exactly (without the lift ``to_layernorm`` refuses: off-centre)."""
    from fedlmc.merging.widths import ones_lift
    from fedlmc.symmetry import to_layernorm

    narrow = make(1, d_model=16, n_head=2, d_ff=40, d_head=8).double()
    wide = make(2, d_model=32, n_head=4, d_ff=64, d_head=8).double()
    x = inputs_for(narrow)
    U = ones_lift(16, 32)
    assert torch.allclose(U @ U.T, torch.eye(32, dtype=U.dtype)) and torch.allclose(
        U @ torch.cat([torch.ones(16), torch.zeros(16)]).double() / 4, torch.ones(32, dtype=U.dtype) / 32**0.5
    )
    with torch.no_grad():
        merged, Ts = universe_merge([wide, narrow], universe=Universe(iterations=2, keep_layernorm=True))
        assert merged.config.norm == "layernorm" and merged.config.d_model == 32
        for T, m in zip(Ts, (wide, narrow)):
            back = project(merged, T)
            assert shape_of(back.config) == shape_of(m.config)
            ln = to_layernorm(back)
            record(
                f"{make.__name__}: LayerNorm universe, projection to d={m.config.d_model} → LayerNorm",
                float((ln(x) - back(x)).abs().max()),
                1e-10,
            )


@pytest.mark.parametrize("make", [_vit, _gpt])
@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_the_split_lift_is_exact_and_merges_back(make, act, record):
    """A narrower FF filled with its own neurons split (a semi-permutation: each unit copies one neuron,
    the copies share its output column) computes the same function; every unit is real (nothing
    masked); ``unpad`` merges the copies back exactly, also after a random permutation of the units."""
    from fedlmc.merging.widths import split_sources
    from fedlmc.symmetry import spec_for
    from fedlmc.symmetry.random import invert_transform

    small = make(4, d_ff=24, activation=act)
    x = inputs_for(small)
    shape = {"d_model": 32, "n_head": 4, "d_ff": 70, "d_head": 8}
    big = pad(small, shape, ff_lift="split")
    src, share = split_sources(24, 70)
    assert torch.bincount(src).tolist() == [3] * 22 + [2] * 2 and torch.allclose(
        torch.bincount(src, share), torch.ones(24, dtype=torch.float64)
    )
    w1 = big.state_dict()["blocks.0.mlp.fc1.weight"]
    assert torch.equal(w1[24], w1[0]) and torch.equal(w1[48], w1[0])  # copies of neuron 0
    with torch.no_grad():
        record(
            f"{small.config.arch} {act}: split lift 24 → 70 FF neurons", float((big(x) - small(x)).abs().max()), 1e-10
        )
        assert all(
            bool(m.all()) for k, m in unit_masks(small.config, shape, ff_lift="split").items() if k.startswith("ff")
        )
        T = random_transform(big, seed=5, groups=["ff"])
        moved = apply_transform(big, T)
        back = unpad(apply_transform(moved, invert_transform(T, spec_for(moved))), small.config, ff_lift="split")
        record(
            f"{small.config.arch} {act}: unpad(split) after a permutation",
            float((back(x) - small(x)).abs().max()),
            1e-10,
        )


def test_a_split_universe_of_a_narrow_and_a_wide_copy_projects_back(record):
    """Universe(ff_lift="split") with a narrow model and a wide one that *is* it (split lift, moved by a
    random group element): the universe computes the narrow model's function, and ``project`` (which
    merges the copies) returns a model of the narrow shape that computes it too."""
    small = canonicalize(_vit(5, d_ff=40))
    x = inputs_for(small)
    wide = pad(small, {"d_ff": 64}, ff_lift="split")
    wide = apply_transform(wide, random_transform(wide, seed=6, groups=["residual", "heads", "ff"]))
    merged, Ts = universe_merge([wide, small], universe=Universe(iterations=3, keep_layernorm=False, ff_lift="split"))
    assert Ts[1].width_map.ff_lift == "split" and merged.config.d_ff == 64
    with torch.no_grad():
        record("split universe vs the narrow model", float((merged(x) - small(x)).abs().max()), 1e-6)
        back = project(merged, Ts[1])
        assert back.config.d_ff == 40
        record("split universe: project(universe, T_narrow) vs narrow", float((back(x) - small(x)).abs().max()), 1e-6)


def _neox(seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=40, block_size=16, rotary_dims=4)
    return perturbed(from_preset("neox-tiny", **{**base, **kw}), seed, 0.2)


def _llama(seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(n_layer=2, d_model=32, n_head=4, n_kv_head=4, d_ff=48, vocab_size=40, block_size=16)
    return perturbed(from_preset("llama-tiny", **{**base, **kw}), seed, 0.2)


@pytest.mark.parametrize("make", [_vit, _gpt, _neox, _llama])
def test_the_head_split_is_exact_and_merges_back(make, record):
    """The OV split: fewer heads lifted into more by splitting the model's own heads (each copy keeps its
    head's Q, K and V, so the copies attend alike, and carries a share of its O columns) computes the same
    function, with the head width padded too where it grows; every head is real; ``unpad`` merges the
    copies back exactly, also after a random permutation of the heads and FF neurons."""
    from fedlmc.symmetry import spec_for
    from fedlmc.symmetry.random import invert_transform

    small = make(3, n_head=4, d_head=8)
    x = inputs_for(small)
    # a Llama head's width cannot grow (RoPE pairs i with i + d_head/2); NeoX's pass-through part can
    shape = {"n_head": 6, "d_head": 8 if make is _llama else 12, "d_ff": small.config.d_ff}
    big = pad(small, shape, head_lift="split")
    assert (big.config.n_head, big.config.d_head) == (6, shape["d_head"])
    o = big.state_dict()["blocks.0.attn.o.weight"].reshape(-1, 6, shape["d_head"])
    o_small = small.state_dict()["blocks.0.attn.o.weight"].reshape(-1, 4, 8)
    assert torch.allclose(o[:, 0, :8] + o[:, 4, :8], o_small[:, 0]) and torch.equal(o[:, 3, :8], o_small[:, 3])
    with torch.no_grad():
        record(
            f"{small.config.arch}: head split 4 → 6 heads (d_head 8 → {shape['d_head']})",
            float((big(x) - small(x)).abs().max()),
            1e-10,
        )
        masks = unit_masks(small.config, {**shape_of(small.config), **shape}, head_lift="split")
        assert all(bool(m.all()) for k, m in masks.items() if k.startswith("heads"))
        assert not any(bool(m.all()) for k, m in unit_masks(small.config, shape_of(big.config)).items() if "heads" in k)
        T = random_transform(big, seed=5, groups=["heads", "ff"])
        moved = apply_transform(big, T)
        back = unpad(apply_transform(moved, invert_transform(T, spec_for(moved))), small.config, head_lift="split")
        assert (back.config.n_head, back.config.d_head) == (4, 8)
        record(
            f"{small.config.arch}: unpad(head split) after a permutation",
            float((back(x) - small(x)).abs().max()),
            1e-10,
        )


def test_the_head_split_refuses_shared_kv_heads_and_llama_head_widths(record):
    """Grouped-query attention shares K and V between query heads, so its heads cannot be split one by one;
    a Llama head's width cannot grow (RoPE pairs dimension i with i + d_head/2, so zero dimensions would
    re-pair them: the function moved by ~3 before this was refused), while a NeoX head's zero dimensions
    join its pass-through part exactly."""
    with pytest.raises(ValueError, match="KV head per query head"):
        pad(_llama(n_kv_head=2), {"n_head": 6}, head_lift="split")
    with pytest.raises(ValueError, match="head's width cannot change"):
        pad(_llama(), {"d_head": 12})
    m = _neox(1)
    x = inputs_for(m)
    with torch.no_grad():
        record(
            "neox: head width 8 → 12 (pass-through zeros)", float((pad(m, {"d_head": 12})(x) - m(x)).abs().max()), 1e-10
        )
    with pytest.raises(ValueError, match="head lift"):
        Universe(head_lift="copies")


def test_a_head_split_universe_of_a_four_and_a_six_head_copy_projects_back(record):
    """Universe(head_lift="split") with a 4-head model and a 6-head one that *is* it (head split, moved by a
    random group element): the universe computes the 4-head model's function, the width map records the
    lift (and survives ``to_dict``), and ``project`` returns a 4-head model that computes it too."""
    from fedlmc.symmetry.transform import WidthMap

    small = canonicalize(_gpt(5, d_head=8))
    x = inputs_for(small)
    wide = pad(small, {"n_head": 6}, head_lift="split")
    wide = apply_transform(wide, random_transform(wide, seed=6, groups=["residual", "heads", "ff"]))
    merged, Ts = universe_merge([wide, small], universe=Universe(iterations=3, keep_layernorm=False, head_lift="split"))
    wm = Ts[1].width_map
    assert wm.head_lift == "split" and WidthMap.from_dict(wm.to_dict()) == wm and merged.config.n_head == 6
    with torch.no_grad():
        record("head-split universe vs the 4-head model", float((merged(x) - small(x)).abs().max()), 1e-6)
        back = project(merged, Ts[1])
        assert back.config.n_head == 4
        record(
            "head-split universe: project(universe, T_4) vs the 4-head model",
            float((back(x) - small(x)).abs().max()),
            1e-6,
        )
