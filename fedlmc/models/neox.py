"""A GPT-NeoX-style decoder (the Pythia suites) in the spirit of nanoGPT: LayerNorm, biases everywhere,
no learned positions but rotary ones on the first ``rotary_dims`` dimensions of each head (partial
rotary, ``rotate_half`` pairing), a GELU FF, attention and FF reading the same residual state in
parallel (``x + attn(ln1(x)) + mlp(ln2(x))``; ``parallel=False``: one after the other), an untied head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedlmc.models.layers import MLP, TransformerConfig, make_norm
from fedlmc.models.llama import RotaryDecoder, rotate


@dataclass
class NeoXConfig(TransformerConfig):
    vocab_size: int = 65
    block_size: int = 64
    rope_theta: float = 10000.0
    rotary_dims: Optional[int] = None  # leading rotary dimensions per head (None: a quarter, as Pythia)
    parallel: bool = True  # GPT-NeoX's use_parallel_residual
    arch = "neox"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rotary_dims is None:
            self.rotary_dims = 2 * (self.d_head // 8)
        if self.rotary_dims % 2 or not 0 < self.rotary_dims <= self.d_head:
            raise ValueError(f"rotary_dims must be even and in (0, d_head={self.d_head}], got {self.rotary_dims}")


class NeoXAttention(nn.Module):
    def __init__(self, cfg: NeoXConfig) -> None:
        super().__init__()
        self.cfg = cfg
        inner = cfg.n_head * cfg.d_head
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, inner) for _ in range(3))
        self.o = nn.Linear(inner, cfg.d_model)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        c, r = self.cfg, self.cfg.rotary_dims
        q, k, v = (p(x).view(B, T, c.n_head, c.d_head).transpose(1, 2) for p in (self.q, self.k, self.v))
        q = torch.cat([rotate(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=c.attn_scale, dropout_p=c.dropout if self.training else 0.0
        )
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class NeoXBlock(nn.Module):
    def __init__(self, cfg: NeoXConfig) -> None:
        super().__init__()
        self.parallel = cfg.parallel
        self.ln1, self.attn = make_norm(cfg), NeoXAttention(cfg)
        self.ln2, self.mlp = make_norm(cfg), MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            return x + self.attn(self.ln1(x), cos, sin) + self.mlp(self.ln2(x))
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.mlp(self.ln2(x))


class NeoX(RotaryDecoder):
    """Token ids ``(B, T)`` → next-token logits ``(B, T, vocab_size)``."""

    Block = NeoXBlock
    head_bias = True  # Hugging Face's has none: fitted on export (``fedlmc.hf.head``)
