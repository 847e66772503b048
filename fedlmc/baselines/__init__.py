"""The field's methods fedlmc is compared with, apart from fedlmc's own (``fedlmc.strategies``). Each module
holds a peer's Flower strategy, its options, its registration and the run_config keys it owns, written
from its paper and tested against a planted or analytic answer:

* ``fedprox``: FedProx's proximal term (``FedProxFedAvg``, ``fedprox``).
* ``scaffold``: SCAFFOLD's control variates, server and client side (``ScaffoldFedAvg``, ``scaffold``).
* ``server_opt``: Flower's server optimisers (``ServerOptFedAvg``: ``fedavgm``, ``fedadam``, ``fedyogi``).
* ``krum``: Krum and Multi-Krum on raw replies (``KrumFedAvg``: ``krum``, ``multikrum``).
* ``ot_fusion``: optimal-transport fusion (``OTFusion``, ``OTFusionFedAvg``: ``ot-fusion``).
* ``feddf``: FedDF, ensemble distillation from FedAvg's mean (``feddf``).
* ``task_vectors``: Task Arithmetic, TIES, DARE, Model Stock (``TaskMerge``, ``TaskVectorFedAvg``).
* ``slicing``: HeteroFL's width slicing, a depth's first blocks (``SlicingFedAvg``: ``slicing``), and identity
  padding averaged as zeros (``ZeroPaddedDepthFedAvg``: ``hetero-zeros``).
* ``local``: no federation, each client trains alone (``LocalFedAvg``: ``local``).
* ``lora``: the published LoRA aggregators (FedIT, FFA-LoRA, FedSA-LoRA, FLoRA, FlexLoRA, FedEx-LoRA,
  FedRot-LoRA), for ``simulations/lora_aggregators.py``.
"""

from __future__ import annotations

from fedlmc.baselines.feddf import DISTILL_KEYS as _DISTILL_KEYS  # noqa: F401 -- registers feddf
from fedlmc.baselines.fedprox import FedProxFedAvg
from fedlmc.baselines.krum import KrumFedAvg
from fedlmc.baselines.local import LocalFedAvg
from fedlmc.baselines.ot_fusion import OTFusion, OTFusionFedAvg
from fedlmc.baselines.scaffold import ScaffoldFedAvg
from fedlmc.baselines.server_opt import ServerOptFedAvg
from fedlmc.baselines.slicing import SlicingFedAvg, ZeroPaddedDepthFedAvg
from fedlmc.baselines.task_vectors import TaskMerge, TaskVectorFedAvg

__all__ = [
    "FedProxFedAvg",
    "ScaffoldFedAvg",
    "ServerOptFedAvg",
    "KrumFedAvg",
    "OTFusion",
    "OTFusionFedAvg",
    "TaskMerge",
    "TaskVectorFedAvg",
    "SlicingFedAvg",
    "ZeroPaddedDepthFedAvg",
    "LocalFedAvg",
]
