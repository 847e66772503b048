"""LoRA adapters aggregated modulo their gauge.

A LoRA module's update is ``ΔW = s·B·A`` (``A``: r × in, ``B``: out × r, ``s = α/r``, or ``α/√r`` for
rsLoRA), and it is unchanged by every invertible r × r map ``G`` (``A → G A``, ``B → B G⁻¹``): the
invertible level of the symmetry hierarchy, as inside an attention head's QK and OV circuits. Averaging
the factors, as FedAvg on ``get_peft_model_state_dict`` does, averages gauge-dependent coordinates
(``mean(B)·mean(A) ≠ mean(B·A)``). This module averages the products instead, in factored form, and
returns rank-r factors in a canonical gauge (balanced SVD: ``B = U√S``, ``A = √S Vᵀ``, ``A``'s rows
kept at least as large as a fresh adapter's), ordered by singular value, so the first ``k`` components
are the best rank-k approximation (Eckart–Young).

* ``LoraLayout``: which modules are adapted, their keys, shapes and scaling, read from a PEFT model or
  a ``LoraConfig`` plus a keyed adapter state; it reads replies (keyed as ``get_peft_model_state_dict``
  writes them, with or without the adapter name, or FlowerTune's ordered list of arrays) and says what
  is wrong with bad ones (``LoraInputError``).
* ``product_svd``: the thin SVD of ``Σ cᵢ Bᵢ Aᵢ`` from the stacked factors (QRs and the SVD of a small
  core), dense only where that is cheaper.
* ``LoraAggregator``: a federation's aggregation state across rounds, with what truncation drops kept
  for the next round, folded into the base (as FedEx-LoRA does) or dropped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Iterable, Optional, Union

import numpy as np
import torch

from fedlmc.options import one_of

LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
TAILS = ("keep", "fold", "drop")  # what becomes of the SVD tail the rank-r factors cannot carry
GAUGES = ("anchored", "balanced", "even")  # how the product sent is split into rank-r factors
KEEP_FACTOR = 4.0  # tail="keep" holds at most 4 × the rank sent per module (the largest components)


def adapter_state(model: Any, adapter_name: str = "default") -> dict[str, Any]:
    """``get_peft_model_state_dict`` of the adapter, without embedding layers where the installed peft
    can add them (its ``save_embedding_layers``, absent from peft 0.6)."""
    import inspect

    from peft import get_peft_model_state_dict

    extra = {}
    if "save_embedding_layers" in inspect.signature(get_peft_model_state_dict).parameters:
        extra["save_embedding_layers"] = False
    return get_peft_model_state_dict(model, adapter_name=adapter_name, **extra)


class LoraInputError(ValueError):
    """Adapter arrays that cannot be aggregated as declared: the message names what is wrong."""


@dataclass(frozen=True)
class LoraModule:
    """One adapted module: its name (the key prefix before ``.lora_A``), both keys, the declared rank,
    the shapes of ``ΔW`` (out × in), α, rsLoRA, and ``fan_in_fan_out`` (GPT-2's Conv1D stores its base
    weight as in × out, so ``ΔW`` is folded into it transposed)."""

    name: str
    a_key: str
    b_key: str
    rank: int
    in_features: int
    out_features: int
    alpha: float
    rslora: bool = False
    fan_in_fan_out: bool = False

    def scaling(self, rank: Optional[int] = None) -> float:
        """``s`` for an adapter of ``rank`` (default: the declared one), as PEFT computes it."""
        r = self.rank if rank is None else int(rank)
        return self.alpha / (math.sqrt(r) if self.rslora else r)

    @property
    def base_key(self) -> str:
        """Where ``ΔW`` lands in the PEFT model's own ``state_dict`` (the wrapped base layer)."""
        return f"{self.name}.base_layer.weight"


def _pattern(patterns: Mapping[str, Any], name: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first pattern that matches the end of the
    module's name (PEFT matches a regex against the module path)."""
    for pat, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{pat}$", name):
            return value
    return default


def _strip(name: str) -> str:
    """A module's name as ``LoraConfig`` patterns see it (without PEFT's ``base_model.model.`` prefix)."""
    return name.removeprefix("base_model.model.")


@dataclass(frozen=True)
class LoraLayout:
    """The adapter's modules and the order of its keys (as ``get_peft_model_state_dict`` writes them).

    Build it with ``LoraLayout.of(peft_model)`` or ``LoraLayout.of(config=lora_config, arrays=state)``.
    """

    modules: tuple[LoraModule, ...]
    keys: tuple[str, ...]

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def of(
        cls,
        model: Any = None,
        *,
        config: Any = None,
        arrays: Optional[Mapping[str, Any]] = None,
        adapter_name: str = "default",
    ) -> "LoraLayout":
        """The layout of a PEFT model's adapter ``adapter_name``, or of a keyed adapter state ``arrays``
        under ``config`` (a ``peft.LoraConfig`` or its ``to_dict()``)."""
        if model is not None and hasattr(model, "peft_config"):
            config = model.peft_config[adapter_name]
            arrays = adapter_state(model, adapter_name)
        if config is None:
            raise LoraInputError(
                "a LoRA layout needs the adapter's LoraConfig (its α, r and rsLoRA set the scaling): pass "
                "model=<your PeftModel> or lora_config=<its LoraConfig>"
            )
        if arrays is None:
            raise LoraInputError("a LoraConfig alone does not say which modules are adapted: pass the adapter's arrays")
        cfg = config if isinstance(config, Mapping) else config.to_dict()
        peft_type = str(cfg.get("peft_type", "LORA")).rsplit(".", 1)[-1].upper()
        if peft_type != "LORA":
            raise LoraInputError(f"the adapter is {peft_type}, not LoRA: only LoRA adapters are aggregated here")
        if cfg.get("use_dora"):
            raise LoraInputError("DoRA adapters carry a magnitude vector that is not a LoRA factor: not supported")
        keys = list(arrays.keys())
        if keys and all(k.isdigit() for k in keys):
            raise LoraInputError(
                "these arrays carry no keys (FlowerTune's ordered list): the key order comes from the PEFT "
                "model: pass model=<your PeftModel>"
            )
        shapes = {k: tuple(v.shape) for k, v in arrays.items()}
        return cls.from_shapes(shapes, cfg)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]], cfg: Mapping[str, Any]) -> "LoraLayout":
        keys = list(shapes)
        _no_foreign_keys(keys)
        found: dict[str, dict[str, str]] = {}
        for k in keys:
            m = LORA_KEY.match(k)
            found.setdefault(m["module"], {})[m["factor"]] = k
        modules = []
        for name, pair in found.items():
            if set(pair) != {"A", "B"}:
                missing = ({"A", "B"} - set(pair)).pop()
                raise LoraInputError(f"module {name} has no lora_{missing} factor")
            a, b = shapes[pair["A"]], shapes[pair["B"]]
            if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
                raise LoraInputError(f"module {name}: lora_A {a} and lora_B {b} are not r × in and out × r factors")
            plain = _strip(name)
            rank = int(_pattern(cfg.get("rank_pattern"), plain, cfg.get("r", a[0])))
            alpha = float(_pattern(cfg.get("alpha_pattern"), plain, cfg.get("lora_alpha", rank)))
            modules.append(
                LoraModule(
                    name,
                    pair["A"],
                    pair["B"],
                    rank,
                    a[1],
                    b[0],
                    alpha,
                    bool(cfg.get("use_rslora", False)),
                    bool(cfg.get("fan_in_fan_out", False)),
                )
            )
        if not modules:
            raise LoraInputError("no LoRA factors found (keys like '<module>.lora_A.weight')")
        return cls(tuple(modules), tuple(keys))

    # ---- reading and writing ----------------------------------------------------------------------
    def read(
        self, arrays: Mapping[str, Any], *, mixed_ranks: bool = False
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{module: (B, A)}`` from an adapter state: keyed as this layout's keys, the same keys
        without or with another adapter name, or keyless (``"0"``, ``"1"``... in this layout's order).
        Raises ``LoraInputError`` naming what is wrong; a rank other than the declared one is accepted
        only with ``mixed_ranks``."""
        keyed = self._keyed(arrays)
        out = {}
        for mod in self.modules:
            a, b = working(keyed[mod.a_key]), working(keyed[mod.b_key])
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise LoraInputError(
                    f"module {mod.name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not share a rank"
                )
            if a.shape[1] != mod.in_features or b.shape[0] != mod.out_features:
                raise LoraInputError(
                    f"module {mod.name}: ΔW would be {b.shape[0]} × {a.shape[1]}, the adapter's is "
                    f"{mod.out_features} × {mod.in_features}"
                )
            if a.shape[0] != mod.rank and not mixed_ranks:
                raise LoraInputError(
                    f"module {mod.name} has rank {a.shape[0]} (lora_A is {tuple(a.shape)}) but the declared "
                    f"LoraConfig says r={mod.rank}: for clients of different ranks pass mixed_ranks=True"
                )
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise LoraInputError(f"module {mod.name}: the factors hold NaN or infinite values")
            out[mod.name] = (b, a)
        return out

    def _keyed(self, arrays: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        keys = list(arrays.keys())
        if keys and all(k.isdigit() for k in keys):  # FlowerTune: the adapter's arrays in key order
            if len(keys) != len(self.keys):
                raise LoraInputError(
                    f"got {len(keys)} keyless arrays; the PEFT model's adapter has {len(self.keys)} "
                    f"({len(self.modules)} modules × lora_A, lora_B)"
                )
            return {k: _tensor(arrays[str(i)]) for i, k in enumerate(self.keys)}
        _no_foreign_keys(keys)
        canon = {self.canonical_key(k): k for k in keys}
        want, got = set(self.keys), set(canon)
        if want != got:
            mods = lambda ks: sorted({LORA_KEY.match(k)["module"] for k in ks})  # noqa: E731
            missing, extra = mods(want - got), mods(got - want)
            raise LoraInputError(
                "the adapter's target modules differ from the declared ones: "
                + "; ".join(
                    s
                    for s in (
                        f"missing {missing[:4]}{' …' if len(missing) > 4 else ''}" if missing else "",
                        f"not declared {extra[:4]}{' …' if len(extra) > 4 else ''}" if extra else "",
                    )
                    if s
                )
            )
        return {k: _tensor(arrays[canon[k]]) for k in self.keys}

    def canonical_key(self, key: str) -> str:
        """``key`` under this layout's naming (with or without the adapter name)."""
        m = LORA_KEY.match(key)
        named = self.keys and LORA_KEY.match(self.keys[0])["adapter"]
        adapter = f".{named}" if named else ""
        return f"{m['module']}.lora_{m['factor']}{adapter}.weight"

    def write(
        self, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]], keyless: bool = False, dtype=torch.float32
    ):
        """An adapter state ``{key: tensor}`` in this layout's key order (``"0"``, ``"1"``... when
        ``keyless``) from ``{module: (B, A)}``."""
        out = {}
        for mod in self.modules:
            b, a = factors[mod.name]
            out[mod.a_key], out[mod.b_key] = a.to(dtype).contiguous(), b.to(dtype).contiguous()
        ordered = {k: out[k] for k in self.keys}
        return {str(i): v for i, v in enumerate(ordered.values())} if keyless else ordered

    def with_ranks(self, rank: int) -> "LoraLayout":
        """The same modules declared at ``rank``."""
        return replace(self, modules=tuple(replace(m, rank=int(rank)) for m in self.modules))

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)


def working(t: torch.Tensor) -> torch.Tensor:
    """The precision a factor is aggregated in: float64 stays float64 (the exactness tests), every
    other floating type (float32 replies from the wire, half precision) becomes float32. Always a copy:
    the caller's tensors (a live model's parameters) are never aliased."""
    return t.detach().to(torch.float64 if t.dtype == torch.float64 else torch.float32, copy=True)


def _tensor(v) -> torch.Tensor:
    """A torch tensor from a tensor, a NumPy array or a Flower ``Array``."""
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, np.ndarray):
        return torch.from_numpy(v)
    return torch.from_numpy(np.asarray(v.numpy()))  # flwr.app.Array


def _no_foreign_keys(keys: Sequence[str]) -> None:
    bad = [k for k in keys if not LORA_KEY.match(k)]
    if bad:
        raise LoraInputError(
            f"{len(bad)} array(s) are not LoRA factors, e.g. {bad[:3]}: a PEFT LoRA reply holds only "
            "'<module>.lora_A.weight' and '<module>.lora_B.weight' (send get_peft_model_state_dict(model); "
            "modules_to_save, biases and embeddings would be averaged silently, so they are refused)"
        )


# ---- the factored product ---------------------------------------------------------------------------


def dense_is_cheaper(out_features: int, in_features: int, stacked_rank: int) -> bool:
    """Whether forming the dense ``out × in`` sum is cheaper than the factored path: when the stacked
    rank ``Σrᵢ`` reaches ``min(out, in)``, the QRs no longer shrink anything."""
    return stacked_rank >= min(out_features, in_features)


def stacked(
    factors: Sequence[tuple[torch.Tensor, torch.Tensor]], coefficients: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[√|cᵢ| Bᵢ]`` (out × Σrᵢ) and ``[sign(cᵢ)√|cᵢ| Aᵢ]`` (Σrᵢ × in), whose product is ``Σ cᵢ Bᵢ Aᵢ``;
    in float64 if any factor is float64, else in float32."""
    dtype = torch.float64 if any(t.dtype == torch.float64 for f in factors for t in f) else torch.float32
    bs, as_ = [], []
    for (b, a), c in zip(factors, coefficients):
        if a.shape[0] == 0 or c == 0:
            continue
        root = math.sqrt(abs(c))
        bs.append(b.to(dtype) * root)
        as_.append(a.to(dtype) * (root if c > 0 else -root))
    out_f, in_f = factors[0][0].shape[0], factors[0][1].shape[1]
    if not bs:
        return torch.zeros(out_f, 0, dtype=dtype), torch.zeros(0, in_f, dtype=dtype)
    return torch.cat(bs, 1), torch.cat(as_, 0)


def stacks_svd(
    stacks: Sequence[tuple[torch.Tensor, torch.Tensor]], dense: Optional[bool] = None
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``product_svd`` of several stacks ``(B, A)`` of one shape ``out × in``, in one batched call per
    step (the stacks zero-padded to one rank: zero components add nothing and are cut)."""
    out_f, in_f = stacks[0][0].shape[0], stacks[0][1].shape[1]
    dtype = stacks[0][0].dtype
    rank = max(b.shape[1] for b, _ in stacks)
    if rank == 0:
        z = torch.zeros(0, dtype=dtype)
        return [(torch.zeros(out_f, 0, dtype=dtype), z, torch.zeros(0, in_f, dtype=dtype)) for _ in stacks]
    B = torch.zeros(len(stacks), out_f, rank, dtype=dtype)
    A = torch.zeros(len(stacks), rank, in_f, dtype=dtype)
    for i, (b, a) in enumerate(stacks):
        B[i, :, : b.shape[1]], A[i, : a.shape[0]] = b, a
    if dense_is_cheaper(out_f, in_f, rank) if dense is None else dense:
        U, S, Vh = torch.linalg.svd(B @ A, full_matrices=False)
    else:
        qb, rb = torch.linalg.qr(B)
        qa, ra = torch.linalg.qr(A.mT)
        u, S, vh = torch.linalg.svd(rb @ ra.mT)
        U, Vh = qb @ u, vh @ qa.mT
    # one sign per component (the largest entry of each left singular vector positive): with distinct
    # singular values the factors are then a function of the product alone
    sign = torch.sign(U.gather(1, U.abs().argmax(1, keepdim=True)))
    sign[sign == 0] = 1
    U, Vh = U * sign, Vh * sign.mT
    tol = torch.finfo(dtype).eps * 10 * max(out_f, in_f, rank)
    out = []
    for i in range(len(stacks)):
        keep = S[i] > S[i, 0] * tol if S[i, 0] > 0 else torch.zeros_like(S[i], dtype=torch.bool)
        k = int(keep.sum())  # singular values are sorted: the kept ones come first
        out.append((U[i, :, :k], S[i, :k], Vh[i, :k]))
    return out


def product_svd(
    factors: Sequence[tuple[torch.Tensor, torch.Tensor]], coefficients: Sequence[float], dense: Optional[bool] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD ``U, S, Vh`` of ``Σ cᵢ Bᵢ Aᵢ`` (``Bᵢ``: out × rᵢ, ``Aᵢ``: rᵢ × in, any real ``cᵢ``).

    Factored: stack ``[√|cᵢ| Bᵢ]`` and ``[sign(cᵢ)√|cᵢ| Aᵢ]``, take both QRs and the SVD of the small
    core ``R_B R_Aᵀ`` (Σrᵢ × Σrᵢ): ``O((out + in)(Σrᵢ)²)``, never an out × in matrix. Dense (the sum
    formed, then its SVD) where ``dense_is_cheaper`` (``dense=True`` forces it). Singular values below
    the working precision's noise of the largest are cut, so the returned rank is the product's
    numerical rank. Computed in float64 if any factor is float64, else in float32."""
    return stacks_svd([stacked(factors, coefficients)], dense)[0]


A_ROW_NORM = 1 / math.sqrt(3)  # the row norm of PEFT's initial A (kaiming-uniform, a = √5)


def balanced(
    U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor, rank: int, scaling: float, floor: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors ``(B, A)`` with ``scaling·B·A`` the best rank-``rank`` approximation of
    ``U diag(S) Vh``, in the balanced gauge: component k has ``B = U cₖ⁻¹ Sₖ/s`` and ``A = cₖ Vhₖ``
    with ``cₖ = max(√(Sₖ/s), A_ROW_NORM)``, so ``B = U√(S/s)``, ``A = √(S/s)Vh`` wherever the
    component is larger than a fresh adapter's, and ``A``'s rows are never smaller than PEFT's initial
    ones: a small product split evenly would make both factors tiny and stall the clients' training
    (LoRA learns from ``A = O(1)``, ``B = 0``). A function of the product alone either way. Where the
    product's rank is lower, the spare components get ``B = 0`` and rows of ``A`` orthogonal to
    ``Vh`` at that initial norm (fixed seed), as a fresh adapter has: zero rows in both factors would
    get no gradient. ``floor=False``: the plain even split ``√(S/s)``."""
    k = min(rank, len(S))
    c = torch.sqrt(S[:k] / scaling)
    if floor:
        c = c.clamp(min=A_ROW_NORM)
    in_f = Vh.shape[1]
    B = torch.zeros(U.shape[0], rank, dtype=U.dtype)
    A = torch.zeros(rank, in_f, dtype=U.dtype)
    B[:, :k], A[:k] = U[:, :k] * (S[:k] / scaling / c), c[:, None] * Vh[:k]
    spare = fresh_rows(Vh[:k], min(rank, in_f) - k)
    A[k : k + spare.shape[0]] = spare
    return B, A


def fresh_rows(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` rows of a fresh adapter's norm (``A_ROW_NORM``), orthonormal to each other and to
    ``rows`` (a fixed seed): where a component is missing, ``A`` gets what a new adapter would have
    (zero rows in both factors would get no gradient)."""
    in_f = rows.shape[1]
    count = max(0, min(count, in_f - rows.shape[0]))
    if count == 0:
        return torch.zeros(0, in_f, dtype=rows.dtype)
    g = torch.Generator().manual_seed(0)
    basis = torch.cat([rows.T, torch.randn(in_f, count, generator=g, dtype=torch.float64).to(rows.dtype)], 1)
    q = torch.linalg.qr(basis)[0][:, rows.shape[0] :]  # orthonormal, orthogonal to ``rows``
    return q.T * A_ROW_NORM


def least_squares_b(p: "Product", a: torch.Tensor, scaling: float) -> torch.Tensor:
    """``B = argmin ‖s·B·A − U diag(S) Vh‖`` for the given ``A`` (r × in): ``U S (Vh Aᵀ) (A Aᵀ)⁺ / s``,
    never an out × in matrix."""
    a = a.to(p.Vh.dtype)
    return (p.U * p.S) @ (p.Vh @ a.T) @ torch.linalg.pinv(a @ a.T) / scaling


def nbytes(tensors) -> int:
    """float32 bytes of a collection of tensors (what a message carries)."""
    return sum(4 * t.numel() for t in tensors)


@dataclass
class Product:
    """``U diag(S) Vh``: a module's adapter product held in factored form."""

    U: torch.Tensor
    S: torch.Tensor
    Vh: torch.Tensor

    def dense(self) -> torch.Tensor:
        return (self.U * self.S) @ self.Vh

    @property
    def nbytes(self) -> int:
        return nbytes((self.U, self.S, self.Vh))


class LoraAggregator:
    """A LoRA federation's aggregate, round after round, modulo the adapter's gauge.

    Each round the new product is the weighted mean of the clients' ``sᵢ Bᵢ Aᵢ`` (weights normalised).
    What the rank-r factors sent back cannot carry (the tail of the SVD) is, by ``tail``:

    * ``"keep"``: held at the server, in factored form, and carried into the next round's product
      (error feedback), each client's update counting from the truncation it was sent. No extra bytes
      on the wire; the server holds at most ``keep_factor × r`` singular components per module, the
      largest (``(out + in)·keep_factor·r`` floats). With ``keep_factor=math.inf`` nothing is cut and
      the federation follows FedAvg on the products exactly (the rank then grows by up to
      ``(M − 1)·r`` a round, to ``min(out, in)``: dense-sized).
    * ``"fold"``: folded into the base weights, as FedEx-LoRA does: exact every round, and every
      message carries the accumulated dense ``out × in`` base update (``base_update``) for the clients
      to add to their frozen base, so stateless clients stay in step.
    * ``"drop"``: discarded, as FlexLoRA does.

    The product sent is split into factors by ``gauge``:

    * ``"anchored"``: ``A`` is the clients' weighted mean ``A`` (FedIT's, zero-padded across ranks), and
      ``B`` the least-squares fit ``argmin ‖s·B·A − P‖``, so the clients go on from the gauge they
      trained in, with a product at least as close to the mean as FedIT's ``mean(B)·mean(A)``; what
      ``A``'s row space cannot carry is the tail.
    * ``"balanced"``: the rank-r SVD truncation, split ``B = U√(S/s)``, ``A = √(S/s)Vh`` with ``A``'s rows
      no smaller than a fresh adapter's (``balanced``).
    * ``"even"``: the same split with no floor on ``A``'s rows.

    Parameters
    ----------
    layout : LoraLayout
        The adapter's modules, keys and scaling (``LoraLayout.of``).
    tail : {"keep", "fold", "drop"}, default "keep"
        What truncation drops.
    keep_factor : float, default 4.0
        ``"keep"``: the most singular components held per module, as a multiple of its declared rank
        (``math.inf``: all, exact).
    gauge : {"anchored", "balanced", "even"}, default "balanced"
        How the product sent is split into factors.
    """

    def __init__(
        self, layout: LoraLayout, tail: str = "keep", keep_factor: float = KEEP_FACTOR, gauge: str = "balanced"
    ) -> None:
        self.layout = layout
        self.tail = one_of(tail, TAILS, "tail")
        self.gauge = one_of(gauge, GAUGES, "gauge")
        if not keep_factor >= 1:
            raise ValueError(f"keep_factor must be at least 1 (the rank sent), got {keep_factor}")
        self.keep_factor = keep_factor
        self.products: dict[str, Product] = {}  # the global product per module (what "keep" carries)
        self.base: dict[str, torch.Tensor] = {}  # "fold": the accumulated dense base update per module
        self.anchors: dict[str, torch.Tensor] = {}  # "anchored": the clients' mean A per module
        self.sent: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # the factors sent, per rank

    def start(self, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Take the initial adapter (``{module: (B, A)}`` at the declared rank) as round 0's product."""
        self.sent.clear()
        for mod in self.layout.modules:
            b, a = factors[mod.name]
            self.products[mod.name] = Product(*product_svd([(b, a)], [mod.scaling(a.shape[0])]))
            self.anchors[mod.name] = a.double()
            self.sent[(mod.name, a.shape[0])] = (b.double(), a.double())

    def factors(
        self, ranks: Union[int, Mapping[str, int], None] = None
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{module: (B, A)}``: the factors of the global product at ``ranks`` (one rank, or one per
        module; default: the declared ranks), scaled for that rank, in this aggregator's ``gauge``."""
        out = {}
        for mod in self.layout.modules:
            r = mod.rank if ranks is None else int(ranks if isinstance(ranks, int) else ranks[mod.name])
            out[mod.name] = self._factors(mod, r)
        return out

    def _factors(self, mod: LoraModule, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (mod.name, rank)
        if key not in self.sent:  # once per product and rank: what was sent is what the next round counts from
            p, s = self.products[mod.name], mod.scaling(rank)
            if self.gauge == "anchored":
                b, a = self._anchored(mod, p, rank)
            else:
                b, a = balanced(p.U, p.S, p.Vh, rank, s, floor=self.gauge == "balanced")
            self.sent[key] = (b, a)
        return self.sent[key]

    def _anchored(self, mod: LoraModule, p: Product, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``gauge="anchored"``: the clients' mean ``A`` (fresh rows where it has fewer than ``rank``) and
        the least-squares ``B`` for product ``p``."""
        anchor = self.anchors[mod.name][:rank].to(p.Vh.dtype)
        a = torch.cat([anchor, fresh_rows(anchor, rank - anchor.shape[0])])
        return least_squares_b(p, a, mod.scaling(rank)), a

    def base_update(self) -> dict[str, torch.Tensor]:
        """``"fold"``: ``{base weight key: dense update}``, transposed for ``fan_in_fan_out`` modules."""
        out = {}
        for mod in self.layout.modules:
            if mod.name in self.base:
                d = self.base[mod.name]
                out[mod.base_key] = (d.T if mod.fan_in_fan_out else d).float().contiguous()
        return out

    def aggregate(
        self, replies: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor]]], weights: Sequence[float]
    ) -> None:
        """Fold one round's replies (``{module: (B, A)}`` each, any ranks) into the global product."""
        if not replies:
            return
        total = float(sum(weights))
        w = [float(x) / total for x in weights]
        stacks = {}
        for mod in self.layout.modules:
            stack = [r[mod.name] for r in replies]
            coeffs = [wi * mod.scaling(a.shape[0]) for wi, (_, a) in zip(w, stack)]
            if self.tail == "keep" and mod.name in self.products and self.gauge == "anchored":
                # P + Σ wᵢ (sᵢBᵢAᵢ − what client i was sent): the sent factors are not P's truncation
                share: dict[int, float] = {}  # the replies' weight per rank sent
                for wi, (_, a) in zip(w, stack):
                    share[a.shape[0]] = share.get(a.shape[0], 0.0) + wi
                p = self.products[mod.name]
                stack, coeffs = stack + [(p.U * p.S, p.Vh)], coeffs + [1.0]
                for r, wr in share.items():
                    stack.append(self._factors(mod, r))
                    coeffs.append(-wr * mod.scaling(r))
            elif self.tail == "keep" and mod.name in self.products:
                # P + Σ wᵢ (sᵢBᵢAᵢ − T_{rᵢ}(P)): each client's update counts from the truncation it
                # started from, and P − Σ wᵢ T_{rᵢ}(P) lives in P's own singular basis
                p = self.products[mod.name]
                ranks = torch.tensor([a.shape[0] for _, a in stack])
                within = (torch.arange(len(p.S))[:, None] < ranks[None, :]).to(p.S.dtype)
                carried = p.S * (1.0 - within @ torch.tensor(w, dtype=p.S.dtype))
                live = carried != 0  # the components every client was sent are replaced, not carried
                stack = stack + [(p.U[:, live] * carried[live], p.Vh[live])]
                coeffs = coeffs + [1.0]
            stacks[mod.name] = stacked(stack, coeffs)
        self.sent.clear()
        for mod in self.layout.modules:  # the next anchor: FedIT's mean A, zero-padded across ranks
            a_s = [r[mod.name][1] for r in replies]
            anchor = torch.zeros(max(a.shape[0] for a in a_s), a_s[0].shape[1], dtype=torch.float64)
            for wi, a in zip(w, a_s):
                anchor[: a.shape[0]] += wi * a.double()
            self.anchors[mod.name] = anchor
        shapes: dict[tuple, list[LoraModule]] = {}
        for mod in self.layout.modules:  # modules of one shape: one batched QR / SVD
            shapes.setdefault((mod.out_features, mod.in_features, stacks[mod.name][0].dtype), []).append(mod)
        for group in shapes.values():
            for mod, (U, S, Vh) in zip(group, stacks_svd([stacks[m.name] for m in group])):
                self._update(mod, U, S, Vh)

    def _update(self, mod: LoraModule, U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor) -> None:
        if self.tail == "keep" and math.isfinite(self.keep_factor):
            k = int(self.keep_factor * mod.rank)
            U, S, Vh = U[:, :k], S[:k], Vh[:k]
        r = mod.rank
        if self.tail != "keep" and self.gauge == "anchored":  # the fit to the new anchor is what is sent
            full = Product(U, S, Vh)
            b, a = self.sent[(mod.name, r)] = self._anchored(mod, full, r)
            if self.tail == "fold":
                self.base[mod.name] = self.base.get(mod.name, 0) + full.dense() - mod.scaling() * b @ a
            self.products[mod.name] = Product(*product_svd([(b, a)], [mod.scaling()]))
            return
        if self.tail == "fold" and len(S) > r:
            self.base[mod.name] = self.base.get(mod.name, 0) + (U[:, r:] * S[r:]) @ Vh[r:]
        if self.tail != "keep":  # the server holds the adapter it sends, nothing more
            U, S, Vh = U[:, :r], S[:r], Vh[:r]
        self.products[mod.name] = Product(U.contiguous(), S.contiguous(), Vh.contiguous())

    @property
    def state_bytes(self) -> int:
        """What the server holds between rounds, in float32 bytes."""
        return sum(p.nbytes for p in self.products.values()) + nbytes(self.base.values())


# ---- the client's side --------------------------------------------------------------------------


def fit_rank(b: torch.Tensor, a: torch.Tensor, rank: int, scaling_from: float, scaling_to: float):
    """Factors sent at another rank, for an adapter of ``rank``: the first ``rank`` components (the
    best approximation, the factors being ordered) rescaled from ``scaling_from`` to ``scaling_to``,
    zero-padded (``B``) when ``rank`` is larger."""
    k = min(rank, a.shape[0])
    c = math.sqrt(scaling_from / scaling_to)
    B = torch.zeros(b.shape[0], rank, dtype=b.dtype)
    A = torch.zeros(rank, a.shape[1], dtype=a.dtype)
    B[:, :k], A[:k] = b[:, :k] * c, a[:k] * c
    return B, A


def set_adapter(model, arrays: Mapping[str, Any], adapter_name: str = "default") -> None:
    """Load an aggregate into a client's PEFT ``model``: keyed or keyless arrays, at the model's own
    rank (an aggregate sent at a larger rank is cut to this one's best approximation, rescaled)."""
    from peft import set_peft_model_state_dict

    layout = LoraLayout.of(model, adapter_name=adapter_name)
    keyed = layout._keyed(arrays)
    state = {}
    for mod in layout.modules:
        a, b = keyed[mod.a_key], keyed[mod.b_key]
        if a.shape[0] != mod.rank:
            b, a = fit_rank(b.double(), a.double(), mod.rank, mod.scaling(a.shape[0]), mod.scaling())
        state[mod.a_key], state[mod.b_key] = a.float(), b.float()
    result = set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unexpected:
        raise LoraInputError(f"PEFT did not take {unexpected[:3]}")


def apply_base_update(model, arrays: Mapping[str, Any]) -> None:
    """``tail="fold"``: add the server's accumulated base update (``{base weight key: tensor}``,
    the message's ``"base-update"`` ArrayRecord) to a freshly built PEFT ``model``'s frozen base."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in arrays.keys():
            own = base_weight_key(params, key)
            if own is None:
                raise LoraInputError(f"base update for {key!r}, which this model does not have")
            params[own].add_(_tensor(arrays[key]).to(params[own].dtype))


def base_weight_key(keys: Iterable[str], key: str) -> Optional[str]:
    """``key`` (a wrapped base layer's weight, ``<module>.base_layer.weight`` as peft 0.7 and later name
    it) among a PEFT model's ``keys``, or its peft 0.6 name (``<module>.weight``); None if neither."""
    keys = set(keys)
    for candidate in (key, key.replace(".base_layer.weight", ".weight")):
        if candidate in keys:
            return candidate
    return None
