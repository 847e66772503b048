"""A Llama-style decoder in the spirit of nanoGPT: RMSNorm with a learned gain, rotary positions (RoPE,
``rotate_half`` pairing as in Hugging Face), grouped-query attention and a SwiGLU FF, no biases, an
untied output head (a tied Hugging Face model converts to an untied copy: ``fedlmc.hf``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedlmc.models.layers import TransformerConfig, init_weights, make_norm


@dataclass
class LlamaConfig(TransformerConfig):
    vocab_size: int = 65
    block_size: int = 64
    n_kv_head: Optional[int] = None  # grouped-query attention: KV heads (None: one per query head)
    rope_theta: float = 10000.0
    norm: str = "rmsnorm"
    norm_gain: bool = True
    norm_eps: float = 1e-6
    activation: str = "silu"
    arch = "llama"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_head % self.n_kv_head or self.d_head % 2:
            raise ValueError(
                f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head} "
                f"and d_head={self.d_head} even (rotary pairs)"
            )


def rotary(
    cfg: LlamaConfig, T: int, like: torch.Tensor, dims: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``(T, dims)`` of the rotary angles (``dims``: the rotary width, default ``d_head``), in
    ``like``'s dtype (float64 models stay exact)."""
    dt = torch.float64 if like.dtype == torch.float64 else torch.float32
    d = dims or cfg.d_head
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=dt, device=like.device) / d)
    ang = torch.arange(T, dtype=dt, device=like.device)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(like.dtype), ang.sin().to(like.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, Hkv, dh = cfg.n_head, cfg.n_kv_head, cfg.d_head
        self.q = nn.Linear(cfg.d_model, H * dh, bias=False)
        self.k = nn.Linear(cfg.d_model, Hkv * dh, bias=False)
        self.v = nn.Linear(cfg.d_model, Hkv * dh, bias=False)
        self.o = nn.Linear(H * dh, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.cfg
        q = self.q(x).view(B, T, c.n_head, c.d_head).transpose(1, 2)
        k, v = (p(x).view(B, T, c.n_kv_head, c.d_head).transpose(1, 2) for p in (self.k, self.v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = c.n_head // c.n_kv_head  # KV head g serves query heads g·rep ... g·rep + rep − 1
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=c.attn_scale, dropout_p=c.dropout if self.training else 0.0
        )
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.ln1, self.attn = make_norm(cfg), LlamaAttention(cfg)
        self.ln2, self.mlp = make_norm(cfg), SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.mlp(self.ln2(x))


class RotaryDecoder(nn.Module):
    """A decoder with rotary positions: token ids ``(B, T)`` → next-token logits ``(B, T, vocab_size)``.
    Subclasses name their ``Block`` (``block(x, cos, sin)``), whether the head has a bias, and the rotary
    width (``config.rotary_dims``, default the whole head)."""

    Block: type
    head_bias: bool = False

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(self.Block(config) for _ in range(config.n_layer))
        self.ln_f = make_norm(config)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=self.head_bias)
        init_weights(self)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.tok_emb(idx)
        cos, sin = rotary(self.config, T, x, dims=getattr(self.config, "rotary_dims", None))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.ln_f(x))


class Llama(RotaryDecoder):
    """Token ids ``(B, T)`` → next-token logits ``(B, T, vocab_size)``."""

    Block = LlamaBlock
