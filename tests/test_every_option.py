"""Every option of every registered strategy is honoured or refused. The test walks the registry: for each
strategy's class, every constructor parameter fedlmc adds to Flower's ``FedAvg`` (the class's own and
what it inherits from fedlmc's bases) must have an entry in ``EFFECTS`` saying how a non-default value
shows, and that value must show so on crafted replies: the aggregate changes, the round's record
changes, the messages to the clients change, or the strategy refuses (at construction or in the round,
with a clear error). A new parameter with no entry fails here."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedAvgM
from test_flower_contract import Grid

from fedlmc.baselines import OTFusion, TaskMerge
from fedlmc.federated import Settings, global_model, splits_for
from fedlmc.models import from_preset
from fedlmc.options import (
    Checks,
    Distill,
    Guard,
    Matching,
    OnClients,
    Refinement,
    Report,
    Robust,
    Scale,
    Screen,
    Universe,
)
from fedlmc.strategies.records import config_record, state_arrays
from fedlmc.strategies.registry import REGISTRY


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)


class IndependentGrid(Grid):
    """Three nodes whose replies are models started apart (seed = node), so alignment has work to do."""

    def __init__(self) -> None:
        super().__init__(nodes=3)

    def _answer(self, m: Message, mid: str) -> Message:
        if m.metadata.message_type != "train":
            return super()._answer(m, mid)
        node = int(m.metadata.dst_node_id)
        torch.manual_seed(node)
        model = from_preset("vit-digits")
        content = RecordDict(
            {
                "arrays": state_arrays(model),
                "metrics": MetricRecord({"num-examples": 10 * node}),
                "model": config_record(model),
            }
        )
        from conftest import metadata

        md = metadata(node, message_type="train", message_id=f"r{mid}", reply_to=mid)
        return Message(content=content, metadata=md)


@dataclass
class Ctx:
    model: Any
    data: Any
    initial: ArrayRecord


@pytest.fixture(scope="module")
def ctx() -> Ctx:
    s = Settings.from_run_config({"preset": "vit-digits"})
    model = global_model(s)
    val = splits_for(s).val
    return Ctx(model.config.to_dict(), val.subset(list(range(64))), state_arrays(model))


def _favour_average(arrays) -> float:
    """A guard score that prefers the smaller model: the plain average of models started apart."""
    return float(sum(a.numpy().astype(np.float64).__pow__(2).sum() for a in arrays.values()))


# how a non-default value of each parameter shows: (value, observable)
EFFECTS: dict[str, tuple[Callable[[Ctx], Any], str]] = {
    "model": (lambda c: c.model, "model"),  # without it: refused before round 1, or averaged as arrays
    "report": (lambda c: Report(c.data, batches=1), "record"),
    "checks": (lambda c: Checks(min_replies=10), "aggregate"),
    "fallback": (lambda c: "average", "unreadable"),
    "scale": (lambda c: Scale(spool=True), "spooled"),
    "robust": (lambda c: Robust(reduce="median"), "aggregate"),
    "matching": (lambda c: Matching(residual="permutation"), "aggregate"),
    "universe": (lambda c: Universe(iterations=1, anchor="central"), "aggregate"),
    "guard": (lambda c: Guard(fn=_favour_average), "record"),
    "on_clients": (lambda c: OnClients(timeout=5.0), "record"),
    "screen": (lambda c: Screen(method="distance", threshold=0.5), "record"),
    "refine": (lambda c: Refinement(data=c.data, steps=3, check_every=0), "aggregate"),
    "fusion": (lambda c: OTFusion(reg=0.0), "aggregate"),
    "distill": (lambda c: Distill(data=c.data, student="average", steps=2, check_every=0), "aggregate"),
    "merge": (lambda c: TaskMerge(method="ties"), "aggregate"),
    "proximal_mu": (lambda c: 0.5, "messages"),
    "variate": (lambda c: "gradient", "messages"),
    "unconfirmed": (lambda c: "error", "raises"),
    "num_malicious_nodes": (lambda c: 0, "aggregate"),
    "num_nodes_to_select": (lambda c: 1, "aggregate"),
    "optimizer": (lambda c: FedAvgM(server_momentum=0.9, server_learning_rate=0.5), "aggregate"),
}
VOLATILE = {"seconds", "align_seconds", "threads", "train_metrics", "model_bytes"}


def _own_parameters(cls) -> list[inspect.Parameter]:
    """The keyword parameters fedlmc's classes add on the way from ``cls`` up to Flower's ``FedAvg``."""
    out: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if klass in (FedAvg,) or not klass.__module__.startswith("fedlmc"):
            continue
        if "__init__" in vars(klass):
            for p in inspect.signature(klass.__init__).parameters.values():
                if p.kind is p.KEYWORD_ONLY:
                    out.setdefault(p.name, p)
    return list(out.values())


def _base_kwargs(cls, ctx: Ctx) -> dict:
    """What the class needs to be built at all (its required parameters), besides what is tested."""
    from fedlmc.baselines import FedProxFedAvg, ServerOptFedAvg
    from fedlmc.strategies import DistilledFedAvg, RefinedFedAvg

    kw: dict[str, Any] = {"fraction_evaluate": 0.0}
    if cls is RefinedFedAvg:
        kw["refine"] = Refinement(data=ctx.data, steps=1, check_every=0)
    if cls is DistilledFedAvg:
        kw["distill"] = Distill(data=ctx.data, steps=2, check_every=0)
    if cls is ServerOptFedAvg:
        kw["optimizer"] = FedAvgM()
    if cls is FedProxFedAvg:
        kw["proximal_mu"] = 0.1  # the knob in force, so that it is confirmed
    return kw


def _run(cls, kw: dict, ctx: Ctx, initial=None):
    """One round on ``IndependentGrid``: the aggregate (None: kept), the round's record, the train configs."""
    strategy = cls(**kw)
    grid = IndependentGrid()
    sent: list[dict] = []
    pull = grid.push_messages

    def push(messages):
        messages = list(messages)
        sent.extend(dict(m.content["config"]) for m in messages if m.metadata.message_type == "train")
        return pull(messages)

    grid.push_messages = push
    result = strategy.start(grid=grid, initial_arrays=initial or ctx.initial, num_rounds=1, timeout=10)
    record = {k: v for k, v in (strategy.history[-1] if strategy.history else {}).items() if k not in VOLATILE}
    arrays = None if result.arrays is None else [a.copy() for a in result.arrays.to_numpy_ndarrays()]
    configs = [{k: v for k, v in c.items() if k != "server-round"} for c in sent]
    return arrays, record, configs


def _differs(a, b) -> bool:
    if a is None or b is None or len(a) != len(b):
        return (a is None) != (b is None) or len(a) != len(b)
    return any(x.shape != y.shape or not np.allclose(x, y, atol=1e-7) for x, y in zip(a, b))


def _classes() -> list[type]:
    import fedlmc.baselines as baselines
    import fedlmc.strategies as strategies

    names = {r.example.split("(")[0] for r in REGISTRY.values()}
    scope = {
        **{k: getattr(strategies, k) for k in strategies.__all__},
        **{k: getattr(baselines, k) for k in baselines.__all__},
    }
    return sorted((scope[n] for n in names), key=lambda c: c.__name__)


CASES = [(cls, p.name) for cls in _classes() for p in _own_parameters(cls)]


def test_every_parameter_of_every_registered_strategy_has_a_declared_effect():
    missing = sorted({name for _, name in CASES if name not in EFFECTS})
    assert not missing, f"parameters with no declared effect (EFFECTS): {missing}"


@pytest.mark.parametrize("cls,name", CASES, ids=[f"{c.__name__}-{n}" for c, n in CASES])
def test_a_non_default_value_is_honoured_or_refused(cls, name, ctx, monkeypatch):
    make, observable = EFFECTS[name]
    base = _base_kwargs(cls, ctx)
    if name not in ("model", "fallback"):
        base.setdefault("model", ctx.model)
    value = make(ctx)
    kw = {**base, name: value}
    try:
        cls(**kw)
    except (TypeError, ValueError) as e:  # refused at construction, with the reason
        assert name in str(e) or type(value).__name__ in str(e) or "needs" in str(e), str(e)
        return
    if observable == "raises":
        with pytest.raises(ValueError):
            _run(cls, kw, ctx)
        return
    if observable == "unreadable":  # arrays that are no model of ours: refused by default, averaged with it
        odd = ArrayRecord([np.zeros((3, 2), np.float32)])
        with pytest.raises(ValueError):
            cls(**base).start(grid=Grid(nodes=2), initial_arrays=odd, num_rounds=1)
        result = cls(**kw).start(grid=Grid(nodes=2), initial_arrays=odd, num_rounds=1)
        assert result.arrays is not None
        return
    if observable == "spooled":
        from fedlmc.scale.replies import ReplyStore

        puts = []
        real = ReplyStore.put
        monkeypatch.setattr(ReplyStore, "put", lambda self, *a, **k: puts.append(1) or real(self, *a, **k))
        _run(cls, kw, ctx)
        assert puts, f"{cls.__name__}({name}=...) wrote no reply to disk"
        return
    if observable == "model":  # without the model: refused before round 1, or read as plain arrays
        try:
            default = _run(cls, base, ctx)
        except ValueError as e:
            assert "model" in str(e)
            return
        assert default[1] != _run(cls, kw, ctx)[1], f"{cls.__name__}(model=...) changed nothing"
        return
    default = _run(cls, base, ctx)
    changed = _run(cls, kw, ctx)
    index = {"aggregate": 0, "record": 1, "messages": 2}[observable]
    if observable == "aggregate":
        assert _differs(default[0], changed[0]), f"{cls.__name__}({name}={value!r}) left the aggregate unchanged"
    else:
        assert default[index] != changed[index], f"{cls.__name__}({name}={value!r}) left the {observable} unchanged"
