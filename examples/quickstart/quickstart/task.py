"""The model, the data and local training: a small ViT on scikit-learn's digits (they ship with it)."""

from __future__ import annotations

import torch

from fedlmc.data import load, partition
from fedlmc.models import from_preset
from fedlmc.train import TrainConfig, evaluate, train


def Net() -> torch.nn.Module:
    torch.manual_seed(0)
    return from_preset("vit-digits")


def load_data(partition_id: int, num_partitions: int):
    """This client's share of the digits (IID)."""
    return partition(load("digits").train, num_partitions, "iid", seed=0)[partition_id]


def fit(model: torch.nn.Module, data, steps: int, seed: int) -> float:
    history = train(model, data, TrainConfig(steps=steps, lr=3e-3, batch_size=32, seed=seed), progress=False)
    return history["train_loss"][-1][1]


def test(model: torch.nn.Module) -> dict[str, float]:
    return evaluate(model, load("digits").test)
