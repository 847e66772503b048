"""Task-vector merges of models fine-tuned from one base: Task Arithmetic, TIES, DARE and Model Stock.

A client's task vector is ``τᵢ = θᵢ − θ_base``. Every method combines the task vectors tensor by tensor
and adds the result back to the base (``fedlmc.options.TaskMerge`` holds the knobs):

* ``task-arithmetic`` (Ilharco et al., ICLR 2023): ``θ = θ_base + λ · Σ wᵢ τᵢ`` with the clients'
  normalised weights ``wᵢ``; ``λ = 1`` is FedAvg exactly.
* ``ties`` (Yadav et al., NeurIPS 2023): each τᵢ keeps its ``density`` fraction of largest-magnitude
  entries (trim); each coordinate's sign is the sign of the trimmed vectors' weighted sum (elect); the
  coordinate is the weighted mean of the trimmed entries of that sign (disjoint merge); then ``λ``.
* ``dare`` (Yu et al., ICML 2024): each entry of every τᵢ is dropped with probability ``drop`` and the
  survivors rescaled by ``1 / (1 − drop)`` (unbiased), then Task Arithmetic.
* ``model-stock`` (Jang et al., ECCV 2024): per tensor, the mean cosine ``c`` between the task vectors
  of every pair of clients gives ``t = N c / (1 + (N − 1) c)``, and ``θ = t · θ_avg + (1 − t) · θ_base``
  (``θ_avg`` the clients' plain mean): the closer the clients' directions agree, the further from the base.

Tensors that are not floating point are taken from the base.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .options import TaskMerge
from .symmetry import StateDict


def task_vector_merge(
    base: StateDict,
    states: Sequence[StateDict],
    weights: Optional[Sequence[float]] = None,
    merge: Optional[TaskMerge] = None,
) -> StateDict:
    """The merge of ``states`` (fine-tuned from ``base``, the same keys and shapes) by ``merge.method``,
    weighted by ``weights`` (default uniform; Model Stock is unweighted, as published); ``merge`` default
    ``TaskMerge()``."""
    merge = merge if merge is not None else TaskMerge()
    n = len(states)
    w = torch.tensor([1.0] * n if weights is None else [float(x) for x in weights], dtype=torch.float64)
    if n == 0 or bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ValueError("task_vector_merge needs at least one state and non-negative weights with a positive sum")
    w = w / w.sum()
    gen = torch.Generator().manual_seed(merge.seed)
    out: StateDict = {}
    for key, b in base.items():
        if not b.is_floating_point():
            out[key] = b.clone()
            continue
        taus = torch.stack([s[key].to(torch.float64) - b.to(torch.float64) for s in states])
        out[key] = (b.to(torch.float64) + _combined(taus, w, merge, gen)).to(b.dtype)
    return out


def _combined(taus: torch.Tensor, w: torch.Tensor, merge: TaskMerge, gen: torch.Generator) -> torch.Tensor:
    """One tensor's merged task vector (``taus``: clients × the tensor's shape, float64)."""
    wb = w.reshape(-1, *([1] * (taus.dim() - 1)))
    if merge.method == "task-arithmetic":
        return merge.scale * (wb * taus).sum(0)
    if merge.method == "dare":
        keep = torch.rand(taus.shape, generator=gen, dtype=torch.float64) >= merge.drop
        return merge.scale * (wb * taus * keep / (1.0 - merge.drop)).sum(0)
    if merge.method == "ties":
        trimmed = torch.stack([trim(t, merge.density) for t in taus])
        sign = torch.sign((wb * trimmed).sum(0))
        agree = (torch.sign(trimmed) == sign) & (trimmed != 0)
        mass = (wb * agree).sum(0)
        merged = (wb * trimmed * agree).sum(0) / torch.where(mass > 0, mass, torch.ones_like(mass))
        return merge.scale * merged
    return stock_ratio(taus) * taus.mean(0)  # model-stock: t · (θ_avg − θ_base)


def trim(tau: torch.Tensor, density: float) -> torch.Tensor:
    """``tau`` with all but its ``density`` fraction of largest-magnitude entries set to 0 (at least one
    entry kept; ties at the threshold kept)."""
    if density >= 1.0:
        return tau.clone()
    k = max(1, int(round(density * tau.numel())))
    threshold = tau.abs().flatten().kthvalue(tau.numel() - k + 1).values
    return torch.where(tau.abs() >= threshold, tau, torch.zeros_like(tau))


def stock_ratio(taus: torch.Tensor) -> float:
    """Model Stock's interpolation ratio ``t = N c / (1 + (N − 1) c)`` from the mean pairwise cosine ``c``
    of the task vectors (one client: ``t = 1``; ``c`` clipped at 0: vectors pointing apart stay at the base)."""
    n = taus.shape[0]
    if n < 2:
        return 1.0
    flat = taus.reshape(n, -1)
    norms = flat.norm(dim=1)
    if bool((norms == 0).any()):
        return 0.0
    cos = (flat @ flat.T) / (norms[:, None] * norms[None, :])
    c = max(0.0, float((cos.sum() - cos.diagonal().sum()) / (n * (n - 1))))
    return n * c / (1.0 + (n - 1) * c)
