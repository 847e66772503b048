"""The multi-round peers as registered strategies, with Flower's own strategies as the oracle: FedProx
(FedAvg, and the proximal term in the clients' training), and the server optimisers FedAvgM, FedAdam,
FedYogi."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedProx, FedYogi
from test_flower_contract import Grid, _copies, _replies, _same, task_identity  # noqa: F401  (the fixture)

from fedlmc.baselines import FedProxFedAvg, ServerOptFedAvg
from fedlmc.data import ArrayData
from fedlmc.federated import Settings
from fedlmc.models import from_preset
from fedlmc.strategies.registry import build
from fedlmc.train import TrainConfig, train

KW = dict(n_layer=1, d_model=16, n_head=2, d_ff=32, image_size=8, patch_size=4)


def _trained(mu: float) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = from_preset("vit-tiny", **KW)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    data = ArrayData(torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g))
    train(model, data, TrainConfig(steps=20, lr=1e-2, batch_size=16, proximal_mu=mu), progress=False)
    return start, model.state_dict()


def test_the_proximal_term_is_nothing_at_zero_and_holds_the_model_near_its_start():
    start, plain = _trained(0.0)
    torch.manual_seed(0)
    model = from_preset("vit-tiny", **KW)
    g = torch.Generator().manual_seed(1)
    data = ArrayData(torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g))
    train(model, data, TrainConfig(steps=20, lr=1e-2, batch_size=16), progress=False)  # no proximal_mu at all
    assert all(torch.equal(model.state_dict()[k], v) for k, v in plain.items())  # mu = 0 is FedAvg's client

    def moved(sd):
        return sum(float((sd[k] - start[k]).pow(2).sum()) for k in start) ** 0.5

    distances = [moved(_trained(mu)[1]) for mu in (0.0, 1.0, 100.0)]
    assert distances[0] > distances[1] > distances[2], distances


def test_fedprox_sends_flowers_config_and_aggregates_as_fedavg():
    arrays = ArrayRecord([np.zeros((2, 3), np.float32), np.zeros(4, np.float32)])
    grid = Grid(nodes=3)
    ours = list(FedProxFedAvg(proximal_mu=0.3).configure_train(1, arrays, ConfigRecord({}), grid))
    flower = list(FedProx(proximal_mu=0.3).configure_train(1, arrays, ConfigRecord({}), grid))
    assert {m.content["config"]["proximal-mu"] for m in ours} == {0.3}
    assert set(ours[0].content["config"]) == set(flower[0].content["config"])
    replies = _replies(3, seed=5)
    got, _ = FedProxFedAvg(proximal_mu=0.3).aggregate_train(1, _copies(replies))
    want, _ = FedAvg().aggregate_train(1, _copies(replies))
    _same(got, want)


def test_fedavgm_at_server_learning_rate_one_and_no_momentum_is_fedavg():
    arrays = ArrayRecord([np.zeros((2, 3), np.float32), np.zeros(4, np.float32)])
    strategy = ServerOptFedAvg(optimizer=FedAvgM(server_learning_rate=1.0))
    list(strategy.configure_train(1, arrays, ConfigRecord({}), Grid(3)))
    replies = _replies(3, seed=6)
    got, _ = strategy.aggregate_train(1, _copies(replies))
    _same(got, FedAvg().aggregate_train(1, _copies(replies))[0])


@pytest.mark.parametrize("optimiser", [FedAdam, FedYogi, lambda: FedAvgM(server_momentum=0.9)])
def test_server_optimisers_are_flowers_over_rounds(optimiser):
    """Two rounds of the same replies: ours (validation, history) and Flower's own strategy agree, the
    optimiser's state (momentum, moments) carried across rounds."""
    arrays = ArrayRecord([np.ones((2, 3), np.float32), np.ones(4, np.float32)])
    ours, flower = ServerOptFedAvg(optimizer=optimiser()), optimiser()
    for rnd in (1, 2):
        replies = _replies(3, seed=10 + rnd)
        list(ours.configure_train(rnd, arrays, ConfigRecord({}), Grid(3)))
        list(flower.configure_train(rnd, arrays, ConfigRecord({}), Grid(3)))
        got, _ = ours.aggregate_train(rnd, _copies(replies))
        want, _ = flower.aggregate_train(rnd, _copies(replies))
        _same(got, want)
        arrays = want
    assert [r["kept"] for r in ours.history] == [type(flower).__name__.lower()] * 2


def test_the_peers_are_registered_strategies():
    s = Settings.from_run_config({"strategy": "fedprox", "proximal-mu": 0.1, "preset": "vit-digits"})
    assert s.train_config(0).proximal_mu == 0.1
    model = from_preset("vit-digits")
    got = build(s, model.config.to_dict(), None)
    assert isinstance(got, FedProxFedAvg) and got.proximal_mu == 0.1
    for name, cls in (("fedavgm", FedAvgM), ("fedadam", FedAdam), ("fedyogi", FedYogi)):
        got = build(Settings.from_run_config({"strategy": name}), model.config.to_dict(), None)
        assert isinstance(got, ServerOptFedAvg) and type(got.optimizer) is cls


class _Recording(Grid):
    """The scripted grid, keeping the config of every train message it is sent."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.configs: list[dict] = []

    def push_messages(self, messages):
        messages = list(messages)
        self.configs += [dict(m.content["config"]) for m in messages if m.metadata.message_type == "train"]
        return super().push_messages(messages)


def test_any_strategys_clients_get_the_proximal_term_from_the_run_config(tmp_path):
    """``proximal-mu`` travels in the server app's train config to every strategy's clients (FedProx
    clients under aligned aggregation), and not at all when it is 0."""
    from server.app import run_federation

    run = {"preset": "vit-digits", "num-server-rounds": 1, "eval-batches": 2, "independent-start": False}
    for strategy, mu in (("aligned", 0.05), ("average", 0.0)):
        grid = _Recording(nodes=2, step=0.01)
        s = Settings.from_run_config(
            {**run, "strategy": strategy, "proximal-mu": mu, "out-dir": str(tmp_path / strategy)}
        )
        run_federation(grid, s)
        assert grid.configs and all(("proximal-mu" in c) == (mu > 0) for c in grid.configs)
        assert all(c.get("proximal-mu", 0.0) == mu for c in grid.configs)


def test_the_server_optimisers_take_their_knobs_from_the_run_config():
    model = from_preset("vit-digits")
    got = build(Settings.from_run_config({"strategy": "fedadam", "server-lr": 0.003}), model.config.to_dict(), None)
    assert got.optimizer.eta == 0.003
    got = build(Settings.from_run_config({"strategy": "fedavgm", "server-momentum": 0.9}), model.config.to_dict(), None)
    assert got.optimizer.server_momentum == 0.9 and got.optimizer.server_learning_rate == 1.0
    with pytest.raises(ValueError, match="server-momentum"):
        Settings.from_run_config({"strategy": "fedavgm", "server-momentum": 1.0})
