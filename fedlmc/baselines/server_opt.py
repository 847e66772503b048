"""Flower's server optimisers (FedAvgM, FedAdam, FedYogi, FedAdagrad: Reddi et al., ICLR 2021) with
fedlmc's validation and history."""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvgM
from flwr.serverapp.strategy.fedopt import FedOpt

from fedlmc.strategies.fedavg import AverageBase
from fedlmc.strategies.keys import Key, non_negative
from fedlmc.strategies.registry import Build, register


class ServerOptFedAvg(AverageBase):
    """A server optimiser of Flower's (``FedAvgM``, ``FedAdam``, ``FedYogi``, ``FedAdagrad``: Reddi et al.,
    2021) with fedlmc's validation and history: the valid replies go to the Flower strategy, whose own
    ``aggregate_train`` takes FedAvg's mean and steps from the previous global model with its state
    (momentum, moments) kept across rounds.

    Parameters
    ----------
    optimizer : flwr.serverapp.strategy.FedAvgM or FedOpt (FedAdam, FedYogi, FedAdagrad)
        The Flower strategy whose aggregation is used, with its hyper-parameters (``FedAdam(eta=0.01)``).
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    def __init__(self, *, optimizer: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(optimizer, (FedAvgM, FedOpt)):
            raise ValueError(f"optimizer must be Flower's FedAvgM, FedAdam, FedYogi or FedAdagrad, got {optimizer!r}")
        self.optimizer = optimizer

    def _step(self, server_round: int, replies: list) -> ArrayRecord:
        """The optimiser's aggregate of ``replies``, stepping from the global model sent this round."""
        if self._previous is None:
            raise RuntimeError(f"{type(self).__name__} steps from the global model: configure_train first")
        opt = self.optimizer
        if isinstance(opt, FedOpt):
            opt.current_arrays = {k: a.numpy() for k, a in self._previous.items()}
        else:
            opt.current_arrays = self._previous
        arrays, _ = opt.aggregate_train(server_round, replies)
        return arrays

    def combine(self, server_round, replies, models, weights):
        name = type(self.optimizer).__name__.lower()
        return self.model_of(self._step(server_round, replies)), {"kept": name}, None

    def combine_arrays(self, server_round, replies, weights):
        return self._step(server_round, replies), {"kept": type(self.optimizer).__name__.lower()}


SERVER_LR = Key(
    "server-lr",
    0.0,
    "the server optimiser's learning rate (0: Flower's default, 1.0 for FedAvgM, 0.1 for FedAdam / FedYogi)",
    check=non_negative,
)
SERVER_MOMENTUM = Key(
    "server-momentum",
    0.0,
    "FedAvgM's server momentum (Flower's default 0 is FedAvg)",
    check=lambda v: "" if 0 <= v < 1 else "must be in [0, 1)",
)


def _server_opt(name: str, summary: str) -> None:
    """Register Flower's server optimiser ``name`` (with Flower's default hyper-parameters)."""
    import flwr.serverapp.strategy as flower

    keys = (SERVER_LR, SERVER_MOMENTUM) if name == "FedAvgM" else (SERVER_LR,)

    @register(name.lower(), summary=summary, example=f"ServerOptFedAvg(optimizer={name}())", keys=keys)
    def _build(b: Build):
        server_lr = b.key("server-lr")
        lr = {"server_learning_rate" if name == "FedAvgM" else "eta": server_lr} if server_lr > 0 else {}
        momentum = {"server_momentum": b.key("server-momentum")} if name == "FedAvgM" else {}
        return ServerOptFedAvg(**b.common(), optimizer=getattr(flower, name)(**lr, **momentum))


_server_opt("FedAvgM", "FedAvg with server momentum (Flower's; `server-momentum`)")
_server_opt("FedAdam", "the Adam server optimiser (Flower's; `server-lr`)")
_server_opt("FedYogi", "the Yogi server optimiser (Flower's; `server-lr`)")
