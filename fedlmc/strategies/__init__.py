"""Flower strategies (Message API) that aggregate client Transformers modulo their symmetries.

All are subclasses of ``flwr.serverapp.strategy.FedAvg`` and drop in where FedAvg is used. The ones a
``run_config`` can name are registered in ``registry`` (``register`` adds one).
"""

from .aligned import AlignedFedAvg, RefinedFedAvg
from .base import FedlmcStrategy
from .distilled import DistilledFedAvg
from .fedavg import FedProxFedAvg, KrumFedAvg, ReportingFedAvg, ScaffoldFedAvg, ServerOptFedAvg, TaskVectorFedAvg
from .fusion import OTFusionFedAvg
from .hetero import HeteroWidthFedAvg, SlicingFedAvg
from .lora import LoraFedAvg
from .registry import register

__all__ = [
    "AlignedFedAvg",
    "RefinedFedAvg",
    "DistilledFedAvg",
    "OTFusionFedAvg",
    "HeteroWidthFedAvg",
    "SlicingFedAvg",
    "ReportingFedAvg",
    "KrumFedAvg",
    "FedProxFedAvg",
    "ServerOptFedAvg",
    "ScaffoldFedAvg",
    "TaskVectorFedAvg",
    "FedlmcStrategy",
    "LoraFedAvg",
    "register",
]
