"""Robust aggregation modulo symmetries: the coordinate-wise median / trimmed mean taken among the
*aligned* replies; on raw replies the same reduce is Flower's FedMedian / FedTrimmedAvg."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import inputs_for, perturbed
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg
from test_strategies import _reply

from fedlmc.merging.averaging import robust_state
from fedlmc.merging.universe import universe_merge
from fedlmc.models import from_preset
from fedlmc.options import Robust, Universe
from fedlmc.strategies import AlignedFedAvg, AverageFedAvg
from fedlmc.strategies.records import model_from_arrays
from fedlmc.symmetry import apply_transform, canonicalize, random_transform, to_layernorm
from simulations.experiment import flip_update, shuffled_labels

KW = dict(n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4)


def test_robust_state_is_the_coordinatewise_median_and_trimmed_mean():
    g = torch.Generator().manual_seed(0)
    for M in (4, 5):
        states = [{"w": torch.randn(3, 7, generator=g)} for _ in range(M)]
        stack = np.stack([s["w"].numpy() for s in states])
        assert np.allclose(robust_state(states, "median")["w"].numpy(), np.median(stack, axis=0), atol=1e-6)
        k = int(0.25 * M)
        trimmed = np.sort(stack, axis=0)[k : M - k].mean(0)
        assert np.allclose(robust_state(states, "trimmed", 0.25)["w"].numpy(), trimmed, atol=1e-6)
    with pytest.raises(ValueError):
        robust_state(states, "mode")
    with pytest.raises(ValueError):
        robust_state(states, "trimmed", 0.5)


def _copies_and_a_poisoned_one(n: int = 4):
    torch.manual_seed(0)
    base = perturbed(from_preset("vit-tiny", **KW), 0, 0.2).double()
    canon = canonicalize(base)
    copies = [
        to_layernorm(
            apply_transform(canon, random_transform(canon, seed=s, fix_ones=True, groups=["residual", "heads", "ff"]))
        )
        for s in range(n)
    ]
    bad = perturbed(from_preset("vit-tiny", **KW), 9, 0.2).double()
    with torch.no_grad():
        for p in bad.parameters():
            p.mul_(-3.0)  # a large, sign-flipped model
    return base, copies, bad


def test_aligned_median_ignores_a_poisoned_reply_that_moves_the_aligned_mean(record):
    """4 clients hold one function in their own coordinates, a 5th is poisoned: the median of the
    aligned replies is the clean model, while their mean is pulled away and the median of the raw
    replies (Flower's FedMedian) mixes unaligned coordinates."""
    base, copies, bad = _copies_and_a_poisoned_one()
    x = inputs_for(base)
    ref = base(x)
    with torch.no_grad():
        med, _ = universe_merge(
            copies + [bad], universe=Universe(iterations=3, keep_layernorm=True), robust=Robust(reduce="median")
        )
        mean, _ = universe_merge(copies + [bad], universe=Universe(iterations=3, keep_layernorm=True))
        raw = from_preset("vit-tiny", **KW).double()
        raw.load_state_dict(robust_state([m.state_dict() for m in copies + [bad]], "median"))
        rel = lambda m: float((m(x) - ref).abs().max() / ref.abs().max())  # noqa: E731
        record("robust: aligned median of 4 copies + 1 poisoned vs the model (rel.)", rel(med), 1e-5)
        assert rel(mean) > 0.1 and rel(raw) > 0.1, (rel(mean), rel(raw))


def test_reporting_fedavg_reduce_is_flowers_fedmedian_and_fedtrimmedavg():
    base, copies, bad = _copies_and_a_poisoned_one(3)

    def replies():  # fresh each time: Flower's strategies consume the replies' records
        return [_reply(m.float(), 10, node=i + 1) for i, m in enumerate(copies + [bad])]

    for reduce, theirs in (("median", FedMedian()), ("trimmed", FedTrimmedAvg(beta=0.25))):
        ours = AverageFedAvg(model=copies[0].config.to_dict(), robust=Robust(reduce=reduce, trim=0.25))
        a, _ = ours.aggregate_train(1, replies())
        b, _ = theirs.aggregate_train(1, replies())
        sa, sb = a.to_torch_state_dict(), b.to_torch_state_dict()
        assert max(float((sa[k] - sb[k]).abs().max()) for k in sb) < 1e-5


def test_aligned_fedavg_reduce_option_and_guard_against_the_plain_robust_aggregate():
    base, copies, bad = _copies_and_a_poisoned_one()
    replies = [_reply(m.float(), 10, node=i + 1) for i, m in enumerate(copies + [bad])]
    strategy = AlignedFedAvg(model=copies[0].config.to_dict(), robust=Robust(reduce="median"))
    strategy._previous = ArrayRecord(torch_state_dict=copies[0].float().state_dict())
    arrays, _ = strategy.aggregate_train(1, replies)
    merged = model_from_arrays(arrays, strategy.global_config)
    x = inputs_for(base).float()
    with torch.no_grad():
        assert float((merged(x) - base.float()(x)).abs().max() / base.float()(x).abs().max()) < 1e-4
    with pytest.raises(ValueError, match="reduce"):
        AlignedFedAvg(model=base.config.to_dict(), robust=Robust(reduce="mode"))


def test_poisoned_clients():
    from fedlmc.data.base import ArrayData, TokenData

    d = ArrayData(torch.randn(50, 1, 4, 4), torch.arange(50) % 10)
    p = shuffled_labels(d, 0)
    assert torch.equal(p.x, d.x) and sorted(p.y.tolist()) == sorted(d.y.tolist()) and not torch.equal(p.y, d.y)
    t = shuffled_labels(TokenData(torch.arange(100), 8), 0)
    assert sorted(t.tokens.tolist()) == list(range(100)) and not torch.equal(t.tokens, torch.arange(100))
    m = from_preset("vit-tiny", **KW)
    start = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        for q in m.parameters():
            q.add_(1.0)
    flip_update(m, start, 2.0)
    k = "head.weight"
    assert torch.allclose(m.state_dict()[k], start[k] - 2.0)


def test_median_of_different_layernorm_models_goes_back_to_layernorm():
    """The coordinate-wise median of centred streams is not centred; the universe projects the writers
    back onto 1⊥ (``recentre``) so the aggregate is again an ordinary LayerNorm model."""
    models = [perturbed(from_preset("vit-tiny", **KW), s, 0.2).double() for s in range(5)]
    with torch.no_grad():
        med, _ = universe_merge(
            models, universe=Universe(iterations=1, keep_layernorm=True), robust=Robust(reduce="median")
        )
    assert med.config.norm == "layernorm"
