"""FedProx (Li et al., MLSys 2020) as Flower has it: FedAvg's aggregation, the clients' proximal term."""

from __future__ import annotations

from typing import Any

from flwr.app import ConfigRecord

from fedlmc.strategies.fedavg import AverageFedAvg
from fedlmc.strategies.knobs import ClientKnob, ConfirmedKnobs
from fedlmc.strategies.registry import Build, register

PROXIMAL = ClientKnob(
    "proximal-mu",
    "fedlmc's ClientApp (clients/app.py) adds mu / 2 · ‖w − w_global‖² to its local loss "
    "(fedlmc.train.TrainConfig(proximal_mu=...)) and confirms it with "
    "fedlmc.strategies.knobs.confirm(metrics, config, 'proximal-mu'); a ClientApp of your own must do both.",
)


class FedProxFedAvg(ConfirmedKnobs, AverageFedAvg):
    """FedProx (Li et al., 2020) as Flower has it: FedAvg's aggregation, and every train message tells the
    clients the proximal term's weight (config ``proximal-mu``), which fedlmc's ClientApp adds to its
    local loss as ``mu / 2 · ‖w − w_global‖²`` (``TrainConfig.proximal_mu``).

    Parameters
    ----------
    proximal_mu : float, default 0.0
        The proximal term's weight (0: FedAvg, bit for bit).
    unconfirmed : {"warn", "error"}, default "warn"
        A round whose replies do not confirm the proximal term (``applied-proximal-mu``, a ClientApp that
        does not run FedProx) is warned about, or refused (``fedlmc.strategies.knobs.ConfirmedKnobs``).
    **kwargs
        ``AverageFedAvg``'s parameters.
    """

    def __init__(self, *, proximal_mu: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if proximal_mu < 0:
            raise ValueError(f"proximal_mu must be non-negative, got {proximal_mu}")
        self.proximal_mu = proximal_mu

    def client_knobs(self) -> list[ClientKnob]:
        return [PROXIMAL] if self.proximal_mu > 0 else []

    def configure_train(self, server_round: int, arrays, config: ConfigRecord, grid):
        config["proximal-mu"] = self.proximal_mu
        return super().configure_train(server_round, arrays, config, grid)


@register(
    "fedprox",
    summary="FedProx, FedAvg with the clients' proximal term (`proximal-mu`)",
    example="FedProxFedAvg(proximal_mu=0.1)",
    client="adds μ/2·‖w − w_global‖² to its loss and confirms it with `fedlmc.strategies.knobs.confirm` "
    "(fedlmc's ClientApp does)",
)
def _fedprox(b: Build):
    return FedProxFedAvg(**b.common(), proximal_mu=b.settings.proximal_mu)
