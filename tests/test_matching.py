"""Pairwise alignment: planted symmetries are recovered, alignment preserves function, merged forms
are exact at the endpoints, learned matching improves on its init, shared inits come to no harm."""

from __future__ import annotations

import pytest
import torch
from conftest import inputs_for, perturbed

from fedlmc.data import load, partition
from fedlmc.matching import activation_matching, learned_matching, weight_matching
from fedlmc.matching.weight import midpoint_loss
from fedlmc.merging.averaging import interpolate
from fedlmc.models import from_preset
from fedlmc.options import Learning, Matching
from fedlmc.symmetry import apply_transform, canonicalize, random_transform
from fedlmc.train import TrainConfig, evaluate, model_for_data, train

SHAPES = {
    "gpt2": ("gpt2-tiny", dict(n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=20, block_size=16)),
    "vit": ("vit-tiny", dict(n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4)),
}


def make(arch, seed=0):
    preset, kw = SHAPES[arch]
    torch.manual_seed(seed)
    return perturbed(from_preset(preset, **kw), seed, 0.2)


def noisy(model, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return model


def param_error(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).abs().max() / sa[k].abs().max()) for k in sa)


def output_gap(a, b, x) -> float:
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


@pytest.mark.parametrize("arch", list(SHAPES))
@pytest.mark.parametrize("residual", ["orthogonal", "permutation"])
def test_planted_symmetry_is_recovered(arch, residual, record):
    A = canonicalize(make(arch))
    planted = random_transform(A, seed=3, residual=residual)  # O (or P), head perms, invertible gauges, FF perms
    B = noisy(apply_transform(A, planted), 1e-4)
    assert param_error(A, B) > 0.5  # the planted element really scrambled the weights
    T = weight_matching(A, B, Matching(residual=residual, gauge="invertible"))
    aligned = apply_transform(B, T)
    record(f"{arch}/{residual}: planted recovery, relative parameter error", param_error(A, aligned), 1e-2)
    x = inputs_for(A)
    # the merge of A and aligned B sits on the same function: barrier ≈ 0 (measured on outputs)
    mid = interpolate(A, aligned, 0.5)
    record(f"{arch}/{residual}: planted, max |Δlogits| of the λ=0.5 merge", output_gap(A, mid, x), 1e-2)


@pytest.mark.parametrize("arch", list(SHAPES))
def test_planted_orthogonal_gauge_mode_with_circuit_merge(arch, record):
    """The default (orthogonal) gauge cannot undo an invertible gauge, but the circuit merge does not care."""
    A = canonicalize(make(arch, 1))
    B = noisy(apply_transform(A, random_transform(A, seed=5)), 1e-4)
    T = weight_matching(A, B)
    x = inputs_for(A)
    record(
        f"{arch}: planted, circuit merge at λ=0.5",
        output_gap(A, interpolate(A, apply_transform(B, T), 0.5, form="circuit"), x),
        1e-2,
    )


@pytest.mark.parametrize("arch", list(SHAPES))
def test_aligned_model_computes_the_same_function(arch, record):
    A, B = make(arch, 0), make(arch, 1)  # unrelated LayerNorm models
    x = inputs_for(A)
    for residual, keep in (("orthogonal", False), ("permutation", False), ("orthogonal", True)):
        T = weight_matching(A, B, Matching(residual=residual), keep_layernorm=keep)
        record(
            f"{arch}: aligned B vs B ({residual}, keep_layernorm={keep})",
            output_gap(B, apply_transform(B, T), x),
            1e-10,
        )


@pytest.mark.parametrize("arch", list(SHAPES))
def test_merged_forms_reproduce_the_endpoints(arch, record):
    A, B = make(arch, 0), make(arch, 1)
    x = inputs_for(A)
    T = weight_matching(A, B, keep_layernorm=True)
    Bal = apply_transform(B, T)
    for form in ("factored", "circuit"):
        for keep in (False, True):
            one, zero = (
                interpolate(A, Bal, 1.0, form=form, keep_layernorm=keep),
                interpolate(A, Bal, 0.0, form=form, keep_layernorm=keep),
            )
            if keep:
                assert one.config.norm == "layernorm" and isinstance(one.blocks[0].ln1, torch.nn.LayerNorm)
            if form == "circuit":
                assert one.config.d_head == 2 * A.config.d_head
            record(f"{arch}: {form}{' +LN' if keep else ''} at λ=1 vs A", output_gap(A, one, x), 1e-10)
            record(f"{arch}: {form}{' +LN' if keep else ''} at λ=0 vs B", output_gap(B, zero, x), 1e-10)
    mid = interpolate(A, Bal, 0.4)
    record(
        f"{arch}: keep_layernorm merge at λ=0.4 as LayerNorm",
        output_gap(mid, interpolate(A, Bal, 0.4, keep_layernorm=True), x),
        1e-10,
    )
    O = T["residual"]
    ones = torch.ones(len(O), dtype=O.dtype)
    assert float((O @ ones - ones).abs().max()) < 1e-10


def test_activation_matching_recovers_a_planted_permutation_symmetry():
    A = canonicalize(make("vit", 2))
    B = apply_transform(A, random_transform(A, seed=1, groups=["residual", "heads", "ff"]))
    x = torch.randn(64, 1, 12, 12, dtype=torch.float64)

    class Data:  # image batches of the right size for this 12x12 model
        def batches(self, batch_size, shuffle=False, generator=None):
            yield x, torch.zeros(len(x), dtype=torch.long)

    T = activation_matching(A, B, Data(), n_batches=1)
    assert param_error(A, apply_transform(B, T)) < 1e-6


@pytest.fixture(scope="module")
def digits():
    return load("digits")


def _train(model, data, seed, epochs=12, lr=3e-3):
    train(model, data, TrainConfig(epochs=epochs, lr=lr, batch_size=32, seed=seed), progress=False)
    return model.eval()


@pytest.fixture(scope="module")
def trained_a(digits):
    """vit-digits seed 0 trained 12 epochs: the A side of the tests below (trained once)."""
    return _train(model_for_data("vit-digits", digits, 0), digits.train, 0)


@pytest.fixture(scope="module")
def trained_b(digits):
    return _train(model_for_data("vit-digits", digits, 1), digits.train, 1)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("relax", ["ste", "sinkhorn"])
def test_learned_matching_lowers_the_midpoint_loss(digits, trained_a, trained_b, relax):
    A, B = trained_a, trained_b
    init = weight_matching(A, B)
    T = learned_matching(A, B, digits.train, init, Learning(steps=60, relax=relax), progress=False)
    before = midpoint_loss(A, B, init, digits.train, max_batches=20)
    after = midpoint_loss(A, B, T, digits.train, max_batches=20)
    print(f"learned matching ({relax}) midpoint loss on train: {before:.3f} -> {after:.3f}")
    assert after < before - 0.05
    assert len(T.info["loss"]) == 60


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shared_init_comes_to_no_harm(digits):
    """Two clients from one init trained on Dirichlet halves: with a few guard batches, the aligned
    merge is never worse than plain averaging (FedAvg)."""
    base = model_for_data("vit-digits", digits, 0)
    halves = partition(digits.train, 2, "dirichlet", alpha=0.5, seed=0)
    models = []
    for i, part in enumerate(halves):
        m = model_for_data("vit-digits", digits, 0)
        m.load_state_dict(base.state_dict())
        models.append(_train(m, part, seed=10 + i, epochs=10, lr=1e-3))
    A, B = models
    plain = evaluate(interpolate(A, B, 0.5), digits.test)["loss"]
    T = weight_matching(A, B, keep_layernorm=True, guard_data=digits.val)
    aligned = evaluate(interpolate(A, apply_transform(B, T), 0.5, keep_layernorm=True), digits.test)["loss"]
    print(
        f"shared init: plain {plain:.3f}, aligned {aligned:.3f}, chosen {T.info['chosen']}, "
        f"guard losses {T.info['midpoint_loss']}"
    )
    assert set(T.info["midpoint_loss"]) == {"paper", "identity"}
    assert aligned <= plain + 0.02


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_nearby_model_comes_back_near_identity(digits, trained_a):
    """B = A after a short fine-tune on a skewed shard (shared init, little drift): data-free matching
    keeps (near) the identity and its merge is no worse than plain averaging."""
    A = trained_a
    B = model_for_data("vit-digits", digits, 0)
    B.load_state_dict(A.state_dict())
    _train(B, partition(digits.train, 2, "dirichlet", alpha=0.5, seed=1)[0], seed=5, epochs=2, lr=3e-4)
    T = weight_matching(A, B, keep_layernorm=True)
    plain = evaluate(interpolate(A, B, 0.5), digits.test)["loss"]
    aligned = evaluate(interpolate(A, apply_transform(B, T), 0.5, keep_layernorm=True), digits.test)["loss"]
    O = T.get("residual")
    drift = 0.0 if O is None else float((O - torch.eye(len(O), dtype=O.dtype)).norm() / len(O) ** 0.5)
    moved = sum(int((v != torch.arange(len(v))).sum()) for k, v in T.elements.items() if k.startswith(("heads", "ff")))
    print(
        f"nearby: plain {plain:.3f}, aligned {aligned:.3f}, chosen {T.info['chosen']}, O drift {drift:.3f}, "
        f"units moved {moved}"
    )
    assert drift < 0.1 and moved == 0
    assert aligned <= plain + 0.02
