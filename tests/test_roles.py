"""A user's own Transformer, described by ``Roles`` (its module names → the spec's roles): a small
causal LM whose names match none of fedlmc's and whose forward is its own goes through the exact
canonical form and symmetries, planted weight matching and an ``AlignedFedAvg`` round."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import perturbed
from flwr.app import ArrayRecord
from test_strategies import _reply

from fedlmc.matching import weight_matching
from fedlmc.models import register_architecture
from fedlmc.models.layers import TransformerConfig, make_norm
from fedlmc.options import Matching, Universe
from fedlmc.strategies import AlignedFedAvg
from fedlmc.symmetry import Roles, apply_transform, canonicalize, random_transform, register_spec, spec_from_roles


@dataclass
class TinyLMConfig(TransformerConfig):
    vocab_size: int = 20
    block_size: int = 16
    arch = "tiny-lm"


class Mixer(nn.Module):
    def __init__(self, c: TinyLMConfig) -> None:
        super().__init__()
        self.c = c
        self.query, self.key, self.value = (nn.Linear(c.d_model, c.n_head * c.d_head) for _ in range(3))
        self.out = nn.Linear(c.n_head * c.d_head, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # hand-written attention, not fedlmc's
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.c.n_head, self.c.d_head).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = (q @ k.transpose(-1, -2)) * self.c.attn_scale
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))


class Layer(nn.Module):
    def __init__(self, c: TinyLMConfig) -> None:
        super().__init__()
        self.norm_a, self.attention, self.norm_b = make_norm(c), Mixer(c), make_norm(c)
        self.w_in, self.w_out = nn.Linear(c.d_model, c.d_ff), nn.Linear(c.d_ff, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm_a(x))
        return x + self.w_out(F.gelu(self.w_in(self.norm_b(x))))


class TinyLM(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.positions = nn.Parameter(torch.randn(config.block_size, config.d_model) * 0.02)
        self.stack = nn.ModuleList(Layer(config) for _ in range(config.n_layer))
        self.norm = make_norm(config)
        self.readout = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx) + self.positions[: idx.shape[1]]
        for layer in self.stack:
            x = layer(x)
        return self.readout(self.norm(x))


ROLES = Roles(
    layer="stack.{l}",
    q="stack.{l}.attention.query",
    k="stack.{l}.attention.key",
    v="stack.{l}.attention.value",
    o="stack.{l}.attention.out",
    ff_in="stack.{l}.w_in",
    ff_out="stack.{l}.w_out",
    norm1="stack.{l}.norm_a",
    norm2="stack.{l}.norm_b",
    final_norm="norm",
    head="readout",
    writers=[("embedding.weight", 1), ("positions", 1)],
)
register_architecture("tiny-lm", TinyLMConfig, TinyLM)
register_spec("tiny-lm", lambda cfg: spec_from_roles(cfg, ROLES))


def make(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return perturbed(TinyLM(TinyLMConfig(n_layer=2, d_model=16, n_head=2, d_ff=32)).double(), seed, 0.2)


def gap(a, b, x) -> float:
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


def test_own_transformer_is_exact_under_its_symmetries(record):
    m = make(0)
    x = torch.randint(0, 20, (3, 16))
    c = canonicalize(m)
    assert isinstance(c, TinyLM) and "norm.weight" not in c.state_dict()
    record("own Transformer: canonical form", gap(m, c, x), 1e-10)
    for seed in range(2):
        record(
            f"own Transformer: random group element {seed}",
            gap(m, apply_transform(m, random_transform(m, seed=seed)), x),
            1e-10,
        )


def test_own_transformer_planted_matching_and_a_round(record):
    a = canonicalize(make(1))
    b = apply_transform(a, random_transform(a, seed=3))
    T = weight_matching(a, b, Matching(gauge="invertible"))
    aligned = apply_transform(b, T).state_dict()
    err = max(float((aligned[k] - v).abs().max() / v.abs().max()) for k, v in a.state_dict().items())
    record("own Transformer: planted recovery, relative parameter error", err, 1e-2)  # as test_matching's
    model = make(2).float()
    strategy = AlignedFedAvg(model=model, universe=Universe(iterations=1))
    strategy.check_architecture(ArrayRecord(model.state_dict()))
    strategy._previous = ArrayRecord(model.state_dict())
    arrays, _ = strategy.aggregate_train(1, [_reply(make(s).float(), 5, s) for s in (3, 4)])
    assert strategy.history[-1]["excluded"] == [] and set(arrays.keys()) == set(model.state_dict())
