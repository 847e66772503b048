"""Transformer building blocks shared by GPT-2 and ViT (pre-LN, biases everywhere).

Attention keeps Q, K, V and O as four separate linear maps so the symmetry spec can name each of
them; heads are contiguous blocks of ``d_head`` rows of Q/K/V (and columns of O).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TransformerConfig:
    """Fields every architecture shares. ``d_head`` defaults to ``d_model // n_head``.

    ``norm`` is ``"layernorm"`` (trained models) or ``"rmsnorm"`` (the canonical form: parameter-free,
    optionally with a bias; ``norm_gain`` adds Llama's learned gain, which the canonical form folds away).
    ``activation`` is the FF nonlinearity: ``"gelu"`` (exact), ``"gelu_tanh"`` (GPT-2's ``gelu_new``) or
    ``"relu"`` (OPT's).
    ``attn_scale`` defaults to ``1/sqrt(d_head)``; it is stored so that a model whose head width changed
    (e.g. a circuit merge) keeps computing the same scores.
    """

    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    d_ff: int = 512
    d_head: Optional[int] = None
    dropout: float = 0.0
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_bias: bool = False
    norm_gain: bool = False
    activation: str = "gelu"
    attn_scale: Optional[float] = None

    def __post_init__(self) -> None:
        if self.d_head is None:
            if self.d_model % self.n_head:
                raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}; set d_head")
            self.d_head = self.d_model // self.n_head
        if self.attn_scale is None:
            self.attn_scale = 1.0 / math.sqrt(self.d_head)
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}")
        for name in ("n_layer", "d_model", "n_head", "d_ff", "d_head"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TransformerConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def replace(self, **changes: Any) -> "TransformerConfig":
        d = asdict(self)
        d.update(changes)
        return type(self)(**d)

    arch = "transformer"


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,  # OPT's; positively homogeneous: an FF neuron can be rescaled by c > 0
}


class RMSNorm(nn.Module):
    """RMSNorm ``x / sqrt(mean(x^2) + eps)``: parameter-free (the canonical form), with an optional bias,
    or with Llama's learned gain ``weight``."""

    def __init__(self, d: int, eps: float = 1e-5, bias: bool = False, gain: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d)) if gain else None
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y * self.weight if self.weight is not None else y
        return y + self.bias if self.bias is not None else y


def make_norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
    return RMSNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.norm_bias, gain=cfg.norm_gain)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig, causal: bool) -> None:
        super().__init__()
        inner = cfg.n_head * cfg.d_head
        self.n_head, self.d_head, self.scale, self.causal = cfg.n_head, cfg.d_head, cfg.attn_scale, causal
        self.q = nn.Linear(cfg.d_model, inner)
        self.k = nn.Linear(cfg.d_model, inner)
        self.v = nn.Linear(cfg.d_model, inner)
        self.o = nn.Linear(inner, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, self.d_head).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=self.causal,
            scale=self.scale,
            dropout_p=self.drop.p if self.training else 0.0,
        )
        return self.drop(self.o(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.act = ACTIVATIONS[cfg.activation]
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: TransformerConfig, causal: bool) -> None:
        super().__init__()
        self.ln1 = make_norm(cfg)
        self.attn = Attention(cfg, causal)
        self.ln2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2 style init: N(0, 0.02) weights, zero biases, unit norms (nothing on the meta device, where
    a model is built to be filled: there it would only cost time)."""
    if any(p.is_meta for p in module.parameters()):
        return
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)


def is_rotary(cfg) -> bool:
    """Whether the architecture applies rotary position embeddings to its heads (Llama, GPT-NeoX)."""
    return hasattr(cfg, "rope_theta")
