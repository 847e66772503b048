"""The baseline: Flower's FedAvg aggregation, unchanged, with what a fair comparison needs around it; or,
with ``reduce``, Flower's robust coordinate-wise aggregates (FedMedian, FedTrimmedAvg)."""

from __future__ import annotations

from typing import Any, Optional

from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedlmc.merging.averaging import robust_merge
from fedlmc.options import Robust
from fedlmc.strategies.base import FedlmcStrategy
from fedlmc.strategies.registry import Build, register


class AverageBase(FedlmcStrategy):
    """Flower's FedAvg mean of the replies that pass fedlmc's validation: what the strategies that change
    what is averaged, or how the mean is stepped, start from. It takes no ``robust``: a strategy that
    cannot apply a robust reduction does not accept one.

    Parameters
    ----------
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    def combine(self, server_round, replies, models, weights):
        arrays = aggregate_arrayrecords([m.content for m in replies], self.weighted_by_key)
        return self.model_of(arrays), {"kept": "average"}, None


class AverageFedAvg(AverageBase):
    """Flower's FedAvg aggregation of the replies that pass fedlmc's validation, plus the model config in
    every message and a per-round history: the baseline the other strategies are compared with.

    Parameters
    ----------
    robust : Robust, optional
        ``Robust(reduce="median" / "trimmed")`` takes the coordinate-wise median / trimmed mean instead,
        as Flower's FedMedian / FedTrimmedAvg do (``fedlmc.options.Robust``).
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    def __init__(self, *, robust: Optional[Robust] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.robust = robust if robust is not None else Robust()

    def combine(self, server_round, replies, models, weights):
        if self.robust.reduce != "average":
            return robust_merge(models, self.robust.reduce, self.robust.trim), {"kept": self.robust.reduce}, None
        return super().combine(server_round, replies, models, weights)


# ---- registration --------------------------------------------------------------------------------


@register(
    "average",
    summary="Flower's FedAvg of the validated replies (FedMedian / FedTrimmedAvg with reduce)",
    reduce=True,
    example="AverageFedAvg()",
)
def _average(b: Build):
    return AverageFedAvg(**b.common(), **b.robust())


@register(
    "deep-only",
    summary="FedAvg of the full-depth replies alone (mixed depths: a shallower reply is excluded, with the reason)",
    mixed_depths=True,
    example="AverageFedAvg()",
)
def _deep_only(b: Build):
    return AverageFedAvg(**b.common())
