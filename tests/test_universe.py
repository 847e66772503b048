"""Universe (M-way) merging: planted symmetries, one-hot weights."""

from __future__ import annotations

import pytest
import torch
from conftest import inputs_for, perturbed

from fedlmc.merging.universe import universe_merge
from fedlmc.models import from_preset
from fedlmc.options import Matching, Universe
from fedlmc.symmetry import apply_transform, canonicalize, random_transform


def _base():
    torch.manual_seed(0)
    return canonicalize(
        perturbed(
            from_preset("vit-tiny", n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=12, patch_size=4), 0, 0.2
        )
    )


def _noisy(model, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return model


def test_planted_universe_recovers_the_model(record):
    base = _base()
    x = inputs_for(base)
    copies = [
        _noisy(apply_transform(base, random_transform(base, seed=s, groups=["residual", "heads", "ff"])), 1e-3, s)
        for s in range(4)
    ]
    merged, Ts = universe_merge(copies, universe=Universe(iterations=3, keep_layernorm=False))
    assert len(Ts) == 4
    # the merged model is the original up to one shared symmetry: compare functions
    with torch.no_grad():
        gap = float((merged(x) - base(x)).abs().max() / base(x).abs().max())
        naive = float((sum(c.state_dict()["head.weight"] for c in copies) / 4 - base.head.weight).abs().max())
    record("universe of 4 planted copies: relative |Δlogits|", gap, 2e-2)
    assert naive > 0.05  # plain averaging of the same copies is far off


def test_one_hot_weights_return_that_model(record):
    base = _base()
    x = inputs_for(base)
    others = [_noisy(apply_transform(base, random_transform(base, seed=s)), 0.3, s) for s in range(3)]
    merged, _ = universe_merge(
        [others[0], others[1], others[2]], weights=[0, 1, 0], universe=Universe(iterations=5, keep_layernorm=False)
    )
    with torch.no_grad():
        record("universe with one-hot weights vs that model", float((merged(x) - others[1](x)).abs().max()), 1e-10)


def test_lift_then_project_is_the_identity(record):
    from fedlmc.merging.universe import project

    small = _base()
    x = inputs_for(small)
    d = small.config.d_model
    for width in (d, 2 * d, 3 * d + 1):
        T = random_transform(small, seed=width, width=width)  # lift + head/FF perms + invertible gauges
        lifted = apply_transform(small, T)
        assert lifted.config.d_model == width
        with torch.no_grad():
            record(f"lift {d}->{width}: lifted vs small", float((lifted(x) - small(x)).abs().max()), 1e-10)
            back = project(lifted, T)
            assert back.config.d_model == d and abs(back.config.norm_eps - small.config.norm_eps) < 1e-18
            record(f"lift {d}->{width} then project: vs small", float((back(x) - small(x)).abs().max()), 1e-10)
            sd, sb = small.state_dict(), back.state_dict()
            assert max(float((sd[k] - sb[k]).abs().max()) for k in sd) < 1e-10  # its own coordinates too


def test_central_anchor_is_the_least_noisy_copy_and_residual_data_still_recovers(record):
    """Copies with noise 0.01, 0.01, 0.001, 0.01: pairwise distances are ≈ √(ε_i² + ε_j²), so the
    central anchor is the quiet copy (the heaviest rule would take the first); a universe started there
    and with residual activations in every matching still recovers the model."""
    import pytest

    from fedlmc.data.base import ArrayData
    from fedlmc.merging.universe import anchor_index, members

    base = _base()
    x = inputs_for(base)
    copies = [
        _noisy(
            apply_transform(base, random_transform(base, seed=s, groups=["residual", "heads", "ff"])),
            0.001 if s == 2 else 0.01,
            s,
        )
        for s in range(4)
    ]
    mem = members(copies, None, None, False)
    assert anchor_index(mem, "central", {}) == 2 and anchor_index(mem, "heaviest", {}) == 0
    g = torch.Generator().manual_seed(0)
    c = base.config
    data = ArrayData(
        torch.randn(64, c.channels, c.image_size, c.image_size, generator=g, dtype=torch.float64),
        torch.randint(0, 10, (64,), generator=g),
    )
    merged, _ = universe_merge(
        copies,
        matching=Matching(residual_data=data),
        universe=Universe(iterations=2, anchor="central", keep_layernorm=False),
    )
    with torch.no_grad():
        record(
            "universe (central anchor, residual data) of 4 planted copies: relative |Δlogits|",
            float((merged(x) - base(x)).abs().max() / base(x).abs().max()),
            5e-2,
        )
    with pytest.raises(ValueError, match="anchor"):
        universe_merge(copies, universe=Universe(anchor="median", iterations=5, keep_layernorm=False))


def test_the_streamed_average_is_the_average_of_the_aligned_models(record):
    """The universe's average aligns one model at a time and sums its aligned state as it comes (never
    building the aligned models): it equals the weighted average of the aligned models."""
    from fedlmc.merging.averaging import merge
    from fedlmc.merging.universe import members

    base = _base().double()
    copies = [_noisy(apply_transform(base, random_transform(base, seed=s)), 0.1, s) for s in range(3)]
    mem = members(copies, [0.2, 0.3, 0.5], None, False)
    Ts = [random_transform(p, seed=10 + s, groups=["residual", "heads", "ff"]) for s, p in enumerate(mem.padded)]
    got = mem.merge(Ts).state_dict()
    want = merge([apply_transform(p, T) for p, T in zip(mem.padded, Ts)], mem.weights).state_dict()
    assert got.keys() == want.keys()
    record(
        "streamed average vs average of the aligned models (float64)",
        max(float((got[k] - want[k]).abs().max()) for k in want),
        1e-12,
    )


def test_min_gain_keeps_replies_from_the_global_model_and_still_aligns_planted_copies():
    """Matching(min_gain): replies trained a little from the start model (small noise) keep the identity,
    so the universe is their plain mean and stops after its second iteration (after its first when it
    starts from that mean, ``start="average"``); copies in other
    coordinates (a planted symmetry) are still aligned, whatever min_gain below their gain."""
    base = _base()
    common = [_noisy(canonicalize(base), 0.01, 10 + s) for s in range(4)]
    m = Matching(min_gain=0.3)  # at d 32 the gauges and the rotation fit ~20 % of a noisy reply's distance
    merged, Ts = universe_merge(common, start=base, matching=m, universe=Universe(iterations=5, keep_layernorm=False))
    assert all(T.elements == {} for T in Ts) and Ts[0].info["universe_iterations"] == 2
    mean = {k: sum(c.state_dict()[k] for c in common) / 4 for k in base.state_dict()}
    assert max(float((merged.state_dict()[k] - v).abs().max()) for k, v in mean.items()) < 1e-12
    _, plain = universe_merge(
        common, start=base, universe=Universe(iterations=5, keep_layernorm=False)
    )  # without min_gain the gauges fit the noise
    assert all(T.elements for T in plain)

    from_mean, Ts_mean = universe_merge(
        common, start="average", matching=m, universe=Universe(iterations=5, keep_layernorm=False)
    )  # one iteration does
    assert all(T.elements == {} for T in Ts_mean) and Ts_mean[0].info["universe_iterations"] == 1
    assert max(float((from_mean.state_dict()[k] - v).abs().max()) for k, v in mean.items()) < 1e-12
    with pytest.raises(ValueError, match="start"):
        universe_merge(common, start="median", universe=Universe(iterations=5, keep_layernorm=False))

    planted = [
        _noisy(apply_transform(base, random_transform(base, seed=s, groups=["residual", "heads", "ff"])), 1e-3, s)
        for s in range(2)
    ]
    from fedlmc.matching import weight_matching

    T = weight_matching(planted[0], planted[1], m)
    assert T.elements and T.info["gain"] > 0.5 and T.info["chosen"] != "identity"
    assert "gave_up" not in T.info
    with pytest.raises(ValueError, match="min_gain"):
        Matching(min_gain=1.0)


def test_min_gain_descent_gives_up_once_settled_far_from_the_gain_it_needs(monkeypatch):
    """With ``min_gain`` the descent stops after an iteration that left every permutation as it was and
    gained less than half of ``min_gain``: a noisy copy of A keeps the identity after one iteration, as
    the descent run to its end decides too; copies in other coordinates never give up."""
    from fedlmc.matching import weight as weight_module
    from fedlmc.matching import weight_matching

    base = _base()
    m = Matching(min_gain=0.4)  # at d 32 one iteration gains ~17 % of a noisy copy's distance
    real = weight_module.coordinate_descent
    for s in range(3):
        reply = _noisy(canonicalize(base), 0.01, 10 + s)
        T = weight_matching(base, reply, m)
        assert T.info["gave_up"] == "paper" and T.info["iterations"]["paper"] == 1, T.info
        assert T.info["chosen"] == "identity" and T.elements == {}
        monkeypatch.setattr(weight_module, "coordinate_descent", lambda P, el, give_up=None, **kw: real(P, el, **kw))
        full = weight_matching(base, reply, m)
        monkeypatch.setattr(weight_module, "coordinate_descent", real)
        assert full.info["chosen"] == "identity" and full.info["iterations"]["paper"] > 1, full.info
        assert full.info["gain"] <= m.min_gain and "gave_up" not in full.info
        # the one iteration found less than half the gain asked
        assert T.info["gain"] < m.min_gain / 2
    planted = apply_transform(base, random_transform(base, seed=3, groups=["residual", "heads", "ff"]))
    T = weight_matching(base, _noisy(planted, 1e-3, 3), m)
    assert "gave_up" not in T.info and T.info["chosen"] != "identity"


def test_a_descent_that_gives_up_skips_the_cross_covariances_only_a_further_iteration_reads(monkeypatch):
    """Giving up, the descent takes its last value from the distances themselves: the cross-covariances
    are computed once (for the identity), not again after the gauge step, and the value is the one the
    cross-covariances give."""
    from fedlmc.matching import weight as weight_module
    from fedlmc.matching import weight_matching

    base = _base()
    reply = _noisy(canonicalize(base), 0.01, 10)
    crosses, real, real_settled = [], weight_module._crosses, weight_module._settled_value
    monkeypatch.setattr(weight_module, "_crosses", lambda P, el: crosses.append(1) or real(P, el))
    T = weight_matching(base, reply, Matching(min_gain=0.4))
    assert T.info["gave_up"] == "paper" and crosses == [1], (T.info, crosses)
    monkeypatch.setattr(weight_module, "_settled_value", lambda *a, **k: None)  # the value from the crosses
    crosses.clear()
    ref = weight_matching(base, reply, Matching(min_gain=0.4))
    assert ref.info["gave_up"] == "paper" and crosses == [1, 1]
    got, want = T.info["trace"]["paper"][-1], ref.info["trace"]["paper"][-1]
    assert abs(got - want) <= 1e-9 * want, (got, want)
    # with bfloat16 products too: the rest rotated in the problem's dtype, so its distances are exact
    monkeypatch.setattr(weight_module, "_settled_value", real_settled)
    crosses.clear()
    fast = weight_matching(base, reply, Matching(min_gain=0.4, precision="bfloat16"))
    assert fast.info["gave_up"] == "paper" and crosses == [1], (fast.info, crosses)
    assert abs(fast.info["trace"]["paper"][-1] - got) <= 1e-2 * got


def test_a_long_universe_iteration_reports_its_progress_without_being_asked(monkeypatch):
    """An iteration longer than ``PROGRESS_EVERY`` seconds logs how many models it has aligned, and its
    end, on Flower's logger; a short one says nothing unless ``progress`` is asked for."""
    import logging

    import fedlmc.merging.universe as universe_module

    base = _base()
    copies = [
        _noisy(apply_transform(base, random_transform(base, seed=s, groups=["residual", "heads", "ff"])), 1e-3, s)
        for s in range(4)
    ]
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("flwr")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        universe_merge(copies, universe=Universe(iterations=1, keep_layernorm=False))  # short iterations: quiet
        assert not [x for x in lines if x.startswith("universe iteration")]
        monkeypatch.setattr(universe_module, "PROGRESS_EVERY", 0.0)  # every iteration is "long"
        universe_merge(copies, universe=Universe(iterations=1, keep_layernorm=False))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # the universe starts as one of the 4 copies: 3 to align; a line after each but the last, then the end
    progress = [x for x in lines if x.startswith("universe iteration 1:")]
    assert [x.split(",")[0] for x in progress] == [
        "universe iteration 1: 1 of 3 models aligned",
        "universe iteration 1: 2 of 3 models aligned",
        "universe iteration 1: 3 models aligned",
    ]
