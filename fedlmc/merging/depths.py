"""Models of different depths: identity blocks, and which layers of a deep model a shallow one's are.

In a pre-norm residual Transformer, a block whose residual writers (the attention's output projection
and the FF's output projection, biases included) are zero adds nothing to the stream: it is exactly the
identity. So a shallow model is a deeper one with identity blocks inserted (``insert_identity_blocks``;
``remove_blocks`` is the inverse on identity blocks), and merging clients of different depths is a
question of *where* the shallow model's blocks sit among the deep model's: a monotone assignment
(``match_layers``), found by dynamic programming (``monotone_assignment``) on a cost between every pair of
blocks. The residual stream's orthogonal map is shared by every block, so padding does not disturb it,
and within matched layers the alignment of equal depths applies unchanged.

The weight-based cost compares blocks by what no symmetry changes: the singular values of each block's
three circuits in the residual basis, ``Σ_h W_Qᵀ W_K`` (QK), ``Σ_h W_O W_V`` (OV) and the FF's
``W_out W_in`` (SwiGLU: ``W_down W_up``). A residual rotation conjugates each circuit, head permutations
and the QK / OV gauges cancel inside the sums, FF permutations and scales cancel in the product: so the
cost is the same for every representative of a model, and needs no alignment first. The
activation-based cost (``data`` given) compares each block's update of the residual stream, ``block(x) −
x`` on the same inputs, by linear CKA (invariant to orthogonal maps and scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn

from fedlmc.matching import weight_matching
from fedlmc.merging.averaging import aligned_state
from fedlmc.merging.widths import common_shape, pad, shape_of
from fedlmc.models import from_config
from fedlmc.options import Matching
from fedlmc.symmetry import canonicalize, rebuild

WRITERS = ("attn.o", "mlp.fc2", "mlp.down")  # a block's residual writers (fedlmc's models)


def _blocks(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no .blocks: depth transforms need a fedlmc model (from_hf)")
    return blocks


def is_identity_block(model: nn.Module, layer: int) -> bool:
    """Whether block ``layer``'s residual writers (weights and biases) are all zero."""
    block = _blocks(model)[layer]
    return all(
        bool((p == 0).all()) for name, p in block.named_parameters() if any(name.startswith(w + ".") for w in WRITERS)
    )


def _rebuilt(model: nn.Module, depth: int, source: Sequence[Optional[int]]) -> nn.Module:
    """A model of ``depth`` blocks: block ``i`` is ``model``'s block ``source[i]``, or (None) an identity block."""
    p = next(model.parameters())
    out = from_config(model.config.replace(n_layer=depth)).to(dtype=p.dtype, device=p.device)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("blocks.")}
    old = model.state_dict()
    fresh = out.state_dict()
    for i, j in enumerate(source):
        prefix = f"blocks.{i}."
        for k, v in fresh.items():
            if not k.startswith(prefix):
                continue
            rest = k[len(prefix) :]
            if j is not None:
                state[k] = old[f"blocks.{j}.{rest}"]
            elif "ln" in rest.split(".")[0]:
                state[k] = v  # a fresh norm (unit gain, zero bias; nothing in canonical form)
            else:
                state[k] = torch.zeros_like(v)  # every projection zero: the writers make it the identity
    out.load_state_dict(state)
    return out.train(model.training)


def insert_identity_blocks(model: nn.Module, positions: Sequence[int]) -> nn.Module:
    """A deeper copy of ``model`` computing exactly its function: identity blocks at ``positions`` (indices
    in the new model), ``model``'s blocks in order around them."""
    depth = model.config.n_layer + len(positions)
    at = sorted(set(int(p) for p in positions))
    if len(at) != len(positions) or (at and (at[0] < 0 or at[-1] >= depth)):
        raise ValueError(f"identity positions must be distinct indices below {depth}, got {list(positions)}")
    real = iter(range(model.config.n_layer))
    return _rebuilt(model, depth, [None if i in at else next(real) for i in range(depth)])


def remove_blocks(model: nn.Module, positions: Sequence[int]) -> nn.Module:
    """``model`` without the blocks at ``positions`` (the function is unchanged when they are identity
    blocks: ``is_identity_block``)."""
    drop = set(int(p) for p in positions)
    keep = [i for i in range(model.config.n_layer) if i not in drop]
    if len(drop) != len(positions) or not drop <= set(range(model.config.n_layer)) or not keep:
        raise ValueError(f"positions must be distinct blocks of {model.config.n_layer}, leaving one, got {positions}")
    return _rebuilt(model, len(keep), keep)


def pad_to_depth(model: nn.Module, positions: Sequence[int], depth: int) -> nn.Module:
    """``model``'s blocks at ``positions`` of a ``depth``-block model (increasing), identity blocks elsewhere."""
    if len(positions) != model.config.n_layer or list(positions) != sorted(set(positions)):
        raise ValueError(f"one increasing position per block of {model.config.n_layer}, got {list(positions)}")
    return insert_identity_blocks(model, [i for i in range(depth) if i not in set(positions)])


def monotone_assignment(cost: torch.Tensor) -> tuple[list[int], float]:
    """The increasing map ``f`` of rows to columns (``rows ≤ columns``) with the least ``Σ cost[i, f(i)]``,
    by dynamic programming in ``O(rows · columns)``; the map and its cost."""
    n, m = cost.shape
    if n > m:
        raise ValueError(f"cannot place {n} blocks in {m} monotonically")
    c = cost.double().tolist()
    inf = float("inf")
    best = [[inf] * (m + 1) for _ in range(n + 1)]  # best[i][j]: the first i rows within the first j columns
    take = [[False] * (m + 1) for _ in range(n + 1)]
    for j in range(m + 1):
        best[0][j] = 0.0
    for i in range(1, n + 1):
        for j in range(i, m + 1):
            skip, use = best[i][j - 1], best[i - 1][j - 1] + c[i - 1][j - 1]
            best[i][j], take[i][j] = (use, True) if use <= skip else (skip, False)
    out, i, j = [], n, m
    while i > 0:
        if take[i][j]:
            out.append(j - 1)
            i -= 1
        j -= 1
    return out[::-1], best[n][m]


def _circuits(block: nn.Module, cfg) -> list[torch.Tensor]:
    """A block's QK, OV and FF circuits in the residual basis (d × d, float64)."""
    a = block.attn
    H, dh = cfg.n_head, cfg.d_head
    kv = getattr(cfg, "n_kv_head", None) or H
    q = a.q.weight.double().reshape(H, dh, -1)
    k = a.k.weight.double().reshape(kv, dh, -1).repeat_interleave(H // kv, dim=0)
    v = a.v.weight.double().reshape(kv, dh, -1).repeat_interleave(H // kv, dim=0)
    o = a.o.weight.double().reshape(-1, H, dh).permute(1, 0, 2)  # (H, d, dh)
    qk = torch.einsum("hai,haj->ij", q, k)
    ov = torch.einsum("hia,haj->ij", o, v)
    mlp = block.mlp
    ff = (
        (mlp.down.weight.double() @ mlp.up.weight.double())
        if hasattr(mlp, "down")
        else (mlp.fc2.weight.double() @ mlp.fc1.weight.double())
    )
    return [qk, ov, ff]


@torch.no_grad()
def block_signatures(model: nn.Module) -> list[list[torch.Tensor]]:
    """Per block, the singular values of its QK, OV and FF circuits (of the canonical form): the same for
    every model the symmetry group maps ``model`` to."""
    canon = canonicalize(model)
    return [[torch.linalg.svdvals(c) for c in _circuits(b, canon.config)] for b in _blocks(canon)]


def _signature_cost(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    total = 0.0
    for x, y in zip(a, b):
        n = max(len(x), len(y))
        x, y = nn.functional.pad(x, (0, n - len(x))), nn.functional.pad(y, (0, n - len(y)))
        total += float(((x - y) ** 2).sum() / ((x**2).sum() + (y**2).sum()).clamp(min=1e-30))
    return total / len(a)


def _updates(model: nn.Module, data: torch.Tensor) -> list[torch.Tensor]:
    """Each block's update of the residual stream, ``block(x) − x``, on ``data`` (tokens × d)."""
    out: list[torch.Tensor] = []
    hooks = [
        b.register_forward_hook(lambda _m, args, y: out.append((y - args[0]).reshape(-1, y.shape[-1]).double()))
        for b in _blocks(model)
    ]
    try:
        with torch.no_grad():
            model.eval()(data)
    finally:
        for h in hooks:
            h.remove()
    return out


def _cka(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x - x.mean(0), y - y.mean(0)
    num = (x.T @ y).norm() ** 2
    den = (x.T @ x).norm() * (y.T @ y).norm()
    return float(num / den) if float(den) > 0 else 0.0


@dataclass(frozen=True)
class LayerMatch:
    """Where a shallow model's blocks sit in a deep model: ``positions[i]`` is the deep block that shallow
    block ``i`` matches (increasing), ``cost`` the assignment's total, ``costs`` every pair's cost
    (shallow × deep) and ``by`` the cost's kind ("signatures", "aligned circuits" or "activations")."""

    positions: list[int]
    cost: float
    costs: torch.Tensor
    by: str


def _circuit_cost(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(
        float(((x - y) ** 2).sum() / ((x**2).sum() + (y**2).sum()).clamp(min=1e-30)) for x, y in zip(a, b)
    ) / len(a)


@torch.no_grad()
def aligned_costs(
    shallow: nn.Module, deep: nn.Module, positions: Sequence[int], matching: Optional[Matching] = None
) -> torch.Tensor:
    """Every pair's cost (shallow × deep blocks) once the residual streams are aligned: ``shallow`` padded
        at ``positions`` and weight-matched to ``deep`` gives the residual map, and shallow block ``i``'s QK,
        OV and FF circuits in ``deep``'s residual basis are compared with deep block ``j``'s (each circuit's
        squared distance over its squared norms, averaged). Models of two widths are compared zero-padded
    to one shape. Head and neuron permutations and the QK / OV
        gauges cancel inside the circuits, so only the residual map matters, and it is shared by every block."""
    canon_s, canon_d = canonicalize(shallow), canonicalize(deep)
    padded = pad_to_depth(canon_s, positions, canon_d.config.n_layer)
    if shape_of(padded.config) != shape_of(canon_d.config):  # widths differ: both zero-padded to one shape
        shape = common_shape([padded.config, canon_d.config])
        padded, canon_d = pad(padded, shape), pad(canon_d, shape)
    T = weight_matching(canon_d, padded, matching)
    aligned = rebuild(padded, aligned_state(padded, T))
    mine = [_circuits(_blocks(aligned)[p], aligned.config) for p in positions]
    theirs = [_circuits(b, canon_d.config) for b in _blocks(canon_d)]
    return torch.tensor([[_circuit_cost(a, b) for b in theirs] for a in mine], dtype=torch.float64)


def match_layers(
    shallow: nn.Module,
    deep: nn.Module,
    data: Optional[torch.Tensor] = None,
    matching: Optional[Matching] = None,
    rounds: int = 3,
) -> LayerMatch:
    """The monotone assignment of ``shallow``'s blocks to ``deep``'s (``shallow`` no deeper).

    Without ``data``, on weights: a first placement from the block signatures (invariant to every
    symmetry, no alignment needed), then up to ``rounds`` times: align the residual streams at the current
    placement and place again on the aligned circuits' distances (``aligned_costs``), until the placement
    holds. With ``data`` (inputs both models take), on activations: ``1 − CKA`` of the blocks' residual
    updates."""
    ls, ld = shallow.config.n_layer, deep.config.n_layer
    if ls > ld:
        raise ValueError(f"the shallow model has {ls} blocks, the deep one {ld}: pass them the other way round")
    if data is not None:
        ua, ub = _updates(shallow, data), _updates(deep, data)
        costs = torch.tensor([[1.0 - _cka(a, b) for b in ub] for a in ua], dtype=torch.float64)
        positions, total = monotone_assignment(costs)
        return LayerMatch(positions, total, costs, "activations")
    sa, sb = block_signatures(shallow), block_signatures(deep)
    costs = torch.tensor([[_signature_cost(a, b) for b in sb] for a in sa], dtype=torch.float64)
    positions, total = monotone_assignment(costs)
    by = "signatures"
    for _ in range(rounds):
        costs = aligned_costs(shallow, deep, positions, matching)
        again, total = monotone_assignment(costs)
        by = "aligned circuits"
        if again == positions:
            break
        positions = again
    return LayerMatch(positions, total, costs, by)
