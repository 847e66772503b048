"""The baseline: Flower's FedAvg aggregation, unchanged, with what a fair comparison needs around it; or,
with ``reduce``, Flower's robust coordinate-wise aggregates (FedMedian, FedTrimmedAvg)."""

from __future__ import annotations

from typing import Any

from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedlmc.averaging import REDUCES, robust_merge
from fedlmc.options import one_of

from .base import FedlmcStrategy


class ReportingFedAvg(FedlmcStrategy):
    """Flower's FedAvg aggregation of the replies that pass fedlmc's validation, plus the model config in
    every message and a per-round history: the baseline the other strategies are compared with.

    Parameters
    ----------
    reduce : {"mean", "median", "trimmed"}, default "mean"
        "median" / "trimmed" take the coordinate-wise median / trimmed mean instead, as Flower's
        FedMedian / FedTrimmedAvg do.
    trim : float, default 0.2
        "trimmed": the fraction cut at each end of every coordinate.
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    def __init__(self, *, reduce: str = "mean", trim: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reduce, self.trim = one_of(reduce, REDUCES, "reduce"), trim

    def combine(self, server_round, replies, models, weights):
        if self.reduce != "mean":
            return robust_merge(models, self.reduce, self.trim), {"kept": self.reduce}, None
        arrays = aggregate_arrayrecords([m.content for m in replies], self.weighted_by_key)
        return self.model_of(arrays), {"kept": "average"}, None
