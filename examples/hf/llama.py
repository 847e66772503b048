"""A Flower app training a Hugging Face ``LlamaForCausalLM`` (grouped-query attention, RoPE, SwiGLU) on Tiny Shakespeare.
Switching the server from FedAvg to aligned aggregation is one line:

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    strategy = AlignedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, model=model)

    python -m examples.hf.llama [fedavg|aligned]      # 2 rounds on 2 SuperNodes (Ray simulation engine)
"""
from __future__ import annotations

import os

import torch
from flwr.serverapp.strategy import FedAvg
from transformers import LlamaConfig, LlamaForCausalLM

from fedlmc.strategies import AlignedFedAvg

from .common import client_app, server_app, simulate

STRATEGY = os.environ.get("EXAMPLE_STRATEGY", "aligned")


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=65, max_position_embeddings=64, hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, intermediate_size=172))


def make_strategy(model):
    if STRATEGY == "fedavg":
        return FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    return AlignedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, model=model)  # the one changed line


client = client_app(make_model, "shakespeare")
server = server_app(make_model, make_strategy, "shakespeare", "hf-llama")

if __name__ == "__main__":
    simulate(server, client)
