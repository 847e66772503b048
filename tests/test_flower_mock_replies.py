"""Flower's own strategy tests build replies with a ``Mock(spec=Message)`` that has content and no
metadata (``create_mock_reply`` in Flower's ``strategy_utils_test.py``). fedlmc's strategies configured to
be FedAvg-equivalent aggregate such replies as Flower's strategies do; where a strategy needs a node's
identity the error names the missing metadata. Flower's ``InconsistentMessageReplies`` (a whole round
refused for one inconsistent reply) is a deliberate difference: fedlmc excludes that reply and says so."""

from __future__ import annotations

from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, Krum

from fedlmc.baselines import KrumFedAvg
from fedlmc.options import Refinement, Robust
from fedlmc.strategies import AlignedFedAvg, AverageFedAvg, HeteroWidthFedAvg, RefinedFedAvg


def mock_reply(arrays: ArrayRecord, num_examples: float) -> Message:
    """A reply as Flower's strategy tests make it: content and the two predicates, nothing else."""
    message = Mock(spec=Message)
    message.content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": num_examples})})
    message.has_error.side_effect = lambda: False
    message.has_content.side_effect = lambda: True
    return message


def _replies(weights=(5, 2, 9)):
    rows = ([1.0, 0.2, 0.5, 1.0], [0.2, 0.5, 1.0, 0.2], [0.5, 1.0, 0.2, 0.5])
    return [mock_reply(ArrayRecord([np.array(r)]), w) for r, w in zip(rows, weights)]


FEDAVG_LIKE = {
    "AverageFedAvg()": lambda: AverageFedAvg(),
    "AlignedFedAvg(fallback='average')": lambda: AlignedFedAvg(fallback="average"),
    "RefinedFedAvg(fallback='average')": lambda: RefinedFedAvg(fallback="average", refine=Refinement(data=[0])),
    "HeteroWidthFedAvg(fallback='average')": lambda: HeteroWidthFedAvg(fallback="average"),
}


@pytest.mark.parametrize("make", FEDAVG_LIKE.values(), ids=FEDAVG_LIKE.keys())
def test_mock_replies_are_averaged_as_flowers_fedavg_averages_them(make):
    want, want_metrics = FedAvg().aggregate_train(1, _replies())
    got, got_metrics = make().aggregate_train(1, _replies())
    np.testing.assert_allclose(got.to_numpy_ndarrays()[0], want.to_numpy_ndarrays()[0], rtol=1e-12)
    assert dict(got_metrics) == dict(want_metrics)


@pytest.mark.parametrize(
    "oracle,ours",
    [
        (FedMedian(), AverageFedAvg(robust=Robust(reduce="median"))),
        (FedTrimmedAvg(beta=0.2), AverageFedAvg(robust=Robust(reduce="trimmed", trim=0.2))),
        (Krum(num_malicious_nodes=0), KrumFedAvg(num_malicious_nodes=0, num_nodes_to_select=1)),
    ],
    ids=["FedMedian", "FedTrimmedAvg", "Krum"],
)
def test_mock_replies_reduced_as_flowers_robust_strategies_reduce_them(oracle, ours):
    want, _ = oracle.aggregate_train(1, _replies())
    got, _ = ours.aggregate_train(1, _replies())
    np.testing.assert_allclose(got.to_numpy_ndarrays()[0], want.to_numpy_ndarrays()[0], rtol=1e-12)


def test_an_inconsistent_reply_is_excluded_where_flower_refuses_the_round():
    """Flower's FedAvg raises ``InconsistentMessageReplies`` on a reply whose arrays differ in keys; fedlmc
    leaves that reply out, with the reason in the round's record, and averages the others."""
    replies = _replies()
    odd = mock_reply(ArrayRecord([np.array([1.0, 2.0]), np.array([3.0])]), 4)
    with pytest.raises(InconsistentMessageReplies):
        FedAvg().aggregate_train(1, [*replies, odd])
    strategy = AverageFedAvg()
    got, _ = strategy.aggregate_train(1, [*_replies(), odd])
    want, _ = FedAvg().aggregate_train(1, _replies())
    np.testing.assert_allclose(got.to_numpy_ndarrays()[0], want.to_numpy_ndarrays()[0], rtol=1e-12)
    assert len(strategy.history[-1]["excluded"]) == 1 and strategy.history[-1]["excluded"][0]["node"] is None


def test_a_strategy_that_needs_the_nodes_names_the_missing_metadata():
    """Sending each node its own width needs to know who sent what: mock replies are refused, saying so."""
    from test_failed_rounds import _strategy

    strategy, initial = _strategy("hetero")
    strategy.check_architecture(initial)
    strategy._previous = initial
    replies = [mock_reply(initial, 10) for _ in range(2)]
    with pytest.raises(ValueError, match="without metadata.*src_node_id.*its own width"):
        strategy.aggregate_train(1, replies)
