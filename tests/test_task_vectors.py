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
from fedlmc.baselines.task_vectors import stock_ratio, task_vector_merge, trim

BASE = {"w": torch.tensor([1.0, 1.0, 1.0]), "steps": torch.tensor(7)}


def _states(*taus):
    return [{"w": BASE["w"] + torch.tensor(t, dtype=torch.float32), "steps": torch.tensor(9)} for t in taus]


def test_task_arithmetic_at_scale_one_is_the_weighted_mean():
    states = _states([3.0, -1.0, 0.5], [1.0, 2.0, -0.5])
    got = task_vector_merge(BASE, states, [1.0, 3.0], TaskMerge(method="task-arithmetic"))
    assert torch.allclose(got["w"], BASE["w"] + torch.tensor([1.5, 1.25, -0.25]))
    assert got["steps"] == 7  # integer tensors are the base's
    half = task_vector_merge(BASE, states, [1.0, 3.0], TaskMerge(scale=0.5))
    assert torch.allclose(half["w"], BASE["w"] + torch.tensor([0.75, 0.625, -0.125]))


def test_ties_trims_elects_the_sign_and_averages_the_entries_that_agree():
    assert torch.equal(trim(torch.tensor([3.0, -1.0, 0.1, 2.0]), 0.5), torch.tensor([3.0, 0.0, 0.0, 2.0]))
    states = _states([3.0, -1.0, 0.1], [2.0, 2.0, -0.1], [-1.0, 1.0, 0.2])
    # no trimming: signs of the sums are +, +, +; the agreeing entries' means: (3+2)/2, (2+1)/2, (0.1+0.2)/2
    got = task_vector_merge(BASE, states, None, TaskMerge(method="ties", density=1.0))
    assert torch.allclose(got["w"], BASE["w"] + torch.tensor([2.5, 1.5, 0.15]))
    # density 1/3: each keeps its largest entry: 3 (coord 0), 2 (coord 0 or 1: tie kept), 1 (coord 1)
    got = task_vector_merge(BASE, states, None, TaskMerge(method="ties", density=1 / 3))
    assert torch.allclose(got["w"], BASE["w"] + torch.tensor([2.5, 1.5, 0.0]))


def test_dare_drops_and_rescales_without_bias():
    states = _states([2.0, -4.0, 6.0], [0.0, 4.0, 2.0])
    exact = task_vector_merge(BASE, states, None, TaskMerge(method="task-arithmetic"))
    assert torch.equal(task_vector_merge(BASE, states, None, TaskMerge(method="dare", drop=0.0))["w"], exact["w"])
    got = task_vector_merge(BASE, states, None, TaskMerge(method="dare", drop=0.5, seed=3))["w"] - BASE["w"]
    # each client's entry is either dropped or doubled: the merge is a sum of {0, 2·τ/2} terms
    choices = [{0.0, t1} | {t2} | {t1 + t2} for t1, t2 in zip([2.0, -4.0, 6.0], [0.0, 4.0, 2.0])]
    assert all(float(v) in c for v, c in zip(got, choices)), got
    big = {"w": torch.zeros(20000)}
    tau = [{"w": torch.full((20000,), 1.0)}]
    mean = float(task_vector_merge(big, tau, None, TaskMerge(method="dare", drop=0.9))["w"].mean())
    assert mean == pytest.approx(1.0, abs=0.05)  # E[keep / (1 − p)] = 1


def test_model_stock_interpolates_by_the_angle_between_task_vectors():
    same = _states([1.0, 2.0, 0.0], [1.0, 2.0, 0.0])
    assert torch.allclose(task_vector_merge(BASE, same, None, TaskMerge(method="model-stock"))["w"], same[0]["w"])
    apart = _states([1.0, 0.0, 0.0], [0.0, 1.0, 0.0])  # orthogonal: the base
    assert torch.allclose(task_vector_merge(BASE, apart, None, TaskMerge(method="model-stock"))["w"], BASE["w"])
    sixty = torch.tensor([[1.0, 0.0], [0.5, math.sqrt(3) / 2]], dtype=torch.float64)  # cos 0.5, N = 2: t = 2/3
    assert stock_ratio(sixty) == pytest.approx(2 / 3)


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
    if method == "task-arithmetic":  # from a zero base, λ = 1: FedAvg
        _same(arrays, FedAvg().aggregate_train(1, _copies(replies))[0])
