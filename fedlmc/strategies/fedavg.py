"""The baseline: Flower's FedAvg aggregation, unchanged, with what a fair comparison needs around it."""
from __future__ import annotations

from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from .base import FedlmcStrategy


class ReportingFedAvg(FedlmcStrategy):
    """Flower's FedAvg aggregation of the replies that pass fedlmc's validation, plus the model config in
    every message and a per-round history."""

    def combine(self, server_round, replies, models, weights):
        arrays = aggregate_arrayrecords([m.content for m in replies], self.weighted_by_key)
        return self.model_of(arrays), {"kept": "average"}, None
