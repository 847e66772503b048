"""The model, the data and local training: a small Hugging Face ViT on scikit-learn's 8×8 digits
(they ship with scikit-learn: no download)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import ViTConfig, ViTForImageClassification

from fedlmc.data import load, partition


def Net() -> ViTForImageClassification:
    torch.manual_seed(0)
    return ViTForImageClassification(
        ViTConfig(
            image_size=8,
            patch_size=2,
            num_channels=1,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=10,
        )
    )


def load_data(partition_id: int, num_partitions: int):
    """This client's share of the digits (IID)."""
    return partition(load("digits").train, num_partitions, "iid", seed=0)[partition_id]


def loss_of(model: ViTForImageClassification, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(pixel_values=x).logits, y)


def fit(model: ViTForImageClassification, data, steps: int, lr: float, seed: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    gen, done, loss = torch.Generator().manual_seed(seed), 0, torch.tensor(float("nan"))
    while done < steps:
        for x, y in data.batches(32, shuffle=True, generator=gen):
            opt.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return float(loss)


def test(model: ViTForImageClassification) -> float:
    model.eval()
    with torch.no_grad():
        losses = [float(loss_of(model, x, y)) for x, y in load("digits").test.batches(256)]
    return sum(losses) / len(losses)
