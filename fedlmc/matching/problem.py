"""Weight matching's problem: both models' canonical weights, the tensors no permutation touches as
fixed cross-covariances (``Fixed``, built once per A), and the objective and its products at any group
element (``Problem``), in the precision the hardware affords (``Matching.precision``)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from fedlmc.matching.certify import ROTATE_FIRST, certify, certify_heads, circuit_gram, gram_row_max, rotation_size
from fedlmc.matching.profile import section
from fedlmc.matching.solvers import Elements, Int8Blocks, Int8Rows, delta_crosses, int8_scores, score_dtype
from fedlmc.matching.steps import (
    CIRCUITS,
    anchors,
    apply_elements,
    as_rows,
    cached_side,
    circuit_norms,
    ff_step,
    head_side,
    heads_step,
    unit_features,
)
from fedlmc.options import PRECISIONS
from fedlmc.symmetry import StateDict, canonical, spec_for
from fedlmc.symmetry.transform import apply_along


def canonical_state(model: nn.Module, device: torch.device, dtype: torch.dtype) -> StateDict:
    """The canonical form's weights, detached, on ``device`` in ``dtype``."""
    with section("canonicalisation"):
        c = canonical(model)
    with section("copies and dtype conversions"):
        return {k: v.detach().to(device=device, dtype=dtype) for k, v in c.state_dict().items()}


@dataclass
class Cross:
    """The moving tensors' part of the objective as a function of the residual map, for fixed unit
    elements U: ``value(O) = constant + 2⟨G, I − O⟩`` (from ``‖A − U(B)Oᵀ‖² = ‖A − U(B)‖² + 2⟨AᵀU(B),
    I − O⟩`` per residual-indexed block, O orthogonal), and ``M = Σ_blocks (1/rows) AᵀU(B)``, the next
    residual step's matrix. ``constant``, the value at O = I, comes from the distances themselves, so
    the products' rounding enters only through how the value moves with O: near the identity (a reply
    trained from the model it is aligned to, where ``Matching.min_gain`` compares gains of a few
    percent) the value is as exact as the distances, whatever the fast dtype of the products."""

    constant: float
    G: torch.Tensor
    M: torch.Tensor
    delta: bool = False  # its products in the difference form (``Fixed.delta``)

    def value(self, O: Optional[torch.Tensor]) -> float:
        return self.constant + (2 * float((self.G * _from_identity(O)).sum()) if O is not None else 0.0)

    def __add__(self, other: "Cross") -> "Cross":
        return Cross(self.constant + other.constant, self.G + other.G, self.M + other.M)


def _cross(F: "Fixed", part: str, A: StateDict, B: StateDict, axis: dict, B_fast: Optional[dict]) -> Cross:
    """``Cross`` of A's and B's tensors (``axis``: each one's residual axis; tensors without one enter
    the constant only). ``constant`` from the distances; the products of A's fast-dtype copies with B's
    (``B_fast`` where B's tensor is that problem's own, else converted), or, with ``F.delta`` and every
    tensor of ``F.delta_keys(part)`` near A's (``NEAR``), ``AᵀA + Aᵀ(B − A)`` for those (A's Gram
    matrices summed once, ``Fixed.gram_sums``; the differences' products in int8) and exact products
    for the others (a few rows each)."""
    dist = {k: float(sq_dist(A[k], B[k])) for k in A}
    nA = F.a_norms
    delta_keys = F.delta_keys(part) if F.delta else []
    delta = bool(delta_keys) and all(dist[k] <= NEAR * float(nA[k]) for k in delta_keys)
    G, M = (t.clone() for t in F.gram_sums(part)) if delta else (None, None)
    constant = 0.0
    for k in A:
        constant += dist[k] / float(nA[k])  # the value at O = I (see ``Cross``)
        if k not in axis:  # no residual axis (biases of units): O does not act on it
            continue
        if delta and k in delta_keys:
            C = F.codes(k).delta_cross(as_rows(A[k], axis[k]), as_rows(B[k], axis[k])).to(F.dtype)
        elif delta:  # a few rows (biases): exact, at no cost
            C = as_rows(A[k], axis[k]).T @ as_rows(B[k], axis[k])
        else:
            fast = B_fast[k] if B_fast is not None and B[k] is B_fast.src[k] else B[k].to(F.fast)
            C = (F.fast_rows(k).T @ as_rows(fast, axis[k])).to(F.dtype)  # embeddings, output heads: 50k rows
        if G is None:
            G, M = torch.zeros_like(C), torch.zeros_like(C)
        G += C / nA[k]
        M += C / _rows(A[k], axis[k])
    if G is None:  # no tensor with a residual axis: O does not move the value
        d, dev = F.cfg.d_model, next(iter(F.A.values())).device
        G, M = torch.zeros(d, d, dtype=F.dtype, device=dev), torch.zeros(d, d, dtype=F.dtype, device=dev)
    return Cross(constant, G, M, delta)


def _rows(t: torch.Tensor, axis: int) -> int:
    """How many rows ``as_rows(t, axis)`` has (the divisor of a tensor's part of ``Cross.M``)."""
    return t.numel() // t.shape[axis]


class _Cast(dict):
    """``src``'s tensors in ``dtype``, each converted when first read."""

    def __init__(self, src: StateDict, dtype: torch.dtype) -> None:
        super().__init__()
        self.src, self.dtype = src, dtype

    def __missing__(self, k: str) -> torch.Tensor:
        v = self[k] = self.src[k].to(self.dtype)
        return v


def _from_identity(O: torch.Tensor) -> torch.Tensor:
    """``I − O``, formed exactly (near the identity, ``tr G − ⟨G, O⟩`` would subtract two nearly equal sums)."""
    return torch.eye(O.shape[0], dtype=O.dtype, device=O.device) - O


# a tensor of B within this relative squared distance of A's (10 % of its norm) is "near": its
# cross-covariance may be taken as ``AᵀA + Aᵀ(B − A)`` (``Fixed.delta``)
NEAR = 0.01
DELTA_ROWS = 64  # tensors with fewer rows (biases) keep the direct product
SMALL_TURN = 0.1  # ‖O − I‖_F up to which an exact rotation takes its correction from the fast copy


class Fixed:
    """What a matching computes from model A alone (A stays fixed while B is aligned to it): the moving
    and anchor tensors, their norms and fast-dtype copies, A's FF features, head circuit norms and head
    factors. Built once per A: a universe iteration aligns every model to the same A (``weight_matching``'s
    ``reuse``), which saved ~0.35 s of each gpt2-small-sized problem's 0.6 s set-up.

    ``delta``: the cross-covariances of a B near A are ``AᵀA + Aᵀ(B − A)``, A's Gram matrices summed
    once per A and the difference's product in int8 (``solvers.Int8Blocks``: half a bfloat16 product's
    time, and its rounding relative to the small difference). Default (None): where
    ``solvers.delta_crosses`` allows it under ``precision="auto"`` and A is ``shared`` by many problems
    (a universe iteration: the Grams cost one direct product, once)."""

    def __init__(
        self, A: StateDict, cfg, precision: str = "auto", shared: bool = False, delta: Optional[bool] = None
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.A, self.cfg, self.precision = A, cfg, precision
        self.spec = spec_for(cfg)
        # in spec order (not a set's): sums over tensors, and so the residual map's arbitrary sign on a
        # direction every tensor leaves null (the all-ones one of a LayerNorm model), do not depend on names
        self.moved = list(
            dict.fromkeys(m.param for g in self.spec.groups.values() if g.name != "residual" for m in g.members)
        )
        self.A_mov = {k: A[k] for k in self.moved}
        self.anchor_members = anchors(self.spec)
        self.moving_members = [m for m in self.spec.residual.members if m.param in self.A_mov]
        ff = self.spec.layer_groups("ff")
        ref = next(iter(A.values()))
        self.dtype = ref.dtype
        size = max((g.size for g in ff), default=0)
        self.fast = {
            "auto": score_dtype(ref.dtype, ref.device, size),
            "exact": ref.dtype,
            "bfloat16": torch.bfloat16,
            "int8": ref.dtype,
        }[precision]
        # the FF similarity scores as int8 products (``solvers.Int8Rows``; on the CPU only)
        self.int8 = ref.device.type == "cpu" and (
            precision == "int8" or (precision == "auto" and int8_scores(ref.dtype, ref.device, size))
        )
        self._a_int8: dict[str, Int8Rows] = {}
        self.anchor_axis = {m.param: m.axis for m in self.anchor_members}
        # the moving tensors' and anchors' squared norms (each tensor's weight in the objective)
        self.a_norms = {k: sq_norm(A[k]).clamp_min(1e-30) for k in [*self.A_mov, *self.anchor_axis]}
        self.head_norms = {g.name: circuit_norms(A, self.spec, g.name) for g in self.spec.layer_groups("heads")}
        self.ff_params = {m.param for g in ff for m in g.members}
        self.gauge_params = {
            g.name: {m.param for m in g.members} for g in self.spec.groups.values() if g.kind == "gauge"
        }
        self.axis = {m.param: m.axis for m in self.moving_members}
        # the moving tensors with a residual axis and the anchors, as rows, in the fast dtype: converted
        # when a direct product first reads them (a universe of near replies takes the difference form)
        self._fast_rows = _Cast({k: self.rows(k) for k in [*self.axis, *self.anchor_axis]}, self.fast)
        self.A_features = {g.name: unit_features(A, g).to(self.fast) for g in ff}
        self.A_sides: dict = {}  # A's head factors, filled by the head and gauge steps (steps.cached_side)
        anchored = {m.param for m in self.anchor_members}
        self.untouched = {
            k: sq_norm(v).clamp_min(1e-30) for k, v in A.items() if k not in self.A_mov and k not in anchored
        }
        # the groups (other than the residual) whose elements act on each part of the moving tensors
        self.part_groups = {
            part: sorted(
                g.name
                for g in self.spec.groups.values()
                if g.name != "residual"
                and g.kind != "scale"  # the FF scales are solved after the descent (``ff_scale_step``)
                and any((m.param in self.ff_params) == (part == "ff") for m in g.members)
            )
            for part in ("ff", "rest")
        }
        self._gram_max: dict[str, torch.Tensor] = {}
        self._circuit_gram: dict[str, torch.Tensor] = {}
        if delta is None:
            delta = shared and precision == "auto" and delta_crosses(ref.dtype, ref.device, size)
        self.delta = delta
        self._codes: dict[str, Int8Blocks] = {}
        self._gram_sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def delta_keys(self, part: str) -> list[str]:
        """The tensors of ``part`` ("ff", "rest" or "anchor") whose cross-covariance may be taken in the
        difference form (``delta``): those with a residual axis and at least ``DELTA_ROWS`` rows."""
        if part == "anchor":
            keys = list(self.anchor_axis)
        else:
            keys = [k for k in self.A_mov if k in self.axis and (k in self.ff_params) == (part == "ff")]
        return [k for k in keys if self.A[k].numel() >= DELTA_ROWS * self.cfg.d_model]

    def rows(self, k: str) -> torch.Tensor:
        """A's tensor ``k`` as rows (one per vector along its residual axis)."""
        return as_rows(self.A[k], self.axis[k] if k in self.axis else self.anchor_axis[k])

    def fast_rows(self, k: str) -> torch.Tensor:
        """``rows(k)`` in the fast dtype (converted once, when first read)."""
        return self._fast_rows[k]

    def codes(self, k: str) -> Int8Blocks:
        """A's tensor ``k`` as int8 blocks (coded once per A)."""
        if k not in self._codes:
            with section("anchor cross-covariances" if k in self.anchor_axis else "residual cross-covariances"):
                self._codes[k] = Int8Blocks(self.rows(k))
        return self._codes[k]

    def gram_sums(self, part: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``Σ AᵀA / ‖A‖²`` and ``Σ AᵀA / rows`` over ``delta_keys(part)`` (computed once per A, from the
        fast-dtype copies: their rounding is symmetric, so it does not turn the residual map)."""
        if part not in self._gram_sums:
            with section("anchor cross-covariances" if part == "anchor" else "residual cross-covariances"):
                d = self.cfg.d_model
                ref = next(iter(self.A.values()))
                G = torch.zeros(d, d, dtype=self.dtype, device=ref.device)
                M = torch.zeros_like(G)
                for k in self.delta_keys(part):
                    # converted here and let go (not ``fast_rows``, which keeps its copies): a universe of
                    # near replies never holds A's fast copies
                    a = self.rows(k).to(self.fast)
                    K = (a.T @ a).to(self.dtype)
                    K = (K + K.T) / 2
                    G += K / self.a_norms[k]
                    M += K / a.shape[0]
                self._gram_sums[part] = (G, M)
        return self._gram_sums[part]

    def circuit_gram(self, gauge: str, XA: torch.Tensor, YA: torch.Tensor) -> torch.Tensor:
        """``certify.circuit_gram`` of A's heads in gauge group ``gauge`` (computed once per A)."""
        if gauge not in self._circuit_gram:
            with section("heads certificate Gram"):
                self._circuit_gram[gauge] = circuit_gram(XA, YA)
        return self._circuit_gram[gauge]

    def gram_max(self, group: str) -> torch.Tensor:
        """``certify.gram_row_max`` of A's features in FF group ``group`` (computed once per A)."""
        if group not in self._gram_max:
            self._gram_max[group] = gram_row_max(self.A_features[group])
        return self._gram_max[group]

    def score_features(self, groups) -> dict:
        """A's FF features of ``groups`` as the FF step multiplies them: ``A_features``, or their
        ``Int8Rows`` (coded once per A) where the scores are int8 products."""
        if not self.int8:
            return self.A_features
        for g in groups:
            if g.name not in self._a_int8:
                with section("FF similarity products"):
                    self._a_int8[g.name] = Int8Rows(self.A_features[g.name])
        return self._a_int8

    @functools.cached_property
    def unit_layout(self) -> Optional[dict[str, list[tuple[str, int]]]]:
        """Each FF group's tensors and their unit axis, where ``Problem._moved_units_cross`` applies:
        plain permutations of single units, each tensor moved by one group, a matrix's other axis the
        residual one, a vector (a bias) with none. None otherwise."""
        layout, seen = {}, set()
        for g in self.part_groups["ff"]:
            group = self.spec.groups[g]
            ok = group.kind == "permutation" and group.structure is None
            members = []
            for m in group.members:
                t = self.A_mov.get(m.param)
                ok = ok and t is not None and m.block == 1 and m.repeat == 1 and m.param not in seen
                ok = ok and (
                    t.ndim == 2 and self.axis.get(m.param, m.axis) != m.axis or t.ndim == 1 and m.param not in self.axis
                )
                seen.add(m.param)
                members.append((m.param, m.axis))
            if not ok:
                return None
            layout[g] = members
        return layout

    @property
    def ff_scores(self) -> str:
        """The FF similarity scores' kind: "int8" (``Int8Rows`` products) or the fast dtype's name."""
        return "int8" if self.int8 else str(self.fast).removeprefix("torch.")

    def fits(self, A: StateDict, precision: str) -> bool:
        """Whether this was built from the same tensors (same device and dtype) and precision."""
        return precision == self.precision and all(self.A.get(k) is v for k, v in A.items())


class Problem:
    """One matching problem: A (its ``Fixed`` side), B, and what stays fixed while the elements change.

    Coordinate descent only transforms the *moving* tensors (those some non-residual group touches);
    anchors enter through their cross-covariances, computed once, and tensors no group touches through
    a constant. That keeps huge embeddings and output heads (e.g. 50k × 768) out of every iteration.
    Head circuit norms, A's FF features and the identity units' ``Cross`` are computed once too.

    Precision: the per-iteration products (B's tensors under the residual map, the FF similarity
    scores, the cross-covariances) multiply factors held in ``self.fast`` (``solvers.score_dtype``:
    bfloat16 for float32 problems on a CPU with native bfloat16, else the problem's dtype) and
    accumulate in float32; residual map and gauges are solved in the problem's dtype. The objective
    at the identity residual map comes from the distances themselves (``Cross``), so the factors'
    rounding enters only through how the objective moves with O: a reply near A (trained from it)
    gets the gain that ``Matching.min_gain`` compares about as exactly as with float32 products
    (docs/performance.md), where cross-covariances of rounded factors alone subtract nearly equal
    sums. Scores keep ~3 significant digits, which only decide between near-ties.
    Where A is shared by many problems (a universe iteration) and the CPU has native int8 dot products,
    "auto" takes the cross-covariances of a B near A in the difference form (``Fixed``): ``AᵀA`` once
    per A, ``Aᵀ(B − A)`` an int8 product whose rounding is relative to the small difference.
    On a CPU without native bfloat16 but with native int8 dot products, "auto" keeps every product in
    float32 except the FF similarity scores, which it takes as int8 products of row-scaled codes
    (``solvers.Int8Rows``): they only rank partners for the assignment, and the objective, the
    certificate and every continuous step stay in float32.
    ``precision``: "auto" (as above), "exact" (every product in the problem's dtype: the reference the
    bench compares with), "bfloat16" (bfloat16 factors anywhere, e.g. to test the fast path on a
    small model) or "int8" (int8 FF scores on the CPU, the rest exact). ``fixed``: A's side when
    already built (it must fit A and ``precision``).
    """

    def __init__(self, A: StateDict, B: StateDict, cfg, precision: str = "auto", fixed: Optional[Fixed] = None) -> None:
        if fixed is not None and not fixed.fits(A, precision):
            raise ValueError("fixed was built from another model A or precision")
        F = fixed or Fixed(A, cfg, precision)
        self.fixed, self.A, self.B, self.cfg, self.spec = F, A, B, cfg, F.spec
        self.A_mov, self.B_mov = F.A_mov, {k: B[k] for k in F.moved}
        self.anchor_members, self.moving_members = F.anchor_members, F.moving_members
        self.dtype, self.fast = F.dtype, F.fast
        self._anchor_setup(A, B, F)
        self.head_norms = {g: (nA, circuit_norms(B, self.spec, g)) for g, nA in F.head_norms.items()}
        self.B_fast = _Cast(self.B_mov, self.fast)
        self.A_features = F.A_features
        self._identity_cross: dict[str, Cross] = {}
        self._last_cross: dict[str, tuple[list, Cross]] = {}  # per part: the elements it was computed for
        self.A_sides = F.A_sides
        self.ff_counts = {"certified": 0, "solved": 0}  # FF steps settled by the certificate / by a product
        self.trusted: set[str] = set()  # permutation groups whose current element is an earlier answer
        self.heads_counts = {"certified": 0, "solved": 0}
        self._rotation: Optional[tuple[torch.Tensor, float, float]] = None

    def _anchor_setup(self, A: StateDict, B: StateDict, F: Fixed) -> None:
        """The anchors' and untouched tensors' part of the objective (a ``Cross``: the anchors do not
        move with the units), whose ``M`` is the anchors' fixed part of every residual step."""
        keys = [m.param for m in self.anchor_members]
        self._anchor = _cross(F, "anchor", {k: A[k] for k in keys}, {k: B[k] for k in keys}, F.anchor_axis, None)
        self._anchor.constant += float(sum(sq_dist(A[k], B[k]) / na for k, na in F.untouched.items()))
        self.M_anchor = self._anchor.M
        self.delta_parts = {"anchor"} if self._anchor.delta else set()  # parts whose products took the difference form

    def anchor_objective(self, O: Optional[torch.Tensor]) -> float:
        """The anchors' and untouched tensors' part of the objective under residual map ``O``."""
        return self._anchor.value(O)

    def objective(self, elements: Elements) -> float:
        """``Σ_tensors ‖A − T(B)‖² / ‖A‖²`` (the criterion that compares candidate transforms)."""
        O = elements.get("residual")
        return self.anchor_objective(O) + (self.cross(elements, "ff") + self.cross(elements, "rest")).value(O)

    def rotated(self, O: torch.Tensor, ff: bool = True, exact: bool = False) -> StateDict:
        """B's moving tensors under the residual map ``O``: FF members (read by the FF scores) in the
        fast dtype, the rest (read by the head and gauge steps) back in the problem's dtype; ``ff=False``:
        the rest only. ``exact``: the rest rotated so that ``rest_value`` can take the distances from it:
        in the problem's dtype, or, for an O within ``SMALL_TURN`` of the identity, as ``B + B·(O − I)``
        along the residual axis with only the small correction from the fast copy (its rounding is
        relative to the correction)."""
        ffp, axis = self.fixed.ff_params, self.fixed.axis
        out = {}
        if ff:
            out = apply_elements(
                {k: self.B_fast[k] for k in self.B_mov if k in ffp}, self.cfg, {"residual": O.to(self.fast)}
            )
        if exact and self.fast != self.dtype and float(_from_identity(O).norm()) <= SMALL_TURN:
            step = _from_identity(O).neg_().to(self.fast)  # O − I
            for k in self.B_mov:
                if k not in ffp:
                    b = self.B_mov[k]
                    out[k] = b + apply_along(self.B_fast[k], axis[k], step).to(self.dtype) if k in axis else b
            return out
        rest = {k: (self.B_mov if exact else self.B_fast)[k] for k in self.B_mov if k not in ffp}
        rest = apply_elements(rest, self.cfg, {"residual": O if exact else O.to(self.fast)})
        out.update({k: v.to(self.dtype) for k, v in rest.items()})
        return out

    def cross(self, elements: Elements, part: str) -> Cross:
        """``Cross`` of A with U(B), U the unit elements (any residual element is ignored), over the
        moving tensors of ``part``: "ff" (FF members) or "rest"; the two add up to the whole (kept
        apart because a gauges-only step leaves the FF part unchanged)."""
        if part not in ("ff", "rest"):
            raise ValueError(f"part must be 'ff' or 'rest', not {part!r}")
        units = {k: v for k, v in elements.items() if k != "residual"}
        F, axis = self.fixed, self.fixed.axis
        # only the part's groups act on its tensors: the identity's cross while those are the identity
        acting = {g: units[g] for g in F.part_groups[part] if g in units and not _is_identity(units[g])}
        identity = not acting
        if identity and part in self._identity_cross:
            return self._identity_cross[part]
        key = [units.get(g) for g in F.part_groups[part]]  # only these groups act on the part's tensors
        last = self._last_cross.get(part)
        if last is not None and all(_same(x, y) for x, y in zip(last[0], key)):
            return last[1]
        if part == "ff" and last is not None and not identity:
            out = self._moved_units_cross(last, key)
            if out is not None:
                self._last_cross[part] = (key, out)
                return out
        keys = [k for k in self.A_mov if (k in F.ff_params) == (part == "ff")]
        # U(B) in the problem's dtype (its distance to A), its products in the fast one; only the
        # part's groups that are not the identity act (the others leave B's tensors as they are)
        UB = {k: self.B_mov[k] for k in keys}
        UB = apply_elements(UB, self.cfg, acting) if acting else UB
        out = _cross(F, part, {k: self.A_mov[k] for k in keys}, UB, axis, self.B_fast)
        if out.delta:
            self.delta_parts.add(part)
        if identity:
            self._identity_cross[part] = out
        self._last_cross[part] = (key, out)
        return out

    def _moved_units_cross(self, last: tuple[list, Cross], key: list) -> Optional[Cross]:
        """The FF part's ``Cross`` for the permutations ``key`` from ``last``'s, when few units moved: a
        product over the moved units only, ``Σ_{i moved} a_iᵀ (b_new(i) − b_old(i))`` per tensor, in the
        problem's dtype (and the distances' change likewise), added to the last one's sums. The other
        units' terms are unchanged, so this is the full ``cross`` up to float rounding, at the cost of
        the moved share of its products (a descent's later iterations move few units). None where it
        does not apply: the last one in the difference form, a group moving more than a third of its
        units, or FF tensors not laid out as one unit axis each (``Fixed.unit_layout``)."""
        old_key, old = last
        F = self.fixed
        layout = F.unit_layout
        if old.delta or layout is None:
            return None
        moved = []
        for g, po, pn in zip(F.part_groups["ff"], old_key, key):
            n = self.spec.groups[g].size
            po = torch.arange(n) if po is None else po.cpu()
            pn = torch.arange(n) if pn is None else pn.cpu()
            R = (po != pn).nonzero().squeeze(1)
            if 3 * len(R) > n:  # the full products cost about as much from here on
                return None
            if len(R):
                device = self.A_mov[layout[g][0][0]].device
                moved.append((g, *(x.to(device) for x in (R, po[R], pn[R]))))
        G, M, constant = old.G.clone(), old.M.clone(), old.constant
        for g, R, po, pn in moved:
            for k, unit_axis in layout[g]:
                A_k, B_k = self.A_mov[k], self.B_mov[k]
                # the moved units' slices, gathered along the unit axis (a column gather of a transposed
                # view would read a cache line per element)
                a, b_new, b_old = (x.index_select(unit_axis, i) for x, i in ((A_k, R), (B_k, pn), (B_k, po)))
                constant += float((sq_dist(a, b_new) - sq_dist(a, b_old)) / F.a_norms[k])
                if k in F.axis:
                    step = b_new.sub_(b_old)
                    C = (a @ step.T if unit_axis == 1 else a.T @ step).to(G.dtype)
                    G += C / F.a_norms[k]
                    M += C / _rows(A_k, F.axis[k])
        return Cross(constant, G, M)

    def rest_value(self, elements: Elements, B_rest: StateDict, exact: bool = False) -> Optional[float]:
        """``cross(elements, "rest").value(O)`` as the distances themselves, ``Σ ‖A − T(B)‖² / ‖A‖²``
        over the tensors outside the FF members, from ``B_rest = rotated(O, ff=False, exact)``: one
        elementwise pass where the cross-covariances cost a matrix product per tensor (a single, fixed O
        needs no products). None when B's tensors were rounded to a faster dtype (not ``exact``: the
        distances would carry the rounding)."""
        if self.fast != self.dtype and not exact:
            return None
        F = self.fixed
        TB = apply_elements(B_rest, self.cfg, {g: elements[g] for g in F.part_groups["rest"] if g in elements})
        return float(sum(sq_dist(self.A_mov[k], b) / F.a_norms[k] for k, b in TB.items()))

    def ff_units(self, O: torch.Tensor, current: Elements, candidates: Optional[int]) -> Elements:
        """The FF step under residual map O from ``current``: every layer whose current permutation the
        certificate proves optimal keeps it (``certify``: no similarity product), the others are solved
        on B's features rotated by O (``steps.ff_step``).

        A layer is tested when O is near the identity (the bound needs no rotated features), or when
        its current permutation is an earlier answer (a warm start's or a previous step's): a default
        identity under a large O, the first step of aligning a permuted model, would only fail."""
        F, spec = self.fixed, self.spec
        groups = spec.layer_groups("ff")
        eps, eps_ones = self.rotation_size(O)
        ones = torch.full((O.shape[0],), O.shape[0] ** -0.5, dtype=torch.float64, device=O.device)
        rotated: dict[str, StateDict] = {}

        def rotated_ff(g) -> StateDict:
            if g.name not in rotated:
                rotated[g.name] = self._rotated_ff(O, g)
            return rotated[g.name]

        out: Elements = {}
        for g in groups:
            perm = current.get(g.name)
            if perm is None or (eps > ROTATE_FIRST and g.name not in self.trusted):
                continue
            idx = perm.to(O.device)
            if eps <= ROTATE_FIRST:  # B's features as they are, and how far O moves each
                FB = unit_features(self.B_fast, g).index_select(0, idx)
                move = eps * FB.float().norm(dim=1) + eps_ones * self._along(g, ones).index_select(0, idx)
                later = lambda g=g, idx=idx: unit_features(rotated_ff(g), g).index_select(0, idx)  # noqa: E731
            else:  # a large residual map: B's features rotated by it (which the FF step reads anyway)
                FB, move, later = unit_features(rotated_ff(g), g).index_select(0, idx), None, None
            if certify(F.A_features[g.name], FB, lambda g=g: F.gram_max(g.name), move, later):
                out[g.name] = perm
        todo = [g for g in groups if g.name not in out]
        self.ff_counts["certified"] += len(out)
        self.ff_counts["solved"] += len(todo)
        if todo:
            B_ff: StateDict = {}
            for g in todo:
                B_ff.update(rotated_ff(g))
            out.update(ff_step(F.score_features(todo), B_ff, spec, current, candidates, groups=todo))
        self.trusted.update(g.name for g in groups)  # every current permutation is now an answer
        return out

    def rotation_size(self, O: torch.Tensor) -> tuple[float, float]:
        """``certify.rotation_size`` of O with u the all-ones direction (kept for the last O)."""
        if self._rotation is None or self._rotation[0] is not O:
            with section("FF certificate"):
                ones = torch.full((O.shape[0],), O.shape[0] ** -0.5, dtype=torch.float64, device=O.device)
                self._rotation = (O, *rotation_size(O, ones))
        return self._rotation[1], self._rotation[2]

    def heads_units(self, O: torch.Tensor, B_res: StateDict, current: Elements) -> Elements:
        """The heads step on B under residual map O (``B_res``: B's attention tensors under it): every
        layer whose current head permutation ``certify_heads`` proves optimal keeps it, the others are
        solved (``steps.heads_step``). Tested as the FF step's layers are (``ff_units``); grouped-query
        attention is always solved."""
        spec, F = self.spec, self.fixed
        near = self.rotation_size(O)[0] <= ROTATE_FIRST
        out: Elements = {}
        for g in spec.layer_groups("heads"):
            perm = current.get(g.name)
            if perm is None or spec.within_of(g.name) is not None or not (near or g.name in self.trusted):
                continue
            idx = perm.to(O.device)
            circuits = []
            for kind, (xs, ys) in CIRCUITS.items():
                gauge = spec.gauges_of(g.name)[kind]
                XA, YA = (
                    cached_side(self.A_mov, gauge, xs, self.A_sides),
                    cached_side(self.A_mov, gauge, ys, self.A_sides),
                )
                XB, YB = (head_side(B_res, gauge, fns).index_select(0, idx) for fns in (xs, ys))
                circuits.append((XA, YA, XB, YB, F.circuit_gram(gauge.name, XA, YA)))
            if certify_heads(circuits):
                out[g.name] = perm
        todo = [g for g in spec.layer_groups("heads") if g.name not in out]
        self.heads_counts["certified"] += len(out)
        self.heads_counts["solved"] += len(todo)
        if todo:
            out.update(heads_step(self.A_mov, B_res, spec, self.head_norms, self.A_sides, groups=todo))
        self.trusted.update(g.name for g in spec.layer_groups("heads"))
        return out

    def _along(self, group, u: torch.Tensor) -> torch.Tensor:
        """For every unit of FF group ``group``: the norm of its residual slices' components along the
        unit vector u (B's; zero for u = 1/√d in a LayerNorm model's canonical form)."""
        total = torch.zeros(group.size, dtype=torch.float32, device=u.device)
        for m in group.members:
            r = self.fixed.axis.get(m.param)
            if r is None:  # no residual axis (a bias): the residual map does not move it
                continue
            t = self.B_fast[m.param].float()
            along = torch.tensordot(t, u.to(t), dims=([r], [0]))  # the residual axis contracted
            total += along.movedim(m.axis - (r < m.axis), 0).reshape(group.size, -1).pow(2).sum(1)
        return total.sqrt()

    def _rotated_ff(self, O: torch.Tensor, group) -> StateDict:
        """FF group ``group``'s members of B under the residual map O, in the fast dtype."""
        with section("apply residual map"):
            src = {m.param: self.B_fast[m.param] for m in group.members}
            return apply_elements(src, self.cfg, {"residual": O.to(self.fast)})


@contextlib.contextmanager
def full_precision_products():
    """float32 matrix products at full precision (no TF32 or bfloat16 passes) inside, as they were after."""
    was = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(was)


def sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``‖a − b‖²``, a float64 scalar. On the CPU the difference is formed a piece at a time in one
    buffer and each piece's squares summed by a BLAS dot, the pieces' sums in float64 (a sum of
    squares subtracts nothing: ~1e-6 relative, against ~1e-4 the gains of ``Matching.min_gain`` ask)."""
    if a.device.type != "cpu" or a.dtype not in (torch.float32, torch.float64):
        return torch.linalg.vector_norm(a - b, dtype=torch.float64).square()
    fa, fb = a.reshape(-1), b.reshape(-1)
    buf = torch.empty(min(fa.numel(), 1 << 18), dtype=fa.dtype)
    sums = []
    for x, y in zip(fa.split(len(buf)), fb.split(len(buf))):
        d = torch.sub(x, y, out=buf[: len(x)])
        sums.append(torch.dot(d, d))
    return torch.stack(sums).double().sum() if sums else torch.zeros((), dtype=torch.float64)


def sq_norm(t: torch.Tensor) -> torch.Tensor:
    """``‖t‖²`` (Frobenius), a float64 scalar. On the CPU: BLAS dot products of 16k-element pieces summed
    in float64 (3× faster than ``t.pow(2).sum()`` on a 50k × 768 embedding, no temporary, as accurate:
    one dot over all of it would be off by ~1e-4, ``vector_norm`` by ~1e-3)."""
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64):
        # accumulated in float64, as on the CPU: the objective subtracts sums of this size
        return torch.linalg.vector_norm(t, dtype=torch.float64).square()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([torch.dot(c, c) for c in flat.split(1 << 14)]).double().sum()


def _same(x: Optional[torch.Tensor], y: Optional[torch.Tensor]) -> bool:
    if x is None or y is None:
        return x is y
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y.to(x.device))


def _is_identity(el: torch.Tensor) -> bool:
    if not el.is_floating_point():
        return torch.equal(el, torch.arange(len(el), device=el.device))
    eye = torch.eye(el.shape[-1], dtype=el.dtype, device=el.device)
    return torch.equal(el, eye.expand_as(el))


def changed(old: Elements, new: Elements, tol: float = 1e-6) -> bool:
    for k, v in new.items():
        o = old.get(k)
        if o is None or o.shape != v.shape:
            return True
        if (o.double() - v.to(o.device).double()).abs().max() > tol:  # a moved index differs by ≥ 1
            return True
    return False
