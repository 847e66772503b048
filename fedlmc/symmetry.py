"""The declarative symmetry spec, group elements (transforms) and their action on a model.

A ``SymmetrySpec`` lists, per architecture, every symmetry group and the tensor axes it acts on:

* ``residual`` — one orthogonal map O of the residual stream (``d_new x d``; rectangular O with
  orthonormal columns lifts a model to a wider residual). It acts on every residual *writer* on its
  output axis and every *reader* on its input axis. Valid on the canonical (RMSNorm) form only.
* ``heads.{l}`` — a permutation of layer l's heads: blocks of ``d_head`` rows of Q/K/V and columns of O.
* ``qk.{l}`` / ``ov.{l}`` — one invertible ``d_head x d_head`` matrix per head (the intra-head gauge):
  ``q_h -> A^T q_h``, ``k_h -> A^{-1} k_h`` keeps ``q^T k``; ``v_h -> B v_h``, ``O_h -> O_h B^{-1}`` keeps ``O_h v_h``.
* ``ff.{l}`` — a permutation of layer l's FF neurons: fc1 rows and bias, fc2 columns.

Every member says which matrix acts on the vectors that lie along its axis: ``M``, ``M^T``, ``M^{-1}``
or ``M^{-T}`` of the group element M. Permutations are stored as index tensors with the convention
``new[i] = old[perm[i]]`` (the permutation matrix P has ``P[i, perm[i]] = 1``).

A ``Transform`` is one element of the product group: a dict from group name to element. Missing
groups are the identity. Everything downstream (matching, merging, strategies) walks the spec.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

import torch
import torch.nn as nn

from .models import from_config
from .models.layers import TransformerConfig

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Member:
    """One tensor axis a group acts on.

    ``fn`` names the matrix applied to vectors along ``axis`` ("M", "MT", "Minv", "MinvT"). ``block``
    is the block size for head-structured groups (heads, gauges). For the residual group, ``role`` is
    "writer", "reader" or "norm"; readers name the norm that feeds them and their bias, which is what
    the canonical form needs to fold a LayerNorm's affine into them.
    """

    param: str
    axis: int
    fn: str = "M"
    block: int = 1
    role: Optional[str] = None
    norm: Optional[str] = None
    bias: Optional[str] = None


@dataclass
class Group:
    """A symmetry group: ``kind`` is "orthogonal", "permutation" or "gauge" (``count`` matrices of ``size``)."""

    name: str
    kind: str
    size: int
    members: list[Member]
    layer: Optional[int] = None
    count: int = 1
    probe: Optional[str] = None  # module whose activations show this group's units (activation matching)


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
        """The per-layer groups whose name starts with ``kind`` ("heads", "qk", "ov", "ff"), by layer."""
        return [g for name, g in self.groups.items() if name.split(".")[0] == kind]

    def writers(self) -> list[Member]:
        return [m for m in self.residual.members if m.role == "writer"]

    def readers(self) -> list[Member]:
        return [m for m in self.residual.members if m.role == "reader"]


@dataclass
class Transform:
    """One group element per named group; absent groups act as the identity."""

    elements: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict = field(default_factory=dict, compare=False)  # diagnostics from whoever built it

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.elements[name]

    def get(self, name: str) -> Optional[torch.Tensor]:
        return self.elements.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.elements

    def to(self, dtype: Optional[torch.dtype] = None, device: Union[str, torch.device, None] = None) -> "Transform":
        """Float elements to ``dtype``/``device``; permutations stay integer."""
        out = {}
        for k, v in self.elements.items():
            out[k] = v.to(device=device) if not v.is_floating_point() else v.to(device=device, dtype=dtype or v.dtype)
        return Transform(out)

    def only(self, *kinds: str) -> "Transform":
        """The sub-transform of the groups whose kind prefix is in ``kinds`` (e.g. ``"residual", "ff"``)."""
        return Transform({k: v for k, v in self.elements.items() if k.split(".")[0] in kinds})


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
        residual += [Member(f"{b}.attn.{p}.weight", 1, role="reader", norm=ln1, bias=f"{b}.attn.{p}.bias") for p in "qkv"]
        residual += [Member(f"{b}.attn.o.weight", 0, role="writer"), Member(f"{b}.attn.o.bias", 0, role="writer")]
        residual += [Member(f"{b}.mlp.fc1.weight", 1, role="reader", norm=ln2, bias=f"{b}.mlp.fc1.bias")]
        residual += [Member(f"{b}.mlp.fc2.weight", 0, role="writer"), Member(f"{b}.mlp.fc2.bias", 0, role="writer")]
        qkv = [Member(f"{b}.attn.{p}.{t}", 0, block=dh) for p in "qkv" for t in ("weight", "bias")]
        groups[f"heads.{l}"] = Group(f"heads.{l}", "permutation", H, qkv + [Member(f"{b}.attn.o.weight", 1, block=dh)], l,
                                     probe=f"{b}.attn.o")
        groups[f"qk.{l}"] = Group(f"qk.{l}", "gauge", dh, [
            Member(f"{b}.attn.q.weight", 0, "MT", dh), Member(f"{b}.attn.q.bias", 0, "MT", dh),
            Member(f"{b}.attn.k.weight", 0, "Minv", dh), Member(f"{b}.attn.k.bias", 0, "Minv", dh)], l, count=H)
        groups[f"ov.{l}"] = Group(f"ov.{l}", "gauge", dh, [
            Member(f"{b}.attn.v.weight", 0, "M", dh), Member(f"{b}.attn.v.bias", 0, "M", dh),
            Member(f"{b}.attn.o.weight", 1, "MinvT", dh)], l, count=H)
        groups[f"ff.{l}"] = Group(f"ff.{l}", "permutation", cfg.d_ff, [
            Member(f"{b}.mlp.fc1.weight", 0), Member(f"{b}.mlp.fc1.bias", 0), Member(f"{b}.mlp.fc2.weight", 1)], l,
            probe=f"{b}.mlp.fc2")
    norms.append("ln_f")
    residual += _norm_members(cfg, "ln_f")
    residual.append(Member(f"{head}.weight", 1, role="reader", norm="ln_f", bias=f"{head}.bias"))
    all_groups = {"residual": Group("residual", "orthogonal", cfg.d_model, residual)}
    all_groups.update(groups)
    return SymmetrySpec(cfg.arch, all_groups, norms, [f"blocks.{l}" for l in range(cfg.n_layer)])


register_spec("gpt2", lambda cfg: transformer_spec(
    cfg, [Member("tok_emb.weight", 1, role="writer"), Member("pos_emb", 1, role="writer")]))
register_spec("vit", lambda cfg: transformer_spec(cfg, [
    Member("patch_emb.weight", 0, role="writer"), Member("patch_emb.bias", 0, role="writer"),
    Member("cls_token", 2, role="writer"), Member("pos_emb", 1, role="writer")]))


def spec_for(model: Union[nn.Module, TransformerConfig]) -> SymmetrySpec:
    """The symmetry spec of a model (or config). Raises for architectures nobody registered."""
    cfg = model if isinstance(model, TransformerConfig) else getattr(model, "config", None)
    if cfg is None or getattr(cfg, "arch", None) not in _BUILDERS:
        raise ValueError(f"no symmetry spec for {type(model).__name__}; known architectures: {sorted(_BUILDERS)}")
    return _BUILDERS[cfg.arch](cfg)


# --------------------------------------------------------------------------------------------------
# The action.

def _matrix(M: torch.Tensor, fn: str) -> torch.Tensor:
    if fn == "M":
        return M
    if fn == "MT":
        return M.transpose(-1, -2)
    if fn == "Minv":
        return torch.linalg.inv(M)
    if fn == "MinvT":
        return torch.linalg.inv(M).transpose(-1, -2)
    raise ValueError(f"unknown member fn {fn!r}")


def _apply_along(t: torch.Tensor, axis: int, M: torch.Tensor) -> torch.Tensor:
    """Replace every vector v along ``axis`` by ``M v`` (M may be rectangular)."""
    x = t.movedim(axis, -1)
    return (x @ M.transpose(0, 1).to(x)).movedim(-1, axis)


def _permute_along(t: torch.Tensor, axis: int, perm: torch.Tensor, block: int) -> torch.Tensor:
    perm = perm.to(t.device)
    if block > 1:
        perm = (perm[:, None] * block + torch.arange(block, device=t.device)).reshape(-1)
    return t.index_select(axis, perm)


def _gauge_along(t: torch.Tensor, axis: int, Ms: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block matrices: block h of the vectors along ``axis`` becomes ``Ms[h] @ block_h``."""
    x = t.movedim(axis, -1)
    shape = x.shape
    x = x.reshape(*shape[:-1], Ms.shape[0], block)
    x = torch.einsum("...hj,hij->...hi", x, Ms.to(x))
    return x.reshape(shape).movedim(-1, axis)


def is_permutation(element: torch.Tensor) -> bool:
    """An index-vector permutation (as opposed to a matrix element)."""
    return element.dim() == 1 and not element.is_floating_point()


def perm_matrix(perm: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The matrix P with ``P[i, perm[i]] = 1`` (so ``P @ old = old[perm]``)."""
    n = len(perm)
    P = torch.zeros(n, n, dtype=dtype, device=perm.device)
    P[torch.arange(n, device=perm.device), perm] = 1
    return P


def act(sd: StateDict, group: Group, element: torch.Tensor) -> StateDict:
    """Apply one group element to a state dict (returns a new dict; untouched tensors are shared).
    Members whose tensor is absent from ``sd`` are skipped, so a partial state can be acted on."""
    out = dict(sd)
    if group.kind == "orthogonal" and not is_permutation(element):
        d_new, d_old = element.shape
        if d_old != group.size:
            raise ValueError(f"residual element is {d_new}x{d_old} but the model's residual width is {group.size}")
        # A width lift rescales RMSNorm's output by sqrt(d_new/d_old); readers absorb the inverse.
        scale = math.sqrt(d_old / d_new)
        for m in group.members:
            if m.param not in sd:  # partial states (matching works on the tensors a step needs)
                continue
            t = _apply_along(sd[m.param], m.axis, element)
            if d_new != d_old and m.role == "reader":
                t = t * scale
            elif d_new != d_old and m.role == "norm":  # a biased RMSNorm's output grows by 1/scale too
                t = t / scale
            out[m.param] = t
        return out
    for m in group.members:
        if m.param not in sd:
            continue
        t = sd[m.param]
        if group.kind in ("permutation", "orthogonal") and element.is_floating_point():
            # a permutation given as a (possibly relaxed, differentiable) matrix P: new = P old, per block
            P = torch.kron(element, torch.eye(m.block, dtype=element.dtype, device=element.device)) if m.block > 1 else element
            out[m.param] = _apply_along(t, m.axis, P)
        elif group.kind in ("permutation", "orthogonal"):
            out[m.param] = _permute_along(t, m.axis, element, m.block)
        elif group.kind == "gauge":
            out[m.param] = _gauge_along(t, m.axis, _matrix(element, m.fn), m.block)
        else:
            raise ValueError(f"unknown group kind {group.kind!r}")
    return out


def _order(name: str) -> tuple[int, int]:
    # Residual first, then per layer: heads before their gauges (gauge h refers to the permuted head h).
    kind, _, layer = name.partition(".")
    rank = {"residual": 0, "heads": 1, "qk": 2, "ov": 3, "ff": 4}.get(kind, 5)
    return (int(layer) if layer.isdigit() else -1, rank)


def apply_to_state(sd: StateDict, cfg: TransformerConfig, transform: Transform) -> tuple[StateDict, TransformerConfig]:
    """Apply ``transform`` to a state dict of config ``cfg``; returns the new state dict and config."""
    spec = spec_for(cfg)
    unknown = set(transform.elements) - set(spec.groups)
    if unknown:
        raise ValueError(f"transform names groups this model does not have: {sorted(unknown)}")
    R = transform.get("residual")
    if R is not None and cfg.norm != "rmsnorm":
        raise ValueError("the residual group acts on the canonical (RMSNorm) form: call canonicalize(model) first")
    for name in sorted(transform.elements, key=_order):
        sd = act(sd, spec.groups[name], transform.elements[name])
    if R is not None and not is_permutation(R) and R.shape[0] != R.shape[1]:
        d_new, d_old = R.shape
        cfg = cfg.replace(d_model=d_new, norm_eps=cfg.norm_eps * d_old / d_new)
    return sd, cfg


def rebuild(model: nn.Module, sd: StateDict, cfg: Optional[TransformerConfig] = None) -> nn.Module:
    """A new model of config ``cfg`` (default: the model's) holding ``sd``, on the model's dtype/device."""
    ref = next(model.parameters())
    with torch.device("meta"):  # no random init of weights that are overwritten right away
        new = from_config(cfg or model.config)
    # copy=True: the new model must never share storage with the one it came from
    new.load_state_dict({k: v.detach().to(device=ref.device, dtype=ref.dtype, copy=True) for k, v in sd.items()}, assign=True)
    new.train(model.training)
    if hasattr(model, "meta"):
        new.meta = dict(model.meta)
    return new


def apply_transform(model: nn.Module, transform: Transform) -> nn.Module:
    """The model acted on by ``transform`` (a new model; the input is not modified).

    Permutations and gauges act on any model; the residual orthogonal group acts on the canonical
    (RMSNorm) form, so a LayerNorm model is canonicalised first (exactly). A rectangular residual
    element (``d_new x d``, orthonormal columns) returns a model of width ``d_new`` computing the same
    function.
    """
    if transform.get("residual") is not None and model.config.norm != "rmsnorm":
        from .canonical import canonicalize

        model = canonicalize(model)
    sd, cfg = apply_to_state({k: v.detach() for k, v in model.state_dict().items()}, model.config, transform)
    return rebuild(model, sd, cfg)


# --------------------------------------------------------------------------------------------------
# Random group elements.

def random_orthogonal(d_new: int, d: int, generator: torch.Generator, dtype=torch.float64, fix_ones: bool = False) -> torch.Tensor:
    """A Haar-random ``d_new x d`` matrix with orthonormal columns. ``fix_ones`` requires d_new == d and O·1 = 1."""
    if fix_ones:
        if d_new != d:
            raise ValueError("fix_ones needs a square residual map")
        Q = ones_basis(d, dtype)
        R = random_orthogonal(d - 1, d - 1, generator, dtype)
        return Q @ torch.block_diag(torch.ones(1, 1, dtype=dtype), R) @ Q.T
    A = torch.randn(d_new, d, generator=generator, dtype=dtype)
    Q, r = torch.linalg.qr(A)
    return Q * torch.sign(torch.diagonal(r))  # sign fix makes the distribution Haar


def ones_basis(d: int, dtype=torch.float64) -> torch.Tensor:
    """An orthogonal matrix whose first column is 1/sqrt(d) (the rest span the centred subspace)."""
    A = torch.eye(d, dtype=dtype)
    A[:, 0] = 1.0
    Q, _ = torch.linalg.qr(A)
    return Q * torch.sign(Q[0, 0])


def random_invertible(count: int, k: int, generator: torch.Generator, dtype=torch.float64, spread: float = 0.5) -> torch.Tensor:
    """``count`` well-conditioned random ``k x k`` matrices (singular values in ``exp([-spread, spread])``)."""
    U = torch.linalg.qr(torch.randn(count, k, k, generator=generator, dtype=dtype))[0]
    V = torch.linalg.qr(torch.randn(count, k, k, generator=generator, dtype=dtype))[0]
    s = torch.exp((torch.rand(count, k, generator=generator, dtype=dtype) * 2 - 1) * spread)
    return U @ torch.diag_embed(s) @ V


def random_transform(
    model: Union[nn.Module, TransformerConfig],
    seed: int = 0,
    groups: Iterable[str] = ("residual", "heads", "qk", "ov", "ff"),
    width: Optional[int] = None,
    fix_ones: bool = False,
    residual: str = "orthogonal",
    dtype: torch.dtype = torch.float64,
) -> Transform:
    """Draw a random element of the model's symmetry group.

    ``groups`` picks which kinds to draw (the rest stay identity); ``width`` > d draws a rectangular
    residual lift; ``fix_ones`` restricts O to O·1 = 1 (keeps a centred residual centred, so the model
    can go back to LayerNorm); ``residual="permutation"`` draws a residual permutation instead.
    """
    spec = spec_for(model)
    g = torch.Generator().manual_seed(seed)
    kinds = set(groups)
    out: dict[str, torch.Tensor] = {}
    for name, grp in spec.groups.items():
        kind = name.split(".")[0]
        if kind not in kinds:
            continue
        if grp.kind == "orthogonal":
            if residual == "permutation":
                out[name] = torch.randperm(grp.size, generator=g)
            else:
                out[name] = random_orthogonal(width or grp.size, grp.size, g, dtype, fix_ones)
        elif grp.kind == "permutation":
            out[name] = torch.randperm(grp.size, generator=g)
        else:
            out[name] = random_invertible(grp.count, grp.size, g, dtype)
    return Transform(out)


def invert_transform(transform: Transform) -> Transform:
    """The inverse element: ``apply_transform(apply_transform(m, T), invert_transform(T))`` computes m's
    function in m's coordinates. A semi-orthogonal residual ``O`` (``d' x d``) inverts to ``Oᵀ`` (the
    projection back to width d, exact on lifted models). Gauges act after their layer's head
    permutation, so the inverse gauges are re-indexed by the inverse permutation."""
    out: dict[str, torch.Tensor] = {}
    for name, el in transform.elements.items():
        kind, _, layer = name.partition(".")
        if kind == "residual":
            out[name] = torch.argsort(el) if is_permutation(el) else el.transpose(0, 1)
        elif is_permutation(el):
            out[name] = torch.argsort(el)
        else:  # gauge: x_new[i] = G[i] x_old[π[i]]  ⇒  x_old[j] = G[σ[j]]⁻¹ x_new[σ[j]], σ = π⁻¹
            perm = transform.elements.get(f"heads.{layer}")
            sigma = torch.argsort(perm) if perm is not None else torch.arange(el.shape[0])
            out[name] = torch.linalg.inv(el[sigma])
    return Transform(out)
