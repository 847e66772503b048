"""Task-vector merges on hand-made task vectors, where each method's answer can be written down, and as
registered strategies on Flower replies."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg
from test_flower_contract import Grid, _copies, _replies, _same, task_identity  # noqa: F401  (the fixture)

from fedlmc.baselines import TaskMerge, TaskVectorFedAvg
from fedlmc.baselines.task_vectors import client_weights, dropped, stock_ratio, task_vector_merge, trim

BASE = {"w": torch.tensor([1.0, 1.0, 1.0]), "steps": torch.tensor(7)}


def _states(*taus):
    return [{"w": BASE["w"] + torch.tensor(t, dtype=torch.float32), "steps": torch.tensor(9)} for t in taus]


def test_task_arithmetic_sums_the_weighted_task_vectors_as_mergekit_does():
    states = _states([3.0, -1.0, 0.5], [1.0, 2.0, -0.5])
    got = task_vector_merge(BASE, states, [1.0, 3.0], TaskMerge(method="task-arithmetic"))
    assert torch.allclose(got["w"], BASE["w"] + torch.tensor([6.0, 5.0, -1.0]))  # 1·τ₁ + 3·τ₂
    assert got["steps"] == 7  # integer tensors are the base's
    half = task_vector_merge(BASE, states, [1.0, 3.0], TaskMerge(scale=0.5, normalize=True))
    assert torch.allclose(half["w"], BASE["w"] + torch.tensor([0.75, 0.625, -0.125]))  # λ · weighted mean
    assert client_weights([10, 30]) == [0.5, 1.5] and client_weights([7, 7, 7]) == [1.0, 1.0, 1.0]


def test_ties_keeps_int_density_n_entries_elects_plus_on_a_tie_and_averages_the_agreeing_ones():
    assert torch.equal(trim(torch.tensor([3.0, -1.0, 0.1, 2.0]), 0.5), torch.tensor([3.0, 0.0, 0.0, 2.0]))
    tau = torch.arange(1.0, 49.0)  # int(0.2 · 48) = 9 entries kept (round would keep 10)
    assert int((trim(tau, 0.2) != 0).sum()) == 9 and int((trim(tau, 0.01) != 0).sum()) == 1
    states = _states([3.0, -1.0, 0.1], [2.0, 2.0, -0.1], [-1.0, 1.0, 0.2])
    # no trimming: signs of the sums are +, +, +; the agreeing entries' means: (3+2)/2, (2+1)/2, (0.1+0.2)/2
    got = task_vector_merge(BASE, states, None, TaskMerge(method="ties", density=1.0))
    assert torch.allclose(got["w"], BASE["w"] + torch.tensor([2.5, 1.5, 0.15]))
    # unnormalised (mergekit's normalize: false): the agreeing entries' sums
    got = task_vector_merge(BASE, states, None, TaskMerge(method="ties", density=1.0, normalize=False))
    assert torch.allclose(got["w"], BASE["w"] + torch.tensor([5.0, 3.0, 0.3]))
    # a coordinate whose weighted sum is 0 elects +: the positive entry alone survives
    tie = task_vector_merge(
        BASE, _states([2.0, 0.0, 0.0], [-2.0, 0.0, 0.0]), None, TaskMerge(method="ties", density=1.0)
    )
    assert torch.allclose(tie["w"], BASE["w"] + torch.tensor([2.0, 0.0, 0.0]))


def test_dare_drops_and_rescales_to_the_l1_norm_or_by_the_inverse_keep_rate():
    states = _states([2.0, -4.0, 6.0], [0.0, 4.0, 2.0])
    exact = task_vector_merge(BASE, states, None, TaskMerge(method="task-arithmetic"))
    assert torch.equal(task_vector_merge(BASE, states, None, TaskMerge(method="dare", drop=0.0))["w"], exact["w"])
    gen = torch.Generator().manual_seed(0)
    tau = torch.randn(1000, dtype=torch.float64)
    l1 = dropped(tau, 0.7, "l1", gen)
    assert l1.abs().sum().item() == pytest.approx(tau.abs().sum().item(), rel=1e-12)  # the norm kept
    assert 200 < int((l1 != 0).sum()) < 400
    kept = l1 != 0
    ratio = l1[kept] / tau[kept]
    assert torch.allclose(ratio, torch.full_like(ratio, float(ratio[0])))  # one factor for every survivor
    inverse = dropped(tau, 0.5, "inverse", gen)
    assert torch.allclose(inverse[inverse != 0], 2 * tau[inverse != 0])
    big = {"w": torch.zeros(20000)}
    ones = [{"w": torch.full((20000,), 1.0)}]
    merge = TaskMerge(method="dare", drop=0.9, rescale="inverse")
    assert float(task_vector_merge(big, ones, None, merge)["w"].mean()) == pytest.approx(1.0, abs=0.05)


def test_model_stock_interpolates_by_the_angle_without_clipping():
    same = _states([1.0, 2.0, 0.0], [1.0, 2.0, 0.0])
    assert torch.allclose(task_vector_merge(BASE, same, None, TaskMerge(method="model-stock"))["w"], same[0]["w"])
    apart = _states([1.0, 0.0, 0.0], [0.0, 1.0, 0.0])  # orthogonal: the base
    assert torch.allclose(task_vector_merge(BASE, apart, None, TaskMerge(method="model-stock"))["w"], BASE["w"])
    sixty = torch.tensor([[1.0, 0.0], [0.5, math.sqrt(3) / 2]], dtype=torch.float64)  # cos 0.5, N = 2: t = 2/3
    assert stock_ratio(sixty) == pytest.approx(2 / 3)
    obtuse = torch.tensor([[1.0, 0.0], [-0.5, math.sqrt(3) / 2]], dtype=torch.float64)  # cos −0.5: t = −2
    assert stock_ratio(obtuse) == pytest.approx(-2.0)
    assert stock_ratio(torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)) == 0.0  # 1 + c = 0: base


def test_task_merge_refuses_a_knob_its_method_does_not_use():
    assert TaskMerge(method="ties").density == 0.2 and TaskMerge(method="ties").normalize is True
    assert TaskMerge(method="dare").drop == 0.9 and TaskMerge(method="dare").rescale == "l1"
    assert TaskMerge().normalize is False and TaskMerge().density is None
    for bad in (
        dict(method="task-arithmetic", density=0.3),
        dict(method="ties", drop=0.5),
        dict(method="ties", rescale="l1"),
        dict(method="model-stock", scale=0.5),
        dict(method="model-stock", normalize=True),
        dict(method="dare", rescale="l2"),
        dict(method="ties", density=0.0),
    ):
        with pytest.raises(ValueError):
            TaskMerge(**bad)


def _mergekit():
    """mergekit's task-arithmetic family and Model Stock (``pip install --no-deps mergekit``), or a skip."""
    pytest.importorskip("mergekit.sparsify")
    gta = pytest.importorskip("mergekit.merge_methods.generalized_task_arithmetic")
    base = pytest.importorskip("mergekit.merge_methods.base")
    stock = pytest.importorskip("mergekit.merge_methods.model_stock")
    return gta, base, stock


@pytest.mark.parametrize("method", ["task-arithmetic", "ties", "dare", "model-stock"])
def test_the_merges_match_mergekits_own_functions(method):
    gta, mb, stock = _mergekit()
    from mergekit.sparsify import SparsificationMethod

    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6, 8, dtype=torch.float64, generator=gen)
    clients = [base + torch.randn(6, 8, dtype=torch.float64, generator=gen) for _ in range(3)]
    weights = [0.5, 1.0, 2.0]
    entries = [mb.TensorEntry(id="base", tensor=base, is_base=True)]
    entries += [mb.TensorEntry(id=i, tensor=c) for i, c in enumerate(clients)]
    group = mb.TensorGroup(entries=tuple(entries))
    per = lambda v: {i: v for i in range(3)}  # noqa: E731  (mergekit's per-model parameters)
    if method == "model-stock":
        theirs = stock.model_stock_merge_method.merge_group(group, filter_wise=False)
        ours = task_vector_merge({"w": base}, [{"w": c} for c in clients], None, TaskMerge(method=method))["w"]
        assert torch.allclose(ours, theirs, atol=1e-12)
        return
    spec = {
        "task-arithmetic": (None, None, False),
        "ties": (gta.ConsensusMethod.sum, SparsificationMethod.magnitude, True),
        "dare": (None, SparsificationMethod.random, False),
    }[method]
    theirs_method = gta.GeneralizedTaskArithmeticMerge(
        consensus_method=spec[0],
        sparsification_method=spec[1],
        default_normalize=spec[2],
        default_rescale=method == "dare",
        method_name=method,
        method_pretty_name=None,
        method_reference_url=None,
    )
    density = {"task-arithmetic": 1.0, "ties": 0.2, "dare": 1.0}[method]  # DARE: no drop (mergekit's RNG)
    params = {
        "weight": {i: w for i, w in enumerate(weights)},
        "density": per(density),
        "int8_mask": False,
        "normalize": spec[2],
        "rescale": method == "dare",
        "lambda": 0.7,
    }
    theirs = theirs_method.merge_group(group, **params)
    knobs = {"ties": dict(density=0.2), "dare": dict(drop=0.0)}.get(method, {})
    merge = TaskMerge(method=method, scale=0.7, **knobs)
    ours = task_vector_merge({"w": base}, [{"w": c} for c in clients], weights, merge)["w"]
    assert torch.allclose(ours, theirs, atol=1e-12)


def test_dare_rescales_as_mergekits_sparsify_does():
    _mergekit()
    from mergekit.sparsify import RescaleNorm, rescaled_masked_tensor

    gen = torch.Generator().manual_seed(2)
    tau = torch.randn(40, dtype=torch.float64, generator=gen)
    ours = dropped(tau, 0.6, "l1", torch.Generator().manual_seed(9))
    theirs = rescaled_masked_tensor(tau, (ours != 0).to(tau.dtype), RescaleNorm.l1)  # the same survivors
    assert torch.allclose(ours, theirs, atol=1e-12)


@pytest.mark.parametrize("method", ["task-arithmetic", "ties", "dare", "model-stock"])
def test_the_merges_are_registered_strategies_on_a_shared_base(method):
    from fedlmc.federated import Settings
    from fedlmc.models import from_preset
    from fedlmc.strategies.registry import build

    got = build(Settings.from_run_config({"strategy": method}), from_preset("vit-digits").config.to_dict(), None)
    assert isinstance(got, TaskVectorFedAvg) and got.merge.method == method
    strategy = TaskVectorFedAvg(merge=TaskMerge(method=method))
    base = ArrayRecord([np.zeros((2, 3), np.float32), np.zeros(4, np.float32)])
    list(strategy.configure_train(1, base, ConfigRecord({}), Grid(3)))
    replies = _replies(3, seed=7)
    arrays, _ = strategy.aggregate_train(1, _copies(replies))
    assert all(np.isfinite(a).all() for a in arrays.to_numpy_ndarrays())
    if method == "task-arithmetic":  # from a zero base, normalised at λ = 1: FedAvg
        strategy = TaskVectorFedAvg(merge=TaskMerge(method=method, normalize=True))
        list(strategy.configure_train(1, base, ConfigRecord({}), Grid(3)))
        _same(strategy.aggregate_train(1, _copies(replies))[0], FedAvg().aggregate_train(1, _copies(replies))[0])
