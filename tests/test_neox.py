"""The GPT-NeoX family (parallel attention and FF, partial rotary): exact canonical form and symmetries,
the partial-RoPE QK gauge (scaled rotations on the rotary dimensions, free on the rest, nothing
mixing them), planted recovery by weight matching, and a universe of planted copies."""

from __future__ import annotations

import pytest
import torch
from conftest import inputs_for, perturbed

from fedlmc.matching import weight_matching
from fedlmc.merging.averaging import interpolate
from fedlmc.merging.universe import universe_merge
from fedlmc.models import from_preset
from fedlmc.options import Matching, Universe
from fedlmc.symmetry import Transform, apply_transform, canonicalize, random_transform, spec_for, to_layernorm
from fedlmc.symmetry.random import random_invertible
from fedlmc.symmetry.rope import random_rope_gauge, with_pass

KW = dict(n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=20, block_size=16, rotary_dims=4)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return perturbed(from_preset("neox-tiny", **{**KW, **kw}), seed, 0.2)


def gap(a, b, x) -> float:
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("rotary", [4, 8])  # partial and full rotary heads (d_head 8)
def test_canonical_form_and_random_elements_are_exact(parallel, rotary, record):
    m = make(1, parallel=parallel, rotary_dims=rotary)
    x = inputs_for(m)
    c = canonicalize(m)
    record(f"neox parallel={parallel} rotary={rotary}: canonical form", gap(m, c, x), 1e-10)
    for seed in range(2):
        T = random_transform(c, seed=seed)  # O, head perms, partial-RoPE QK and OV gauges, FF perms
        record(
            f"neox parallel={parallel} rotary={rotary}: random element {seed}", gap(m, apply_transform(c, T), x), 1e-10
        )
    wide = apply_transform(c, random_transform(c, seed=3, groups=["residual"], width=48))
    record(f"neox parallel={parallel} rotary={rotary}: width lift 32 → 48", gap(m, wide, x), 1e-10)
    back = to_layernorm(apply_transform(c, random_transform(c, seed=4, fix_ones=True)))
    record(f"neox parallel={parallel} rotary={rotary}: back to LayerNorm", gap(m, back, x), 1e-10)


def test_partial_rope_gauge_is_block_diagonal(record):
    """A gauge mixing rotary and pass-through dimensions, or a free map on the rotary ones, changes the
    function (and is refused); scaled rotations on the rotary pairs plus any invertible map on the
    pass-through block keep it."""
    m = make(2)
    x = inputs_for(m)
    assert spec_for(m).groups["qk.0"].structure == "rope" and spec_for(m).groups["qk.0"].rotary == 4
    g = torch.Generator().manual_seed(0)
    ok = with_pass(random_rope_gauge(4, 4, g), random_invertible(4, 4, g))
    record("neox: block-diagonal partial-RoPE gauge", gap(m, apply_transform(m, Transform({"qk.0": ok})), x), 1e-10)
    for name, bad in {"free": random_invertible(4, 8, g), "mixing": ok + 0.1 * random_invertible(4, 8, g)}.items():
        with pytest.raises(ValueError, match="qk.0"):
            apply_transform(m, Transform({"qk.0": bad}))
        sd = dict(m.state_dict())  # the same map applied by hand: q -> Gᵀq, k -> G⁻¹k per head
        for p, M in (("q", bad.transpose(1, 2)), ("k", torch.linalg.inv(bad))):
            for part in ("weight", "bias"):
                t = sd[f"blocks.0.attn.{p}.{part}"]
                sd[f"blocks.0.attn.{p}.{part}"] = (M @ t.reshape(4, 8, -1)).reshape(t.shape)
        broken = from_preset("neox-tiny", **KW).double().eval()
        broken.load_state_dict(sd)
        assert gap(m, broken, x) > 1e-3, name


def test_planted_symmetry_is_recovered(record):
    A = canonicalize(make(3))
    B = apply_transform(A, random_transform(A, seed=5))
    with torch.no_grad():
        for p in B.parameters():
            p.add_(1e-4 * torch.randn_like(p))
    aligned = apply_transform(B, weight_matching(A, B, Matching(gauge="invertible")))
    err = max(float((aligned.state_dict()[k] - v).abs().max() / v.abs().max()) for k, v in A.state_dict().items())
    record("neox: planted recovery, relative parameter error", err, 1e-2)
    record("neox: planted, max |Δlogits| of the λ=0.5 merge", gap(A, interpolate(A, aligned, 0.5), inputs_for(A)), 1e-2)


def test_universe_of_planted_copies_returns_the_model(record):
    A = make(4)
    copies = [apply_transform(canonicalize(A), random_transform(A, seed=s, fix_ones=True)) for s in range(3)]
    merged, _ = universe_merge(copies, matching=Matching(gauge="invertible"), universe=Universe(iterations=2))
    record("neox: universe of 3 planted copies vs the model", gap(A, merged, inputs_for(A)), 1e-6)


def test_rotary_models_refuse_the_circuit_form(record):
    """The circuit form concatenates heads across models, so RoPE would pair and rotate the concatenated
    dimensions differently: even a rotary model merged with itself changes its function (measured here
    through the factored twin of GPT-2, which stays exact). NeoX and Llama refuse it, before matching."""
    from test_widths import _gpt, _llama

    g = canonicalize(_gpt(1))
    x = inputs_for(g)
    record("gpt2: circuit merge of a model with itself", gap(interpolate(g, g, 0.5, form="circuit"), g, x), 1e-10)
    for m in (canonicalize(make(1)), canonicalize(_llama(1))):
        with pytest.raises(ValueError, match="factored form"):
            interpolate(m, m, 0.5, form="circuit")
        with pytest.raises(ValueError, match="factored form"):
            universe_merge([m, m], universe=Universe(iterations=1, form="circuit"))
    assert interpolate(m, m, 0.5).config.d_head == m.config.d_head  # the factored form stays available
