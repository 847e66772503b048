"""Every option honoured or refused: a strategy that cannot apply a robust reduction does not accept one,
and a strategy whose method runs partly in the ClientApp (FedProx, SCAFFOLD) is told by the replies
whether the clients applied it; a plain Flower ClientApp under it is warned about (or refused), never
FedAvg under another name in silence."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdam
from test_flower_contract import Grid, _mlp_arrays

from fedlmc.baselines import (
    FedProxFedAvg,
    KrumFedAvg,
    OTFusion,
    OTFusionFedAvg,
    ScaffoldFedAvg,
    ServerOptFedAvg,
    TaskMerge,
    TaskVectorFedAvg,
)
from fedlmc.options import Distill, Refinement, Robust
from fedlmc.strategies import AlignedFedAvg, AverageFedAvg, DistilledFedAvg, RefinedFedAvg
from fedlmc.strategies.knobs import applied_metric, confirm


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)


NO_ROBUST = {
    "KrumFedAvg": lambda **kw: KrumFedAvg(**kw),
    "ServerOptFedAvg": lambda **kw: ServerOptFedAvg(optimizer=FedAdam(), **kw),
    "TaskVectorFedAvg": lambda **kw: TaskVectorFedAvg(merge=TaskMerge(), **kw),
    "ScaffoldFedAvg": lambda **kw: ScaffoldFedAvg(**kw),
    "OTFusionFedAvg": lambda **kw: OTFusionFedAvg(fusion=OTFusion(), **kw),
    "RefinedFedAvg": lambda **kw: RefinedFedAvg(refine=Refinement(data=[0]), **kw),
}


@pytest.mark.parametrize("make", NO_ROBUST.values(), ids=NO_ROBUST.keys())
@pytest.mark.parametrize("robust", [Robust(reduce="median"), Robust(reduce="average", trim=0.3)])
def test_a_strategy_that_cannot_reduce_robustly_refuses_robust(make, robust):
    make()  # builds without it
    with pytest.raises(TypeError, match="robust"):
        make(robust=robust)


def test_the_strategies_that_take_robust_apply_it():
    rng = np.random.default_rng(0)
    replies = Grid(nodes=5, step=1.0)
    initial = ArrayRecord([rng.normal(size=(3, 2)).astype(np.float32)])
    outs = {}
    for name, strategy in (
        ("average", AverageFedAvg()),
        ("median", AverageFedAvg(robust=Robust(reduce="median"))),
        ("prox-median", FedProxFedAvg(proximal_mu=0.0, robust=Robust(reduce="median"))),
    ):
        outs[name] = strategy.start(grid=replies, initial_arrays=initial, num_rounds=1).arrays.to_numpy_ndarrays()[0]
        replies = Grid(nodes=5, step=1.0)
    assert not np.allclose(outs["average"], outs["median"])
    np.testing.assert_allclose(outs["prox-median"], outs["median"])


# ---- a plain Flower ClientApp (Flower's quickstart's shape): trains, answers arrays and num-examples ----
plain = ClientApp()


@plain.train()
def _plain_train(msg: Message, context: Context) -> Message:
    sd = msg.content["arrays"].to_torch_state_dict()
    g = torch.Generator().manual_seed(int(context.node_id))
    moved = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in sd.items()}
    metrics = MetricRecord({"num-examples": 10 * int(context.node_id), "train-loss": 1.0})
    if context.run_config.get("confirm"):  # a ClientApp that runs the method says so
        confirm(metrics, msg.content["config"], "proximal-mu", "scaffold")
    return Message(RecordDict({"arrays": ArrayRecord(torch_state_dict=moved), "metrics": metrics}), reply_to=msg)


class AppGrid(Grid):
    """Nodes that run ``plain`` (a Flower ClientApp) on every train message (``Grid``'s evaluation)."""

    def __init__(self, confirms: bool, nodes: int = 3) -> None:
        super().__init__(nodes=nodes)
        self.confirms = confirms

    def _answer(self, m: Message, mid: str) -> Message:
        if m.metadata.message_type != "train":
            return super()._answer(m, mid)
        node = int(m.metadata.dst_node_id)
        ctx = Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={"confirm": self.confirms})
        m.metadata.__dict__["_message_id"] = mid  # as a SuperNode receives it: the message has its id
        reply = plain(m, ctx)
        reply.metadata.__dict__["_src_node_id"] = node
        return reply


KNOBBED = {
    "fedprox": lambda **kw: FedProxFedAvg(proximal_mu=0.1, **kw),
    "scaffold": lambda **kw: ScaffoldFedAvg(**kw),
}


@pytest.mark.parametrize("make", KNOBBED.values(), ids=KNOBBED.keys())
def test_a_plain_flower_clientapp_under_a_client_side_method_is_warned_about(make, caplog):
    strategy = make()
    with caplog.at_level(logging.WARNING):
        strategy.start(grid=AppGrid(confirms=False), initial_arrays=_mlp_arrays(), num_rounds=2)
    warnings = [r.getMessage() for r in caplog.records if "do not confirm" in r.getMessage()]
    assert len(warnings) == 1 and "round 1" in warnings[0] and "clients/app.py" in warnings[0]
    assert all(sorted(r["unconfirmed"][next(iter(r["unconfirmed"]))]) == [1, 2, 3] for r in strategy.history)


@pytest.mark.parametrize("make", KNOBBED.values(), ids=KNOBBED.keys())
def test_unconfirmed_error_refuses_the_round(make):
    with pytest.raises(ValueError, match="do not confirm"):
        make(unconfirmed="error").start(grid=AppGrid(confirms=False), initial_arrays=_mlp_arrays(), num_rounds=1)


@pytest.mark.parametrize("make", KNOBBED.values(), ids=KNOBBED.keys())
def test_a_clientapp_that_confirms_is_not_warned_about(make, caplog):
    strategy = make(unconfirmed="error")
    with caplog.at_level(logging.WARNING):
        strategy.start(grid=AppGrid(confirms=True), initial_arrays=_mlp_arrays(), num_rounds=2)
    assert "do not confirm" not in caplog.text and not any("unconfirmed" in r for r in strategy.history)


def test_fedprox_at_mu_zero_is_fedavg_and_asks_for_nothing(caplog):
    with caplog.at_level(logging.WARNING):
        FedProxFedAvg(proximal_mu=0.0).start(grid=AppGrid(confirms=False), initial_arrays=_mlp_arrays(), num_rounds=1)
    assert "do not confirm" not in caplog.text


def test_confirm_marks_only_the_knobs_the_server_sent():
    metrics = confirm(MetricRecord({"num-examples": 1}), {"proximal-mu": 0.1}, "proximal-mu", "scaffold")
    assert metrics[applied_metric("proximal-mu")] == 1.0 and applied_metric("scaffold") not in metrics


def test_a_client_knob_reaches_the_clients_trainer_through_the_train_config():
    """The one path a strategy's client-side knob takes: the strategy puts it in the train config, and the
    client's settings read it from there (``Settings.with_sent``), whatever its own run_config says."""
    from flwr.app import ConfigRecord

    from fedlmc.federated import Settings

    grid = Grid(nodes=2)
    strategy = ScaffoldFedAvg(variate="gradient")
    msgs = list(strategy.configure_train(1, _mlp_arrays(), ConfigRecord({}), grid))
    config = msgs[0].content["config"]
    client = Settings.from_run_config({"scaffold-variate": "trajectory"}, client=True)
    assert client.key("scaffold-variate") == "trajectory"
    sent = client.with_sent(config)
    assert sent.key("scaffold-variate") == "gradient"
    prox = list(FedProxFedAvg(proximal_mu=0.3).configure_train(1, _mlp_arrays(), ConfigRecord({}), grid))
    assert client.with_sent(prox[0].content["config"]).proximal_mu == 0.3
    untouched = client.with_sent({"lr": 0.5, "local-epochs": 9.0, "batch-size": 3})  # not a strategy's knob
    assert (untouched.lr, untouched.local_epochs, untouched.batch_size) == (client.lr, client.local_epochs, 32)
    with pytest.raises(ValueError, match="scaffold-variate"):
        client.with_sent({"scaffold-variate": "momentum"})


# ---- the same app under the strategies that ask the clients (no server data) ----------------------------
@plain.evaluate()
def _plain_evaluate(msg: Message, context: Context) -> Message:
    """Flower's quickstart names its loss ``eval_loss``: not the ``eval-loss`` the guard reads."""
    metrics = MetricRecord({"num-examples": 10, "eval_loss": 1.0, "eval_acc": 0.5})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


class EveryMessageGrid:
    """Nodes running ``plain`` on every message, a ClientApp's exception answered as Flower's SuperNode does
    (an error reply): ``plain`` registers no ``query`` function."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Error

        out = []
        for i, m in enumerate(messages):
            node = int(m.metadata.dst_node_id)
            m.metadata.__dict__["_message_id"] = f"m{i}"
            ctx = Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})
            try:
                reply = plain(m, ctx)
            except ValueError as e:
                reply = Message(Error(code=2, reason=str(e)), reply_to=m)
            reply.metadata.__dict__["_src_node_id"] = node
            out.append(reply)
        return out


def _on_clients_round(make, unconfirmed="warn"):
    from fedlmc.options import OnClients
    from tests.test_on_clients import _tiny_gpt2
    from tests.test_strategies import _reply

    models = [_tiny_gpt2(s, torch.float32) for s in range(2)]
    strategy = make(models[0].config.to_dict(), OnClients(unconfirmed=unconfirmed, timeout=5.0))
    strategy._previous = ArrayRecord(torch_state_dict=dict(models[0].state_dict()))
    strategy.grid = EveryMessageGrid([1, 2])
    strategy.aggregate_train(1, [_reply(models[0], 5, node=1), _reply(models[1], 5, node=2)])
    return strategy


def _refinement():
    return Refinement(steps=2, check_every=1, batch_size=4, check_batches=1, patience=5)


ON_CLIENTS = {
    "aligned-clients": ("guard", lambda cfg, on: AlignedFedAvg(model=cfg, on_clients=on)),
    "refined-clients": ("refine", lambda cfg, on: RefinedFedAvg(model=cfg, refine=_refinement(), on_clients=on)),
    "refined-clients-distilled": (
        "distill",
        lambda cfg, on: DistilledFedAvg(model=cfg, distill=Distill(steps=2, refine=_refinement()), on_clients=on),
    ),
}


@pytest.mark.parametrize("name", ON_CLIENTS)
def test_a_plain_flower_clientapp_under_an_on_clients_strategy_is_warned_about(name, caplog):
    """The clients answer the queries with errors (no query function) and the guard without `eval-loss`:
    the round still aggregates, the warning names the client code the registry says it needs, and the
    round's record lists it; with ``OnClients(unconfirmed="error")`` the round raises instead."""
    from fedlmc.strategies.registry import REGISTRY

    what, make = ON_CLIENTS[name]
    with caplog.at_level(logging.WARNING):
        strategy = _on_clients_round(make)
    said = [r.getMessage() for r in caplog.records if "no client answered with it" in r.getMessage()]
    assert said and all("did not run" in s for s in said)
    assert any(REGISTRY[name].client in s for s in said), (REGISTRY[name].client, said)
    assert REGISTRY[name].client in strategy.history[-1]["unconfirmed"].values()
    assert what in strategy.history[-1]["unconfirmed"]
    with pytest.raises(ValueError, match="no client answered with it"):
        _on_clients_round(make, unconfirmed="error")


def test_on_clients_unconfirmed_takes_warn_or_error():
    from fedlmc.options import OnClients

    with pytest.raises(ValueError, match="unconfirmed"):
        OnClients(unconfirmed="ignore")
