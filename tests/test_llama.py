"""The Llama-style family: exact canonical form and symmetries (full orthogonal residual group, GQA
head permutations, RoPE-commuting QK gauge, SwiGLU FF permutations), planted recovery, universes."""

from __future__ import annotations

import torch
from conftest import inputs_for, perturbed

from fedlmc.matching import weight_matching
from fedlmc.merging.averaging import interpolate
from fedlmc.merging.universe import universe_merge
from fedlmc.models import from_preset
from fedlmc.options import Learning, Matching, Universe
from fedlmc.symmetry import Transform, apply_transform, canonicalize, random_transform, spec_for
from fedlmc.symmetry.random import invert_transform, random_invertible

KW = dict(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, vocab_size=20, block_size=16)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return perturbed(from_preset("llama-tiny", **{**KW, **kw}).double(), seed, 0.2)


def gap(a, b, x) -> float:
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


def test_canonical_form_and_random_elements_are_exact(record):
    for kv in (1, 2, 4):  # multi-query, grouped-query, multi-head attention
        m = make(kv, n_kv_head=kv)
        x = inputs_for(m)
        c = canonicalize(m)
        assert not c.config.norm_gain and all(getattr(b.ln1, "weight", None) is None for b in c.blocks)
        record(f"llama kv={kv}: canonical form (gains folded into readers)", gap(m, c, x), 1e-10)
        for seed in range(3):
            T = random_transform(m, seed=seed)  # Haar O, KV-group and within-group perms, RoPE/OV gauges, FF perms
            record(f"llama kv={kv}: random group element {seed}", gap(m, apply_transform(m, T), x), 1e-10)


def test_rope_gauge_is_the_commutant():
    """A general invertible QK gauge changes the function under RoPE (so the spec must restrict it), and
    the action refuses one; a scaled rotation of each frequency pair keeps it."""
    m = make(1)
    x = inputs_for(m)
    spec = spec_for(m)
    assert spec.groups["qk.0"].structure == "rope" and spec.groups["ov.0"].structure is None
    G = random_invertible(2, 8, torch.Generator().manual_seed(0))
    sd = {k: v for k, v in m.state_dict().items()}
    # the unrestricted gauge, applied by hand: q -> Gᵀq, k -> G⁻¹k per KV head (query heads share it)
    q, k = sd["blocks.0.attn.q.weight"].view(4, 8, -1), sd["blocks.0.attn.k.weight"].view(2, 8, -1)
    sd["blocks.0.attn.q.weight"] = (G.repeat_interleave(2, 0).transpose(1, 2) @ q).reshape(32, -1)
    sd["blocks.0.attn.k.weight"] = (torch.linalg.inv(G) @ k).reshape(16, -1)
    broken = from_preset("llama-tiny", **KW).double().eval()
    broken.load_state_dict(sd)
    assert gap(m, broken, x) > 1e-3
    try:
        apply_transform(m, Transform({"qk.0": G}))
        raise AssertionError("an unrestricted QK gauge was accepted")
    except ValueError as e:
        assert "qk.0" in str(e)
    # ... while the heads and OV gauge are unrestricted: OV with the same G is exact
    ok = apply_transform(m, Transform({"ov.0": G}))
    assert gap(m, ok, x) < 1e-10


def test_planted_symmetry_is_recovered(record):
    A = canonicalize(make(2))
    planted = random_transform(A, seed=4)
    B = apply_transform(A, planted)
    with torch.no_grad():
        for p in B.parameters():
            p.add_(1e-4 * torch.randn_like(p))
    T = weight_matching(A, B, Matching(gauge="invertible"))
    aligned = apply_transform(B, T)
    err = max(float((aligned.state_dict()[k] - v).abs().max() / v.abs().max()) for k, v in A.state_dict().items())
    record("llama: planted recovery, relative parameter error", err, 1e-2)
    record(
        "llama: planted, max |Δlogits| of the λ=0.5 merge", gap(A, interpolate(A, aligned, 0.5), inputs_for(A)), 1e-2
    )


def test_universe_of_planted_copies_returns_the_model(record):
    A = make(3)
    copies = [apply_transform(A, random_transform(A, seed=s)) for s in range(3)]
    merged, transforms = universe_merge(
        copies, matching=Matching(gauge="invertible"), universe=Universe(iterations=2, keep_layernorm=False)
    )
    assert merged.config.norm == "rmsnorm"  # keep_layernorm does not apply to RMSNorm models
    record("llama: universe of 3 planted copies vs the model", gap(A, merged, inputs_for(A)), 1e-6)


def test_query_heads_permute_only_within_their_kv_head(record):
    """Query heads of one KV head can trade places (``qheads.{l}``); across KV heads they cannot."""
    m = make(4)
    x, spec = inputs_for(m), spec_for(m)
    g = spec.groups["qheads.0"]
    assert g.structure == "within" and g.size == 4 and g.count == 2 and spec.within_of("heads.0") is g
    assert "qheads.0" not in spec_for(make(5, n_kv_head=4)).groups  # one query head per KV head: nothing to permute
    within = torch.tensor([1, 0, 3, 2])
    record(
        "llama: query heads swapped within their KV heads",
        gap(m, apply_transform(m, Transform({"qheads.0": within})), x),
        1e-10,
    )
    try:
        apply_transform(m, Transform({"qheads.0": torch.tensor([2, 1, 0, 3])}))
        raise AssertionError("a permutation across KV heads was accepted")
    except ValueError as e:
        assert "qheads.0" in str(e)
    # the same swap applied by hand across KV heads changes the function
    sd = dict(m.state_dict())
    q, o = sd["blocks.0.attn.q.weight"].view(4, 8, -1), sd["blocks.0.attn.o.weight"].view(-1, 4, 8)
    sd["blocks.0.attn.q.weight"] = q[[2, 1, 0, 3]].reshape(32, -1)
    sd["blocks.0.attn.o.weight"] = o[:, [2, 1, 0, 3]].reshape(-1, 32)
    broken = from_preset("llama-tiny", **KW).double().eval()
    broken.load_state_dict(sd)
    assert gap(m, broken, x) > 1e-3


def test_inverse_of_kv_and_within_permutations(record):
    """The within-group element acts after the KV-head one and does not commute with it: the inverse
    re-indexes it (``invert_transform``); A → T → T⁻¹ gives A's parameters back."""
    for kv in (1, 2):
        A = canonicalize(make(6, n_kv_head=kv, n_head=8))
        spec = spec_for(A)
        swap = Transform({"heads.0": torch.arange(kv).flip(0), "qheads.0": torch.tensor([1, 0, 2, 3, 4, 5, 6, 7])})
        for seed, T in [("swap", swap)] + [(s, random_transform(A, seed=s)) for s in range(3)]:
            back = apply_transform(apply_transform(A, T), invert_transform(T, spec))
            err = max(float((back.state_dict()[k] - v).abs().max()) for k, v in A.state_dict().items())
            record(f"llama kv={kv}: T then its inverse, max |Δθ| (seed {seed})", err, 1e-10)


def test_learned_matching_keeps_within_group_structure():
    """Learned matching trains the within-group latents too and returns block-keeping elements."""
    from fedlmc.data.base import TokenData
    from fedlmc.matching import learned_matching

    A = canonicalize(make(7))
    planted = random_transform(A, seed=8, groups=("residual", "heads", "ff"))
    planted.elements["qheads.0"] = torch.tensor([1, 0, 3, 2])
    B = apply_transform(A, planted)
    data = TokenData(torch.randint(0, 20, (2000,)), 16)
    T = learned_matching(A, B, data, learning=Learning(steps=3, batch_size=8), progress=False)
    for l in range(2):
        el = T.elements[f"qheads.{l}"]
        assert bool((el // 2 == torch.arange(4) // 2).all())
    # the planted pair's alignment (weight matching's start, moved by 3 small steps) survives: A's own
    # parameters come back, which needs the within-group permutations recovered and kept
    back = apply_transform(B, T).state_dict()
    assert max(float((back[k] - v).abs().max() / v.abs().max()) for k, v in A.state_dict().items()) < 2e-2
    assert bool((T.elements["qheads.0"] != torch.arange(4)).any())
