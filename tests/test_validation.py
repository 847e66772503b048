"""Every kind of bad reply is excluded with one clear log line; too few good ones keep the previous model."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from test_strategies import _reply

from fedlmc.models import from_preset
from fedlmc.options import Checks, Universe
from fedlmc.strategies import AlignedFedAvg, AverageFedAvg, HeteroWidthFedAvg
from fedlmc.strategies.records import config_record


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return from_preset("vit-digits", **kw).eval()


def _bad(kind: str):
    m = _model(5)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    rec = config_record(m)
    metrics = MetricRecord({"num-examples": 10})
    if kind == "nan":
        sd["head.weight"][0, 0] = float("nan")
    elif kind == "inf":
        sd["blocks.0.mlp.fc1.bias"][3] = float("inf")
    elif kind == "missing key":
        sd.pop("blocks.1.attn.q.weight")
    elif kind == "extra key":
        sd["backdoor.weight"] = torch.zeros(3)
    elif kind == "wrong shape":
        sd["blocks.0.mlp.fc1.weight"] = torch.zeros(5, 32)
    elif kind == "width mismatch":
        small = _model(6, d_model=16, d_head=8)  # arrays of width 16 ...
        sd = dict(small.state_dict())  # ... while the record declares width 32
    elif kind == "declared other width":
        small = _model(6, d_model=16, d_head=8)
        sd, rec = dict(small.state_dict()), config_record(small)
    elif kind == "absurd norm":
        sd = {k: v * 1e4 for k, v in sd.items()}
    elif kind == "no num-examples":
        metrics = MetricRecord({"loss": 1.0})
    elif kind == "bad config":
        rec = ConfigRecord({"config": json.dumps({"arch": "nope"})})
    content = RecordDict({"arrays": ArrayRecord(torch_state_dict=sd), "metrics": metrics, "model": rec})
    msg = _reply(m, 10, node=99)
    msg.content = content
    return msg


KINDS = [
    "nan",
    "inf",
    "missing key",
    "extra key",
    "wrong shape",
    "width mismatch",
    "declared other width",
    "absurd norm",
    "no num-examples",
    "bad config",
]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_reply_is_excluded_and_named(kind, caplog):
    good = [_model(1), _model(2)]
    strategy = AlignedFedAvg(model=good[0].config.to_dict(), universe=Universe(iterations=1))
    strategy._previous = ArrayRecord(torch_state_dict=good[0].state_dict())
    replies = [_reply(g, 10, node=i + 1) for i, g in enumerate(good)] + [_bad(kind)]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None  # the two good replies were aggregated
    rec = strategy.history[-1]
    assert [e["node"] for e in rec["excluded"]] == [99]
    lines = [r.getMessage() for r in caplog.records if "excluded the reply of node 99" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    print(kind, "→", lines[0])


def test_too_few_valid_replies_keep_the_previous_model(caplog):
    good = _model(1)
    strategy = AlignedFedAvg(model=good.config.to_dict(), checks=Checks(min_replies=2))
    strategy._previous = ArrayRecord(torch_state_dict=good.state_dict())
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, metrics = strategy.aggregate_train(3, [_reply(good, 10, node=1), _bad("nan")])
    assert arrays is None and metrics is None  # Strategy.start then keeps the previous global arrays
    assert strategy.history[-1]["kept"] == "previous"
    assert any("keeping the previous global model" in r.getMessage() for r in caplog.records)


def test_hetero_accepts_declared_narrower_widths_but_not_lies():
    wide = _model(1)
    strategy = HeteroWidthFedAvg(model=wide.config.to_dict(), universe=Universe(iterations=1))
    strategy._previous = ArrayRecord(torch_state_dict=wide.state_dict())
    arrays, _ = strategy.aggregate_train(
        1, [_reply(wide, 10, node=1), _bad("declared other width"), _bad("width mismatch")]
    )
    assert arrays is not None
    assert [e["node"] for e in strategy.history[-1]["excluded"]] == [99]  # only the one whose arrays lie
    assert sorted(strategy.history[-1]["widths"]) == [16, 32]


def test_the_fedavg_baseline_validates_replies_too():
    """The baseline aggregates exactly what Flower's FedAvg would of the valid replies; a NaN reply is
    excluded and named instead of poisoning the average."""
    from flwr.serverapp.strategy import FedAvg

    good = [_model(1), _model(2)]
    replies = [_reply(g, 10, node=i + 1) for i, g in enumerate(good)]
    strategy = AverageFedAvg(model=good[0].config.to_dict())
    arrays, _ = strategy.aggregate_train(1, replies + [_bad("nan")])
    assert [e["node"] for e in strategy.history[-1]["excluded"]] == [99]
    out, ref = arrays.to_torch_state_dict(), FedAvg().aggregate_train(1, replies)[0].to_torch_state_dict()
    assert all(torch.isfinite(v).all() for v in out.values())
    assert max(float((out[k] - ref[k]).abs().max()) for k in ref) == 0.0
