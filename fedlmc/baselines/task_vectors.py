"""Task-vector merges of models fine-tuned from one base: Task Arithmetic, TIES, DARE and Model Stock.

A client's task vector is ``τᵢ = θᵢ − θ_base``. Every method combines the task vectors tensor by tensor
and adds the result back to the base (``TaskMerge`` holds the knobs; ``TaskVectorFedAvg`` runs them
as a Flower strategy, registered as ``task-arithmetic``, ``ties``, ``dare`` and ``model-stock``). The
definitions are mergekit's (``task_arithmetic``, ``ties``, ``dare_linear``, ``model_stock``), so a fedlmc
merge and a mergekit merge of the same tensors agree:

* ``task-arithmetic`` (Ilharco et al., ICLR 2023): ``θ = θ_base + λ · Σ wᵢ τᵢ``, the weights summed, not
  normalised (``normalize=True`` divides by ``Σ wᵢ``; with it, ``λ = 1`` is FedAvg).
* ``ties`` (Yadav et al., NeurIPS 2023): each τᵢ keeps its ``int(density · n)`` largest-magnitude
  entries (at least one; trim); each coordinate's sign is that of the weighted sum of the trimmed
  vectors, ``+`` where the sum is 0 (elect); the coordinate is the weighted sum of the trimmed entries of
  that sign, divided by their weights' sum (disjoint mean, ``normalize=True`` by default); then ``λ``.
* ``dare`` (Yu et al., ICML 2024): each entry of every τᵢ is dropped with probability ``drop`` (mergekit's
  ``density`` is ``1 − drop``) and the survivors rescaled, so that the vector keeps its L1 norm
  (``rescale="l1"``, mergekit's) or by ``1 / (1 − drop)`` (``rescale="inverse"``, the paper's); then
  Task Arithmetic.
* ``model-stock`` (Jang et al., ECCV 2024): per tensor, the mean cosine ``c`` between the task vectors
  of every pair of clients gives ``t = N c / (1 + (N − 1) c)``, and ``θ = t · θ_avg + (1 − t) · θ_base``
  (``θ_avg`` the clients' plain mean). ``c`` is not clipped: vectors pointing apart extrapolate away from
  the mean; where ``1 + (N − 1) c`` vanishes, the base. One client alone is kept as it is (mergekit asks
  for two).

In a federation the weights are the clients' example counts rescaled to mean 1 (``client_weights``): a
client with an average share weighs 1, mergekit's usual weight. Tensors that are not floating point are
taken from the base.
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
RESCALES = ("l1", "inverse")
_NORMALIZE = {"task-arithmetic": False, "ties": True, "dare": False}  # mergekit's defaults
_KNOBS = {"density": ("ties", 0.2), "drop": ("dare", 0.9), "rescale": ("dare", "l1")}


@dataclass(frozen=True)
class TaskMerge:
    """How task vectors (clients' models minus the shared base) are merged (``task_vector_merge``), by
    mergekit's definitions. A knob the method does not use is refused.

    Parameters
    ----------
    method : {"task-arithmetic", "ties", "dare", "model-stock"}, default "task-arithmetic"
        Task Arithmetic (the weighted sum), TIES (trim, elect sign, disjoint mean), DARE (random drop and
        rescale, then Task Arithmetic) or Model Stock (interpolate between the base and the clients' mean
        by how much their task vectors agree).
    scale : float, default 1.0
        λ, the merged task vector's scale (not Model Stock's).
    normalize : bool, optional
        Divide the weighted sum by the weights' sum (for TIES, by the agreeing entries' weights). Default
        mergekit's: ``False`` for task-arithmetic and dare, ``True`` for ties; not Model Stock's.
    density : float, optional
        TIES: the fraction of each task vector's largest-magnitude entries kept, ``int(density · n)``
        of ``n`` (at least one). Default 0.2.
    drop : float, optional
        DARE: the probability of dropping each entry (mergekit's ``density`` is ``1 − drop``). Default 0.9.
    rescale : {"l1", "inverse"}, optional
        DARE: the survivors scaled so that each task vector keeps its L1 norm (``"l1"``, mergekit's,
        the default) or by ``1 / (1 − drop)`` (``"inverse"``, the DARE paper's).
    seed : int, default 0
        DARE's random drops.
    """

    method: str = "task-arithmetic"
    scale: float = 1.0
    normalize: Optional[bool] = None
    density: Optional[float] = None
    drop: Optional[float] = None
    rescale: Optional[str] = None
    seed: int = 0

    def __post_init__(self) -> None:
        one_of(self.method, TASK_MERGES, "task merge")
        for knob, (owner, default) in _KNOBS.items():
            if self.method == owner:
                object.__setattr__(self, knob, default if getattr(self, knob) is None else getattr(self, knob))
            elif getattr(self, knob) is not None:
                raise ValueError(f"TaskMerge: {knob} is {owner}'s knob, not {self.method}'s")
        if self.method == "model-stock":
            if self.normalize is not None or self.scale != 1.0:
                raise ValueError("TaskMerge: model-stock has no normalize or scale (its ratio t sets the step)")
        elif self.normalize is None:
            object.__setattr__(self, "normalize", _NORMALIZE[self.method])
        if self.density is not None and not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if self.drop is not None and not 0.0 <= self.drop < 1.0:
            raise ValueError(f"drop must be in [0, 1), got {self.drop}")
        if self.rescale is not None:
            one_of(self.rescale, RESCALES, "rescale")


def client_weights(examples: Sequence[float]) -> list[float]:
    """The clients' task-vector weights in a federation: their example counts rescaled to mean 1 (equal
    clients weigh 1 each, mergekit's usual weight)."""
    total = float(sum(examples))
    if total <= 0:
        raise ValueError("client_weights needs example counts with a positive sum")
    return [float(x) * len(examples) / total for x in examples]


def task_vector_merge(
    base: StateDict,
    states: Sequence[StateDict],
    weights: Optional[Sequence[float]] = None,
    merge: Optional[TaskMerge] = None,
) -> StateDict:
    """The merge of ``states`` (fine-tuned from ``base``, the same keys and shapes) by ``merge.method``,
    with mergekit's per-model ``weights`` as given (default 1 each; Model Stock is unweighted, as
    published); ``merge`` default ``TaskMerge()``."""
    merge = merge if merge is not None else TaskMerge()
    n = len(states)
    w = torch.tensor([1.0] * n if weights is None else [float(x) for x in weights], dtype=torch.float64)
    if n == 0 or bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ValueError("task_vector_merge needs at least one state and non-negative weights with a positive sum")
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
    if merge.method == "model-stock":
        return stock_ratio(taus) * taus.mean(0)  # t · (θ_avg − θ_base)
    wb = w.reshape(-1, *([1] * (taus.dim() - 1)))
    if merge.method == "ties":
        taus = torch.stack([trim(t, merge.density) for t in taus])
    elif merge.method == "dare":
        taus = torch.stack([dropped(t, merge.drop, merge.rescale, gen) for t in taus])
    weighted = wb * taus
    if merge.method == "ties":
        elected = torch.where(weighted.sum(0) >= 0, 1.0, -1.0).to(taus.dtype)
        agree = (torch.sign(taus) == elected).to(taus.dtype)
        merged, divisor = (weighted * agree).sum(0), (wb * agree).sum(0)
        divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    else:
        merged, divisor = weighted.sum(0), w.sum()
    if merge.normalize:
        merged = merged / divisor
    return merge.scale * merged


def trim(tau: torch.Tensor, density: float) -> torch.Tensor:
    """``tau`` with all but its ``int(density · n)`` largest-magnitude entries (at least one) set to 0."""
    if density >= 1.0:
        return tau.clone()
    k = max(1, int(density * tau.numel()))
    keep = torch.zeros(tau.numel(), dtype=torch.bool)
    keep[tau.abs().flatten().topk(k).indices] = True
    return torch.where(keep.reshape(tau.shape), tau, torch.zeros_like(tau))


def dropped(tau: torch.Tensor, drop: float, rescale: str, gen: torch.Generator) -> torch.Tensor:
    """DARE: ``tau`` with each entry dropped with probability ``drop``, the survivors rescaled to ``tau``'s
    L1 norm (``"l1"``) or by ``1 / (1 − drop)`` (``"inverse"``)."""
    if drop <= 0.0:
        return tau.clone()
    kept = tau * (torch.rand(tau.shape, generator=gen, dtype=torch.float64) >= drop)
    if rescale == "inverse":
        return kept / (1.0 - drop)
    before, after = float(tau.abs().sum()), float(kept.abs().sum())
    return kept if before < 1e-7 or after < 1e-7 else kept * (before / after)


def stock_ratio(taus: torch.Tensor) -> float:
    """Model Stock's interpolation ratio ``t = N c / (1 + (N − 1) c)`` from the mean pairwise cosine ``c``
    of the task vectors (one client: ``t = 1``; a vanishing task vector has cosine 0; where the
    denominator vanishes, ``t = 0``: the base)."""
    n = taus.shape[0]
    if n < 2:
        return 1.0
    flat = taus.reshape(n, -1)
    norms = flat.norm(dim=1)
    cos = ((flat @ flat.T) / (norms[:, None] * norms[None, :]).clamp(min=1e-6)).clamp(-1.0, 1.0)
    c = float((cos.sum() - cos.diagonal().sum()) / (n * (n - 1)))
    denominator = 1.0 + (n - 1) * c
    return 0.0 if abs(denominator) < 1e-6 else n * c / denominator


class TaskVectorFedAvg(AverageBase):
    """Task-vector merges for federations that fine-tune one shared base (Task Arithmetic, TIES, DARE,
    Model Stock: ``fedlmc.baselines.task_vectors``): each reply's task vector is its model minus the global model
    the round sent, and the merged task vector is added to that model.

    Parameters
    ----------
    merge : TaskMerge, optional
        The method and its knobs (``fedlmc.baselines.TaskMerge``); default Task Arithmetic at λ = 1, the
        clients' task vectors summed (``normalize=True``, or ``scale=1/N`` for equal clients, is FedAvg).
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
        base.load_state_dict(task_vector_merge(base.state_dict(), states, client_weights(weights), self.merge))
        return base, {"kept": self.merge.method}, None

    def combine_arrays(self, server_round, replies, weights):
        base = self._base().to_torch_state_dict()
        states = [m.content[self.arrayrecord_key].to_torch_state_dict() for m in replies]
        merged = task_vector_merge(base, states, client_weights(weights), self.merge)
        return ArrayRecord(torch_state_dict=merged), {"kept": self.merge.method}


def _task_merge(method: str, summary: str) -> None:
    """Register the task-vector merge ``method`` (``TaskMerge``'s defaults)."""

    @register(method, summary=summary, example=f'TaskVectorFedAvg(merge=TaskMerge(method="{method}"))')
    def _build(b: Build):
        return TaskVectorFedAvg(**b.common(), merge=TaskMerge(method=method))


_task_merge("task-arithmetic", "Task Arithmetic, the clients' task vectors summed (mergekit's λ = 1)")
_task_merge("ties", "TIES, task vectors trimmed to 20 %, sign elected, agreeing entries averaged")
_task_merge("dare", "DARE, 90 % of each task vector dropped at random, the rest rescaled")
_task_merge("model-stock", "Model Stock, the clients' mean pulled to the base by their angle")
