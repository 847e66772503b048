"""The model, the data and local training: a small Hugging Face GPT-2 (tied head), character-level on
the Tiny Shakespeare text that ships with fedlmc (no tokenizer or download)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from fedlmc.data import load, partition


def Net() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=65, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    )


def load_data(partition_id: int, num_partitions: int):
    """This client's share of the play's speeches (IID), as 64-character windows."""
    return partition(load("shakespeare").train, num_partitions, "iid", seed=0)[partition_id]


def loss_of(model: GPT2LMHeadModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def fit(model: GPT2LMHeadModel, data, steps: int, lr: float, seed: int) -> float:
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


def test(model: GPT2LMHeadModel, batches: int = 4) -> float:
    model.eval()
    with torch.no_grad():
        losses = [
            float(loss_of(model, x, y)) for _, (x, y) in zip(range(batches), load("shakespeare").test.batches(64))
        ]
    return sum(losses) / len(losses)
