"""Vision Transformer: linear patch embedding, CLS token, learned positions, pre-LN blocks, untied head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedlmc.models.layers import Block, TransformerConfig, init_weights, make_norm


@dataclass
class ViTConfig(TransformerConfig):
    image_size: int = 28
    patch_size: int = 7
    channels: int = 1
    num_classes: int = 10
    arch = "vit"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ViT(nn.Module):
    """Images ``(B, C, H, W)`` → class logits ``(B, num_classes)``, read from the CLS position."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        p = config.patch_size
        self.patch_emb = nn.Linear(config.channels * p * p, config.d_model)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.d_model))
        self.pos_emb = nn.Parameter(torch.zeros(config.n_patches + 1, config.d_model))
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, causal=False) for _ in range(config.n_layer))
        self.ln_f = make_norm(config)
        self.head = nn.Linear(config.d_model, config.num_classes)
        init_weights(self)
        if not self.pos_emb.is_meta:
            nn.init.normal_(self.pos_emb, std=0.02)
            nn.init.normal_(self.cls_token, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.config.patch_size
        patches = F.unfold(images, kernel_size=p, stride=p).transpose(1, 2)  # (B, N, C*p*p)
        x = self.patch_emb(patches)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_emb
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, 0]))
