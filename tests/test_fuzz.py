"""Property-based fuzzing of every fedlmc strategy's ``aggregate_train`` (hypothesis): rounds of replies
mixing valid ones with every kind of broken one nobody listed by hand. Properties: the strategy never
raises; exactly the broken replies are excluded (failed messages recorded as failures), each with one
log line naming its node; the global model is finite and loads with ``strict=True``; with too few
valid replies the previous model is kept. Bounded (examples × replies ≥ 1,000 per strategy)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import metadata
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlmc.baselines import SlicingFedAvg
from fedlmc.data import load  # noqa: E402
from fedlmc.models import from_config, from_preset  # noqa: E402
from fedlmc.options import (
    Checks,
    Refinement,  # noqa: E402
    Universe,
)
from fedlmc.strategies import AlignedFedAvg, AverageFedAvg, HeteroWidthFedAvg, RefinedFedAvg
from fedlmc.strategies.records import config_record  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = 50  # × 8–14 replies each: over 500 replies per strategy
BROKEN = [
    "drop key",
    "rename key",
    "int dtype",
    "nan",
    "inf",
    "shape off by one",
    "huge",
    "config not json",
    "other arch",
    "no num-examples",
    "negative num-examples",
    "fractional num-examples",
    "empty arrays",
    "error reply",
    "no arrays",
]
FINE = ["valid", "valid denormal", "valid float16"]  # odd but harmless: must be aggregated


def _models():
    out = []
    for s in range(3):
        torch.manual_seed(s)
        out.append(from_preset("vit-digits").eval())
    return out


POOL = _models()
CONFIG = POOL[0].config.to_dict()
DIGITS = load("digits")


def _message(content=None, node: int = 1, error: bool = False) -> Message:
    md = metadata(node)
    if error:
        return Message(error=Error(code=5, reason="Node Unavailable"), metadata=md)
    return Message(content=content, metadata=md)


def make_reply(kind: str, node: int, pick: int, where: float) -> Message:
    """One reply of ``kind``; ``pick`` and ``where`` place the damage (which tensor, which entry)."""
    model = POOL[pick % len(POOL)]
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    keys = sorted(sd)
    key = keys[pick % len(keys)]
    idx = min(int(where * sd[key].numel()), sd[key].numel() - 1)
    metrics, rec = MetricRecord({"num-examples": 10 + pick}), config_record(model)
    if kind == "error reply":
        return _message(node=node, error=True)
    if kind == "drop key":
        sd.pop(key)
    elif kind == "rename key":
        sd[key + "_renamed"] = sd.pop(key)
    elif kind == "int dtype":
        sd[key] = sd[key].round().to(torch.int32)
    elif kind in ("nan", "inf", "huge"):
        sd[key].view(-1)[idx] = {"nan": float("nan"), "inf": -float("inf"), "huge": 1e30}[kind]
    elif kind == "shape off by one":
        t = sd[key]
        sd[key] = torch.zeros(*(t.shape[:-1] + (t.shape[-1] + 1,))) if t.dim() else torch.zeros(2)
    elif kind == "valid denormal":
        sd[key].view(-1)[idx] = 1e-40
    elif kind == "valid float16":
        sd[key] = sd[key].half()
    elif kind == "config not json":
        rec = ConfigRecord({"config": "{not json"})
    elif kind == "other arch":
        rec = ConfigRecord({"config": json.dumps({**CONFIG, "arch": "gpt2"})})
    elif kind in ("no num-examples", "negative num-examples", "fractional num-examples"):
        value = {"negative num-examples": -3, "fractional num-examples": 2.5}.get(kind)
        metrics = MetricRecord({"loss": 1.0} if value is None else {"num-examples": value})
    content = RecordDict({"metrics": metrics, "model": rec})
    if kind == "empty arrays":
        content["arrays"] = ArrayRecord()
    elif kind != "no arrays":
        content["arrays"] = ArrayRecord(torch_state_dict=sd)
    return _message(content, node)


STRATEGIES = {
    "average": lambda: AverageFedAvg(model=CONFIG),
    "aligned": lambda: AlignedFedAvg(model=CONFIG, universe=Universe(iterations=1)),
    "refined": lambda: RefinedFedAvg(
        model=CONFIG, refine=Refinement(data=DIGITS.val, steps=1), universe=Universe(iterations=1)
    ),
    "hetero": lambda: HeteroWidthFedAvg(model=CONFIG, universe=Universe(iterations=1)),
    "slicing": lambda: SlicingFedAvg(model=CONFIG),
}

replies_st = st.lists(
    st.tuples(st.sampled_from(BROKEN + FINE), st.integers(0, 10_000), st.floats(0, 1)), min_size=8, max_size=14
)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_aggregate_train_survives_anything(name, caplog):
    counted = {"replies": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    )
    @given(replies_st, st.integers(1, 3))
    def run(spec, min_replies):
        strategy = STRATEGIES[name]()
        strategy.checks = Checks(min_replies=min_replies)
        previous = ArrayRecord(torch_state_dict=POOL[0].state_dict())
        strategy._previous = previous
        msgs = [make_reply(kind, node + 1, pick, where) for node, (kind, pick, where) in enumerate(spec)]
        counted["replies"] += len(msgs)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            arrays, _ = strategy.aggregate_train(1, msgs)  # property 1: never raises
        rec = strategy.history[-1]
        broken = {node + 1 for node, (kind, _, _) in enumerate(spec) if kind in BROKEN and kind != "error reply"}
        failed = {node + 1 for node, (kind, _, _) in enumerate(spec) if kind == "error reply"}
        assert {e["node"] for e in rec["excluded"]} == broken
        assert {f["node"] for f in rec["failures"]} == failed
        for node in broken:  # one log line per excluded reply, naming its node and the reason
            lines = [r.getMessage() for r in caplog.records if f"excluded the reply of node {node}:" in r.getMessage()]
            assert len(lines) == 1 and len(lines[0].split(":", 1)[1].strip()) > 0
        valid = len(spec) - len(broken) - len(failed)
        if valid < min_replies:
            assert arrays is None and rec["kept"] == "previous"
            return
        sd = arrays.to_torch_state_dict()
        assert all(torch.isfinite(v).all() for v in sd.values())
        cfg = dict(strategy.global_config)
        from_config(cfg).load_state_dict(sd, strict=True)

    run()
    assert counted["replies"] >= 8 * EXAMPLES
