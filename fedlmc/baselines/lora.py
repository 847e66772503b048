"""The published LoRA aggregators, server side, for side-by-side comparisons with ``LoraAggregator``
(``simulations/lora_aggregators.py``). Each takes the round's replies ``{module: (B, A)}`` and weights and
says what every client starts the next round from.

* FedIT (FlowerTune's FedAvg): ``B`` and ``A`` averaged separately; with mixed ranks, HetLoRA's
  zero-padding to the largest rank and truncation to each client's.
* FFA-LoRA: ``A`` frozen at its shared initialisation; ``B`` averaged (exact: ``mean(B)·A``).
* FedSA-LoRA: only ``A`` averaged; every client keeps its own ``B`` (a personalised method).
* FLoRA: the products stacked (exact, rank Σrᵢ) and folded into the base; fresh adapters every round.
* FlexLoRA: the dense weighted sum of the products, its SVD, each client's rank cut (``B = U S``,
  ``A = Vᵀ``).
* FedEx-LoRA: FedIT's factors plus the residual ``mean(s B A) − s mean(B) mean(A)``, dense, folded
  into the base.
* Task-vector merges of the products (Task Arithmetic, TIES, DARE, Model Stock: ``fedlmc.baselines.task_vectors``):
  each client's dense ``sᵢ Bᵢ Aᵢ`` is its task vector from the base; their merge, cut to the rank by
  its SVD as FlexLoRA's (``B = U S / s``, ``A = Vᵀ``).
* FedRot-LoRA: every client's factors first rotated, ``A → Rᵀ A``, ``B → B R`` (its product unchanged),
  by the rotation that best maps its ``A`` onto the reference's (the global adapter sent: orthogonal
  Procrustes, a proper rotation), then FedIT's means.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedlmc.baselines.task_vectors import TaskMerge, client_weights, task_vector_merge
from fedlmc.lora import LoraLayout

Factors = dict[str, tuple[torch.Tensor, torch.Tensor]]
TASK_VECTOR_METHODS = {"ties-lora": "ties", "dare-lora": "dare", "model-stock-lora": "model-stock"}
METHODS = ("average", "ffa-lora", "fedsa-lora", "flora", "flexlora", "fedex-lora", "fedrot-lora", *TASK_VECTOR_METHODS)


def _normalised(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def pad(b: torch.Tensor, a: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HetLoRA: factors zero-padded (or cut) to ``rank``."""
    B = torch.zeros(b.shape[0], rank, dtype=b.dtype)
    A = torch.zeros(rank, a.shape[1], dtype=a.dtype)
    k = min(rank, a.shape[0])
    B[:, :k], A[:k] = b[:, :k], a[:k]
    return B, A


def factor_mean(layout: LoraLayout, replies: Sequence[Factors], weights: Sequence[float], rank: int) -> Factors:
    """FedIT / HetLoRA: the weighted means of ``B`` and of ``A``, zero-padded to ``rank``."""
    w = _normalised(weights)
    out = {}
    for m in layout.modules:
        padded = [pad(*r[m.name], rank) for r in replies]
        out[m.name] = (sum(wi * b for wi, (b, _) in zip(w, padded)), sum(wi * a for wi, (_, a) in zip(w, padded)))
    return out


def product_mean(layout: LoraLayout, replies: Sequence[Factors], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """The dense weighted mean of ``s·B·A`` per module (out × in)."""
    w = _normalised(weights)
    return {
        m.name: sum(wi * m.scaling(r[m.name][1].shape[0]) * r[m.name][0] @ r[m.name][1] for wi, r in zip(w, replies))
        for m in layout.modules
    }


def flexlora(layout: LoraLayout, replies: Sequence[Factors], weights: Sequence[float], rank: int) -> Factors:
    """FlexLoRA: the SVD of the dense weighted sum, cut to ``rank`` (singular values in ``B``)."""
    out = {}
    for name, dense in product_mean(layout, replies, weights).items():
        m = next(x for x in layout.modules if x.name == name)
        U, S, Vh = torch.linalg.svd(dense, full_matrices=False)
        out[name] = (U[:, :rank] * S[:rank] / m.scaling(rank), Vh[:rank].clone())
    return out


def _cut(m, dense: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    U, S, Vh = torch.linalg.svd(dense, full_matrices=False)
    return U[:, :rank] * S[:rank] / m.scaling(rank), Vh[:rank].clone()


def task_vector_lora(
    layout: LoraLayout, replies: Sequence[Factors], weights: Sequence[float], rank: int, merge: TaskMerge
) -> Factors:
    """The task-vector merge (``merge.method``) of the clients' dense products ``sᵢ Bᵢ Aᵢ`` (each its task
    vector from the base, ``weights`` the example counts: ``client_weights``), cut to ``rank`` by its SVD
    (normalised Task Arithmetic at λ = 1 is FlexLoRA's)."""
    zeros = {m.name: torch.zeros(m.out_features, m.in_features, dtype=torch.float64) for m in layout.modules}
    dense = [
        {
            m.name: m.scaling(r[m.name][1].shape[0]) * (r[m.name][0].double() @ r[m.name][1].double())
            for m in layout.modules
        }
        for r in replies
    ]
    merged = task_vector_merge(zeros, dense, client_weights(weights), merge)
    out = {}
    for m in layout.modules:
        b, a = _cut(m, merged[m.name], rank)
        out[m.name] = (b.to(replies[0][m.name][0].dtype), a.to(replies[0][m.name][1].dtype))
    return out


def fedex_lora(
    layout: LoraLayout, replies: Sequence[Factors], weights: Sequence[float], rank: int
) -> tuple[Factors, dict[str, torch.Tensor]]:
    """FedEx-LoRA: FedIT's factors and the dense residual to fold into the base (module → out × in)."""
    mean = factor_mean(layout, replies, weights, rank)
    exact = product_mean(layout, replies, weights)
    residual = {m.name: exact[m.name] - m.scaling(rank) * mean[m.name][0] @ mean[m.name][1] for m in layout.modules}
    return mean, residual


def flora(layout: LoraLayout, replies: Sequence[Factors], weights: Sequence[float]) -> Factors:
    """FLoRA: the stacked factors (rank Σrᵢ) whose product, at scaling 1, is the weighted mean; the
    clients fold it into their base and start fresh adapters."""
    w = _normalised(weights)
    out = {}
    for m in layout.modules:
        bs = [wi * m.scaling(r[m.name][1].shape[0]) * r[m.name][0] for wi, r in zip(w, replies)]
        out[m.name] = (torch.cat(bs, 1), torch.cat([r[m.name][1] for r in replies], 0))
    return out


def stacked_product(factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {n: b @ a for n, (b, a) in factors.items()}


def procrustes_rotation(a: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The rotation ``R`` (r × r, det +1) that minimises ``‖Rᵀ a − reference‖``: from the SVD
    ``a referenceᵀ = U S Vᵀ``, ``R = U Vᵀ``, with the last singular pair's sign turned where that gives a
    reflection."""
    U, _, Vh = torch.linalg.svd(a @ reference.T)
    R = U @ Vh
    if float(torch.linalg.det(R)) < 0:
        U = U.clone()
        U[:, -1] = -U[:, -1]
        R = U @ Vh
    return R


def fedrot_lora(
    layout: LoraLayout, replies: Sequence[Factors], weights: Sequence[float], reference: Factors, rank: int
) -> Factors:
    """FedRot-LoRA: each client's ``(B, A)`` rotated to ``(B R, Rᵀ A)`` with ``R`` the rotation of its ``A``
    onto the reference's (``procrustes_rotation``; the reference cut or padded to the client's rank), then
    FedIT's means. A client's product ``B A`` is unchanged; only the factors' gauge moves."""
    rotated = []
    for r in replies:
        out = {}
        for name, (b, a) in r.items():
            ref_a = pad(*reference[name], a.shape[0])[1]
            R = procrustes_rotation(a, ref_a)
            out[name] = (b @ R, R.T @ a)
        rotated.append(out)
    return factor_mean(layout, rotated, weights, rank)


def energy_shares(updates: Mapping[str, torch.Tensor], ranks: Sequence[int]) -> dict[int, float]:
    """How an aggregate's energy spreads over ranks: for each rank r, the share of the squared singular
    values of the dense updates (out × in, summed over modules) in each module's leading r components.
    A collapse onto the smallest rank (as raFLoRA reports for SVD redistribution) shows as a share near 1
    at that rank."""
    total, within = 0.0, {r: 0.0 for r in ranks}
    for update in updates.values():
        s2 = torch.linalg.svdvals(update.double()) ** 2
        total += float(s2.sum())
        for r in ranks:
            within[r] += float(s2[:r].sum())
    return {r: (within[r] / total if total > 0 else 0.0) for r in ranks}
