"""Rounds that go on: every registered strategy, run through Flower's ``start()``, survives a round in
which every node fails (or half of them do), keeps the current arrays as Flower's FedAvg does, says so in
its log and history, and aggregates again once the nodes answer."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Error, Message
from flwr.serverapp.strategy import FedAvg
from test_flower_contract import Grid, _lora, _mlp_arrays

from fedlmc.federated import Settings, global_model, splits_for
from fedlmc.strategies import AlignedFedAvg, AverageFedAvg
from fedlmc.strategies.records import state_arrays
from fedlmc.strategies.registry import REGISTRY
from strategies.factory import build_strategy


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)


class FailingGrid(Grid):
    """Flower's grid where the nodes in ``down[r]`` answer round r's messages (train and evaluate) with
    Flower's error reply, as nodes that dropped out do; the others answer as ``Grid``'s do."""

    def __init__(self, down: dict[int, set[int]], **kw) -> None:
        super().__init__(**kw)
        self.down = down

    def _answer(self, m: Message, mid: str) -> Message:
        rnd = int(m.content["config"].get("server-round", 0))
        if int(m.metadata.dst_node_id) in self.down.get(rnd, set()):
            return Message(Error(code=0, reason="node unavailable"), reply_to=m)
        return super()._answer(m, mid)


def _strategy(name: str):
    """The registered strategy ``name`` on vit-digits (shipped data), as the apps' factory builds it,
    evaluating on every node, and its initial arrays."""
    run = {"strategy": name, "preset": "vit-digits", "eval-batches": 1, "fraction-evaluate": 1.0, "min-nodes": 2}
    if REGISTRY[name].can.mixed_widths:
        run["width-factors"] = "1,2"
    s = Settings.from_run_config(run)
    model = global_model(s)
    return build_strategy(s, model.config, splits_for(s)), state_arrays(model)


def _changed(a, b) -> bool:
    return any(not np.array_equal(x, y) for x, y in zip(a.to_numpy_ndarrays(), b.to_numpy_ndarrays()))


def _rounds(strategy):
    return [r for r in strategy.history if "round" in r]


@pytest.mark.parametrize("name", list(REGISTRY))
def test_a_round_whose_nodes_all_fail_keeps_the_arrays_and_the_next_round_aggregates(name, caplog):
    strategy, initial = _strategy(name)
    grid = FailingGrid({1: {1, 2, 3, 4}})
    with caplog.at_level(logging.WARNING):
        result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=2, timeout=5)
    rounds = _rounds(strategy)
    assert rounds[0]["round"] == 1 and rounds[0]["kept"] == "previous"
    assert sorted(f["node"] for f in rounds[0]["failures"]) == [1, 2, 3, 4]
    assert "keeping the previous global model" in caplog.text
    assert 1 not in result.train_metrics_clientapp and 2 in result.train_metrics_clientapp
    assert rounds[-1]["round"] == 2 and rounds[-1]["nodes"] and rounds[-1].get("kept") != "previous"
    assert _changed(result.arrays, initial), "round 2 aggregated nothing"


@pytest.mark.parametrize("name", list(REGISTRY))
def test_a_round_where_half_the_nodes_fail_aggregates_the_others(name):
    strategy, initial = _strategy(name)
    result = strategy.start(grid=FailingGrid({1: {2, 4}}), initial_arrays=initial, num_rounds=1, timeout=5)
    record = _rounds(strategy)[-1]
    assert set(record["nodes"]) <= {1, 3} and sorted(f["node"] for f in record["failures"]) == [2, 4]
    assert _changed(result.arrays, initial)
    assert 1 in result.evaluate_metrics_clientapp  # the evaluation of the nodes that answered


@pytest.mark.parametrize("make", [AverageFedAvg, lambda: AlignedFedAvg(fallback="average")])
def test_an_unreadable_model_round_with_every_node_failed_goes_on_as_flowers_fedavg(make):
    """Arrays that are no fedlmc model (averaged as Flower's FedAvg averages them): the same result as
    Flower's FedAvg on the same grid, rounds 1 (every node failed) and 2."""
    results = {}
    for key, strategy in (("flower", FedAvg()), ("ours", make())):
        grid = FailingGrid({1: {1, 2, 3, 4}})
        results[key] = strategy.start(grid=grid, initial_arrays=_mlp_arrays(), num_rounds=2, timeout=5)
    for x, y in zip(results["ours"].arrays.to_numpy_ndarrays(), results["flower"].arrays.to_numpy_ndarrays()):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    assert dict(results["ours"].train_metrics_clientapp) == dict(results["flower"].train_metrics_clientapp)


def test_lora_fedavg_keeps_its_adapter_when_every_node_fails():
    strategy, arrays = _lora()
    result = strategy.start(grid=FailingGrid({1: {1, 2, 3, 4}}), initial_arrays=arrays, num_rounds=2, timeout=5)
    assert strategy.history[0]["replies"] == 0 and strategy.history[1]["replies"] == 4
    assert _changed(result.arrays, arrays)
