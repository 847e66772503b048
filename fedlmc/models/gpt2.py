"""GPT-2 in the spirit of nanoGPT: learned positions, pre-LN blocks, final norm, untied head with bias."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fedlmc.models.layers import Block, TransformerConfig, init_weights, make_norm


@dataclass
class GPT2Config(TransformerConfig):
    vocab_size: int = 65
    block_size: int = 64
    arch = "gpt2"


class GPT2(nn.Module):
    """Token ids ``(B, T)`` → next-token logits ``(B, T, vocab_size)``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Parameter(torch.zeros(config.block_size, config.d_model))
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, causal=True) for _ in range(config.n_layer))
        self.ln_f = make_norm(config)
        self.head = nn.Linear(config.d_model, config.vocab_size)
        init_weights(self)
        if not self.pos_emb.is_meta:
            nn.init.normal_(self.pos_emb, std=0.01)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb[:T])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
