"""The Llama-style family: exact canonical form and symmetries (full orthogonal residual group, GQA
head permutations, RoPE-commuting QK gauge, SwiGLU FF permutations), planted recovery, universes."""
from __future__ import annotations

import torch

from fedlmc.matching import weight_matching
from fedlmc.merge import interpolate, universe_merge
from fedlmc.models import from_preset
from fedlmc.symmetry import Transform, apply_transform, canonicalize, random_transform, spec_for
from fedlmc.symmetry.random import random_invertible

from conftest import inputs_for, perturbed

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
            T = random_transform(m, seed=seed)  # Haar O (no O·1 = 1 needed), KV-group perms, RoPE/OV gauges, FF perms
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
    T = weight_matching(A, B, gauge="invertible")
    aligned = apply_transform(B, T)
    err = max(float((aligned.state_dict()[k] - v).abs().max() / v.abs().max()) for k, v in A.state_dict().items())
    record("llama: planted recovery, relative parameter error", err, 1e-2)
    record("llama: planted, max |Δlogits| of the λ=0.5 merge", gap(A, interpolate(A, aligned, 0.5), inputs_for(A)), 1e-2)


def test_universe_of_planted_copies_returns_the_model(record):
    A = make(3)
    copies = [apply_transform(A, random_transform(A, seed=s)) for s in range(3)]
    merged, transforms = universe_merge(copies, iterations=2, gauge="invertible")
    assert merged.config.norm == "rmsnorm"  # keep_layernorm does not apply to RMSNorm models
    record("llama: universe of 3 planted copies vs the model", gap(A, merged, inputs_for(A)), 1e-6)
