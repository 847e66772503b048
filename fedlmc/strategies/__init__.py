"""fedlmc's own Flower strategies (Message API): aggregation of client Transformers modulo their symmetries.

All are subclasses of ``flwr.serverapp.strategy.FedAvg`` and drop in where FedAvg is used. Each module
holds its strategies, their registration and the run_config keys they own (``registry``: ``register``
adds one). The field's methods they are compared with live apart, in ``fedlmc.baselines``.
"""

# isort: off
# the order registers fedlmc's own strategies first (`average` heads them), then the peers
from fedlmc.strategies.fedavg import AverageFedAvg
from fedlmc.strategies.aligned import AlignedFedAvg, RefinedFedAvg
from fedlmc.strategies.distilled import DistilledFedAvg
from fedlmc.strategies.hetero import HeteroWidthFedAvg
from fedlmc.strategies.lora import LoraFedAvg
from fedlmc.strategies.base import FedlmcStrategy
from fedlmc.strategies.registry import register
from fedlmc import baselines as _baselines  # noqa: F401
# isort: on

__all__ = [
    "AverageFedAvg",
    "AlignedFedAvg",
    "RefinedFedAvg",
    "DistilledFedAvg",
    "HeteroWidthFedAvg",
    "FedlmcStrategy",
    "LoraFedAvg",
    "register",
]

# the peers, imported from fedlmc.baselines (a clear error, not an AttributeError, for the old place)
MOVED = {
    name: "fedlmc.baselines"
    for name in (
        "FedProxFedAvg",
        "ScaffoldFedAvg",
        "ServerOptFedAvg",
        "KrumFedAvg",
        "OTFusionFedAvg",
        "TaskVectorFedAvg",
        "SlicingFedAvg",
    )
}


# renamed: one name per meaning (plain averaging is `average` / AverageFedAvg everywhere)
RENAMED = {"ReportingFedAvg": "AverageFedAvg"}


def __getattr__(name: str):
    if name in RENAMED:
        raise ImportError(f"{name} is now {RENAMED[name]}: from fedlmc.strategies import {RENAMED[name]}")
    if name in MOVED:
        raise ImportError(f"{name} is a peer fedlmc compares with: import it from {MOVED[name]}")
    raise AttributeError(f"module 'fedlmc.strategies' has no attribute {name!r}")
