"""The declarative symmetry spec: which tensor axes each symmetry group of an architecture acts on.

The declarative symmetry spec, group elements (transforms) and their action on a model.

A ``SymmetrySpec`` lists, per architecture, every symmetry group and the tensor axes it acts on:

* ``residual`` — one orthogonal map O of the residual stream (``d_new x d``; rectangular O with
  orthonormal columns lifts a model to a wider residual). It acts on every residual *writer* on its
  output axis and every *reader* on its input axis. Valid on the canonical (RMSNorm) form only.
* ``heads.{l}`` — a permutation of layer l's heads: blocks of ``d_head`` rows of Q/K/V and columns of O.
* ``qk.{l}`` / ``ov.{l}`` — one invertible ``d_head x d_head`` matrix per head (the intra-head gauge):
  ``q_h -> A^T q_h``, ``k_h -> A^{-1} k_h`` keeps ``q^T k``; ``v_h -> B v_h``, ``O_h -> O_h B^{-1}`` keeps ``O_h v_h``.
* ``ff.{l}`` — a permutation of layer l's FF neurons: fc1 rows and bias, fc2 columns.
* ``ffscale.{l}`` — one scale per FF neuron (the semi-permutation level's diagonal part), where the
  nonlinearity is homogeneous: ReLU (``relu(c·x) = c·relu(x)`` for ``c > 0``: fc1 row and bias × c, fc2
  column / c; ``structure="positive"``) and SwiGLU's ``up`` (linear in it: up row × c, down column / c,
  any ``c ≠ 0``; ``structure="signed"``). None for GELU. It acts after its layer's FF permutation.

Every member says which matrix acts on the vectors that lie along its axis: ``M``, ``M^T``, ``M^{-1}``
or ``M^{-T}`` of the group element M. Permutations are stored as index tensors with the convention
``new[i] = old[perm[i]]`` (the permutation matrix P has ``P[i, perm[i]] = 1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Union

import torch
import torch.nn as nn

from fedlmc.models.layers import TransformerConfig

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Member:
    """One tensor axis a group acts on.

    ``fn`` names the matrix applied to vectors along ``axis`` ("M", "MT", "Minv", "MinvT"). ``block``
    is the block size for head-structured groups (heads, gauges). For the residual group, ``role`` is
    "writer", "reader" or "norm"; readers name the norm that feeds them and their bias, which is what
    the canonical form needs to fold a LayerNorm's affine into them. In a heads group, ``role="out"``
    marks the output projection (whose columns carry each head's contribution to the stream).
    ``repeat`` > 1: each unit of the group owns ``repeat`` consecutive blocks of this tensor, all acted on
    alike (grouped-query attention: a KV head's query heads and their output columns).
    """

    param: str
    axis: int
    fn: str = "M"
    block: int = 1
    role: Optional[str] = None
    norm: Optional[str] = None
    bias: Optional[str] = None
    repeat: int = 1


@dataclass
class Group:
    """A symmetry group: ``kind`` is "orthogonal", "permutation", "gauge" (``count`` matrices of ``size``)
    or "scale" (``size`` non-zero factors, positive where ``structure="positive"``)."""

    name: str
    kind: str
    size: int
    members: list[Member]
    layer: Optional[int] = None
    count: int = 1
    probe: Optional[str] = None  # module whose activations show this group's units (activation matching)
    heads: Optional[str] = None  # a gauge or "within" group: the heads group whose permutation it follows
    # a subgroup: "rope" (gauge) = per frequency pair (i, i + size/2), a scaled 2×2 rotation (the maps that
    # commute with every rotary rotation; see ``fedlmc.symmetry.rope``); "within" (permutation) = units
    # move only inside their block of ``size / count`` consecutive units (a KV head's query heads)
    structure: Optional[str] = None
    rotary: Optional[int] = None  # "rope": how many leading dimensions of a head are rotary (None: all)

    @property
    def rank(self) -> tuple[int, int]:
        """Where the group acts in a transform: the residual map first, then layer by layer, a layer's
        permutations before its gauges (gauge h refers to the permuted head h), "within" permutations
        last (they commute with the gauges, which are shared inside a block)."""
        order = (
            3 if self.structure == "within" else {"orthogonal": 0, "permutation": 1, "gauge": 2, "scale": 2}[self.kind]
        )
        return (-1 if self.layer is None else self.layer, order)


@dataclass
class SymmetrySpec:
    """All groups of one architecture, plus the norm modules the canonical form rewrites."""

    arch: str
    groups: dict[str, Group]
    norms: list[str]
    residual_probes: list[str] = field(default_factory=list)  # modules whose outputs are residual states

    @property
    def residual(self) -> Group:
        return self.groups["residual"]

    def layer_groups(self, kind: str) -> list[Group]:
        """The per-layer groups whose name starts with ``kind`` ("heads", "qk", "ov", "ff", "ffscale"), by
        layer."""
        return [g for name, g in self.groups.items() if name.split(".")[0] == kind]

    def renamed(self, rename: Callable[[str], str], arch: Optional[str] = None) -> "SymmetrySpec":
        """The same spec for a model whose parameters and modules are named ``rename(name)``: how an
        architecture with the same mathematics under other names describes itself."""

        def member(m: Member) -> Member:
            return replace(m, param=rename(m.param), norm=m.norm and rename(m.norm), bias=m.bias and rename(m.bias))

        groups = {
            n: replace(g, members=[member(m) for m in g.members], probe=g.probe and rename(g.probe))
            for n, g in self.groups.items()
        }
        return SymmetrySpec(
            arch or self.arch, groups, [rename(n) for n in self.norms], [rename(p) for p in self.residual_probes]
        )

    def gauges_of(self, heads: str) -> dict[str, Group]:
        """The gauge groups that follow heads group ``heads``, by kind ("qk", "ov")."""
        return {name.split(".")[0]: g for name, g in self.groups.items() if g.heads == heads and g.kind == "gauge"}

    def within_of(self, heads: str) -> Optional[Group]:
        """The "within" permutation group that follows heads group ``heads`` (grouped-query attention's
        query heads inside their KV head), if the architecture has one."""
        return next((g for g in self.groups.values() if g.heads == heads and g.structure == "within"), None)

    def writers(self) -> list[Member]:
        return [m for m in self.residual.members if m.role == "writer"]

    def readers(self) -> list[Member]:
        return [m for m in self.residual.members if m.role == "reader"]


# --------------------------------------------------------------------------------------------------
# Spec builders, one per architecture. A new architecture registers its own with ``register_spec``.

SpecBuilder = Callable[[TransformerConfig], SymmetrySpec]
_BUILDERS: dict[str, SpecBuilder] = {}


def register_spec(arch: str, builder: SpecBuilder) -> None:
    """Make ``spec_for`` know architecture ``arch`` (its configs' ``arch`` attribute)."""
    _BUILDERS[arch] = builder


def _norm_members(cfg: TransformerConfig, norm: str) -> list[Member]:
    # Only a biased RMSNorm carries residual-indexed parameters; LayerNorm's are folded away first.
    return [Member(f"{norm}.bias", 0, role="norm")] if cfg.norm == "rmsnorm" and cfg.norm_bias else []


def transformer_spec(cfg: TransformerConfig, embed_writers: list[Member], head: str = "head") -> SymmetrySpec:
    """The spec of a pre-norm Transformer with ``cfg.n_layer`` standard blocks under ``blocks.{l}``.

    ``embed_writers`` are the architecture's input writers (embeddings, positions, CLS); ``head`` is the
    output linear map, read through ``ln_f``.
    """
    H, dh = cfg.n_head, cfg.d_head
    residual: list[Member] = list(embed_writers)
    groups: dict[str, Group] = {}
    norms: list[str] = []
    for l in range(cfg.n_layer):
        b = f"blocks.{l}"
        ln1, ln2 = f"{b}.ln1", f"{b}.ln2"
        norms += [ln1, ln2]
        residual += _norm_members(cfg, ln1) + _norm_members(cfg, ln2)
        residual += [
            Member(f"{b}.attn.{p}.weight", 1, role="reader", norm=ln1, bias=f"{b}.attn.{p}.bias") for p in "qkv"
        ]
        residual += [Member(f"{b}.attn.o.weight", 0, role="writer"), Member(f"{b}.attn.o.bias", 0, role="writer")]
        residual += [Member(f"{b}.mlp.fc1.weight", 1, role="reader", norm=ln2, bias=f"{b}.mlp.fc1.bias")]
        residual += [Member(f"{b}.mlp.fc2.weight", 0, role="writer"), Member(f"{b}.mlp.fc2.bias", 0, role="writer")]
        qkv = [Member(f"{b}.attn.{p}.{t}", 0, block=dh) for p in "qkv" for t in ("weight", "bias")]
        out = Member(f"{b}.attn.o.weight", 1, block=dh, role="out")
        groups[f"heads.{l}"] = Group(f"heads.{l}", "permutation", H, qkv + [out], l, probe=f"{b}.attn.o")
        groups[f"qk.{l}"] = Group(
            f"qk.{l}",
            "gauge",
            dh,
            [
                Member(f"{b}.attn.q.weight", 0, "MT", dh),
                Member(f"{b}.attn.q.bias", 0, "MT", dh),
                Member(f"{b}.attn.k.weight", 0, "Minv", dh),
                Member(f"{b}.attn.k.bias", 0, "Minv", dh),
            ],
            l,
            count=H,
            heads=f"heads.{l}",
        )
        groups[f"ov.{l}"] = Group(
            f"ov.{l}",
            "gauge",
            dh,
            [
                Member(f"{b}.attn.v.weight", 0, "M", dh),
                Member(f"{b}.attn.v.bias", 0, "M", dh),
                Member(f"{b}.attn.o.weight", 1, "MinvT", dh),
            ],
            l,
            count=H,
            heads=f"heads.{l}",
        )
        groups[f"ff.{l}"] = Group(
            f"ff.{l}",
            "permutation",
            cfg.d_ff,
            [Member(f"{b}.mlp.fc1.weight", 0), Member(f"{b}.mlp.fc1.bias", 0), Member(f"{b}.mlp.fc2.weight", 1)],
            l,
            probe=f"{b}.mlp.fc2",
        )
        if cfg.activation == "relu":  # positively homogeneous: a neuron's in-weights × c, out-weights / c
            groups[f"ffscale.{l}"] = Group(
                f"ffscale.{l}",
                "scale",
                cfg.d_ff,
                [
                    Member(f"{b}.mlp.fc1.weight", 0),
                    Member(f"{b}.mlp.fc1.bias", 0),
                    Member(f"{b}.mlp.fc2.weight", 1, "Minv"),
                ],
                l,
                heads=f"ff.{l}",
                structure="positive",
            )
    norms.append("ln_f")
    residual += _norm_members(cfg, "ln_f")
    residual.append(Member(f"{head}.weight", 1, role="reader", norm="ln_f", bias=f"{head}.bias"))
    all_groups = {"residual": Group("residual", "orthogonal", cfg.d_model, residual)}
    all_groups.update(groups)
    return SymmetrySpec(cfg.arch, all_groups, norms, [f"blocks.{l}" for l in range(cfg.n_layer)])


register_spec(
    "gpt2",
    lambda cfg: transformer_spec(
        cfg, [Member("tok_emb.weight", 1, role="writer"), Member("pos_emb", 1, role="writer")]
    ),
)
register_spec(
    "vit",
    lambda cfg: transformer_spec(
        cfg,
        [
            Member("patch_emb.weight", 0, role="writer"),
            Member("patch_emb.bias", 0, role="writer"),
            Member("cls_token", 2, role="writer"),
            Member("pos_emb", 1, role="writer"),
        ],
    ),
)


def neox_spec(cfg) -> SymmetrySpec:
    """GPT-NeoX blocks name their parts as fedlmc's GPT-2 does, so the groups are the standard ones; the
    only embedding writer is the token table (positions are rotary), and the QK gauge is restricted to
    what commutes with partial RoPE (``structure="rope"`` on the first ``rotary_dims`` dimensions of a
    head, free on the rest). Reading the same state in parallel changes no group: attention and FF are
    both readers of the residual stream and writers to it."""
    spec = transformer_spec(cfg, [Member("tok_emb.weight", 1, role="writer")])
    for g in spec.layer_groups("qk"):
        g.structure, g.rotary = "rope", cfg.rotary_dims
    return spec


register_spec("neox", neox_spec)


def llama_spec(cfg) -> SymmetrySpec:
    """Llama-style blocks: no biases, SwiGLU (``ff.{l}`` permutes gate and up rows and down columns
    together), grouped-query attention (``heads.{l}`` permutes the ``n_kv_head`` KV heads, each carrying
    its ``n_head / n_kv_head`` query heads and their output columns; ``qheads.{l}`` permutes query heads
    inside their KV head's block, when a KV head has more than one) and RoPE (the QK gauge is restricted to scaled
    rotations of each frequency pair, ``structure="rope"``; the OV gauge is a full invertible map per
    KV head). RMSNorm has no centring, so the residual group is the full orthogonal group."""
    Hkv, dh, rep = cfg.n_kv_head, cfg.d_head, cfg.n_head // cfg.n_kv_head
    residual = [Member("tok_emb.weight", 1, role="writer")]
    groups: dict[str, Group] = {}
    norms: list[str] = []
    for l in range(cfg.n_layer):
        b = f"blocks.{l}"
        norms += [f"{b}.ln1", f"{b}.ln2"]
        residual += [Member(f"{b}.attn.{p}.weight", 1, role="reader", norm=f"{b}.ln1") for p in "qkv"]
        residual += [Member(f"{b}.mlp.{p}.weight", 1, role="reader", norm=f"{b}.ln2") for p in ("gate", "up")]
        residual += [Member(f"{b}.attn.o.weight", 0, role="writer"), Member(f"{b}.mlp.down.weight", 0, role="writer")]
        q, k, v = (f"{b}.attn.{p}.weight" for p in "qkv")
        o = f"{b}.attn.o.weight"
        groups[f"heads.{l}"] = Group(
            f"heads.{l}",
            "permutation",
            Hkv,
            [
                Member(q, 0, block=dh, repeat=rep),
                Member(k, 0, block=dh),
                Member(v, 0, block=dh),
                Member(o, 1, block=dh, role="out", repeat=rep),
            ],
            l,
            probe=f"{b}.attn.o",
        )
        groups[f"qk.{l}"] = Group(
            f"qk.{l}",
            "gauge",
            dh,
            [Member(q, 0, "MT", dh, repeat=rep), Member(k, 0, "Minv", dh)],
            l,
            count=Hkv,
            heads=f"heads.{l}",
            structure="rope",
        )
        groups[f"ov.{l}"] = Group(
            f"ov.{l}",
            "gauge",
            dh,
            [Member(v, 0, "M", dh), Member(o, 1, "MinvT", dh, repeat=rep)],
            l,
            count=Hkv,
            heads=f"heads.{l}",
        )
        if rep > 1:
            groups[f"qheads.{l}"] = Group(
                f"qheads.{l}",
                "permutation",
                cfg.n_head,
                [Member(q, 0, block=dh), Member(o, 1, block=dh, role="out")],
                l,
                count=Hkv,
                heads=f"heads.{l}",
                structure="within",
            )
        groups[f"ff.{l}"] = Group(
            f"ff.{l}",
            "permutation",
            cfg.d_ff,
            [Member(f"{b}.mlp.gate.weight", 0), Member(f"{b}.mlp.up.weight", 0), Member(f"{b}.mlp.down.weight", 1)],
            l,
            probe=f"{b}.mlp.down",
        )
        groups[f"ffscale.{l}"] = Group(  # SwiGLU is linear in up: any non-zero scale, sign included
            f"ffscale.{l}",
            "scale",
            cfg.d_ff,
            [Member(f"{b}.mlp.up.weight", 0), Member(f"{b}.mlp.down.weight", 1, "Minv")],
            l,
            heads=f"ff.{l}",
            structure="signed",
        )
    norms.append("ln_f")
    residual.append(Member("head.weight", 1, role="reader", norm="ln_f"))
    all_groups = {"residual": Group("residual", "orthogonal", cfg.d_model, residual)}
    all_groups.update(groups)
    return SymmetrySpec(cfg.arch, all_groups, norms, [f"blocks.{l}" for l in range(cfg.n_layer)])


register_spec("llama", llama_spec)


def spec_for(model: Union[nn.Module, TransformerConfig]) -> SymmetrySpec:
    """The symmetry spec of a model (or config). Raises for architectures nobody registered."""
    cfg = model if isinstance(model, TransformerConfig) else getattr(model, "config", None)
    if cfg is None or getattr(cfg, "arch", None) not in _BUILDERS:
        raise ValueError(f"no symmetry spec for {type(model).__name__}; known architectures: {sorted(_BUILDERS)}")
    return _BUILDERS[cfg.arch](cfg)
