"""A Flower app training a Hugging Face ``ViTForImageClassification`` on MNIST (the bundled digits when MNIST is absent).
Switching the server from FedAvg to aligned aggregation is one line:

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    strategy = AlignedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, model=model)

    python -m examples.hf.vit [fedavg|aligned]      # 2 rounds on 2 SuperNodes (Ray simulation engine)
"""
from __future__ import annotations

import os

import torch
from flwr.serverapp.strategy import FedAvg
from transformers import ViTConfig, ViTForImageClassification

from fedlmc.data import DataNotFound, load
from fedlmc.strategies import AlignedFedAvg

from .common import client_app, server_app, simulate

STRATEGY = os.environ.get("EXAMPLE_STRATEGY", "aligned")


def _dataset() -> str:
    try:
        load("mnist")
        return "mnist"
    except DataNotFound:
        return "digits"


DATASET = _dataset()
SIZE = 28 if DATASET == "mnist" else 8


def make_model() -> ViTForImageClassification:
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=64, image_size=SIZE, patch_size=SIZE // 4,
                                               num_channels=1, num_labels=10))


def make_strategy(model):
    if STRATEGY == "fedavg":
        return FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    return AlignedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, model=model)  # the one changed line


client = client_app(make_model, DATASET)
server = server_app(make_model, make_strategy, DATASET, "hf-vit")

if __name__ == "__main__":
    simulate(server, client)
