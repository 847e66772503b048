"""Task-vector merges of models fine-tuned from one base: Task Arithmetic, TIES, DARE and Model Stock.

A client's task vector is ``τᵢ = θᵢ − θ_base``. Every method combines the task vectors tensor by tensor
and adds the result back to the base (``TaskMerge`` holds the knobs; ``TaskVectorFedAvg`` runs them
as a Flower strategy, registered as ``task-arithmetic``, ``ties``, ``dare`` and ``model-stock``):

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

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from flwr.app import ArrayRecord

from fedlmc.options import one_of
from fedlmc.strategies.base import loaded
from fedlmc.strategies.fedavg import AverageBase
from fedlmc.strategies.registry import Build, register
from fedlmc.symmetry import StateDict

TASK_MERGES = ("task-arithmetic", "ties", "dare", "model-stock")


@dataclass(frozen=True)
class TaskMerge:
    """How task vectors (clients' models minus the shared base) are merged (``task_vector_merge``).

    Parameters
    ----------
    method : {"task-arithmetic", "ties", "dare", "model-stock"}, default "task-arithmetic"
        Task Arithmetic (the weighted sum, FedAvg at ``scale=1``), TIES (trim, elect sign, disjoint
        mean), DARE (random drop and rescale, then Task Arithmetic) or Model Stock (interpolate between
        the base and the clients' mean by how much their task vectors agree).
    scale : float, default 1.0
        λ, the merged task vector's scale (task-arithmetic, ties, dare).
    density : float, default 0.2
        TIES: the fraction of each task vector's largest-magnitude entries kept.
    drop : float, default 0.9
        DARE: the probability of dropping each entry.
    seed : int, default 0
        DARE's random drops.
    """

    method: str = "task-arithmetic"
    scale: float = 1.0
    density: float = 0.2
    drop: float = 0.9
    seed: int = 0

    def __post_init__(self) -> None:
        one_of(self.method, TASK_MERGES, "task merge")
        if not 0.0 < self.density <= 1.0 or not 0.0 <= self.drop < 1.0:
            raise ValueError(f"density must be in (0, 1] and drop in [0, 1), got {self.density}, {self.drop}")


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


class TaskVectorFedAvg(AverageBase):
    """Task-vector merges for federations that fine-tune one shared base (Task Arithmetic, TIES, DARE,
    Model Stock: ``fedlmc.baselines.task_vectors``): each reply's task vector is its model minus the global model
    the round sent, and the merged task vector is added to that model.

    Parameters
    ----------
    merge : TaskMerge, optional
        The method and its knobs (``fedlmc.options.TaskMerge``); default Task Arithmetic at λ = 1, which
        is FedAvg.
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    def __init__(self, *, merge: Optional[TaskMerge] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.merge = merge if merge is not None else TaskMerge()

    def _base(self):
        if self._previous is None:
            raise RuntimeError(
                f"{type(self).__name__} merges task vectors from the global model: configure_train first"
            )
        return self._previous

    def combine(self, server_round, replies, models, weights):
        self._base()
        base = self.previous_model()
        states = [loaded(m).state_dict() for m in models]
        base.load_state_dict(task_vector_merge(base.state_dict(), states, weights, self.merge))
        return base, {"kept": self.merge.method}, None

    def combine_arrays(self, server_round, replies, weights):
        base = self._base().to_torch_state_dict()
        states = [m.content[self.arrayrecord_key].to_torch_state_dict() for m in replies]
        merged = task_vector_merge(base, states, weights, self.merge)
        return ArrayRecord(torch_state_dict=merged), {"kept": self.merge.method}


def _task_merge(method: str, summary: str) -> None:
    """Register the task-vector merge ``method`` (``TaskMerge``'s defaults)."""

    @register(method, summary=summary, example=f'TaskVectorFedAvg(merge=TaskMerge(method="{method}"))')
    def _build(b: Build):
        return TaskVectorFedAvg(**b.common(), merge=TaskMerge(method=method))


_task_merge("task-arithmetic", "Task Arithmetic, the clients' task vectors summed (λ = 1: FedAvg)")
_task_merge("ties", "TIES, task vectors trimmed to 20 %, sign elected, agreeing entries averaged")
_task_merge("dare", "DARE, 90 % of each task vector dropped at random, the rest rescaled")
_task_merge("model-stock", "Model Stock, the clients' mean pulled to the base by their angle")
