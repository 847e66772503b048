"""A Flower app training a Hugging Face ``GPT2LMHeadModel`` (char-level, tied head) on Tiny Shakespeare.
Switching the server from FedAvg to aligned aggregation is one line:

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    strategy = AlignedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, model=model)

    python -m examples.hf.gpt2 [fedavg|aligned]      # 2 rounds on 2 SuperNodes (Ray simulation engine)
"""
from __future__ import annotations

import os

import torch
from flwr.serverapp.strategy import FedAvg
from transformers import GPT2Config, GPT2LMHeadModel

from fedlmc.strategies import AlignedFedAvg

from .common import client_app, server_app, simulate

STRATEGY = os.environ.get("EXAMPLE_STRATEGY", "aligned")


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=65, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0))


def make_strategy(model):
    if STRATEGY == "fedavg":
        return FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    return AlignedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, model=model)  # the one changed line


client = client_app(make_model, "shakespeare")
server = server_app(make_model, make_strategy, "shakespeare", "hf-gpt2")

if __name__ == "__main__":
    simulate(server, client)
