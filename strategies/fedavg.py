"""The baseline: Flower's FedAvg aggregation, unchanged, with what a fair comparison needs around it."""
from __future__ import annotations

import time
from typing import Any, Optional

from flwr.serverapp.strategy import FedAvg

from .aligned import FedlmcMixin
from .records import model_from_arrays


class ReportingFedAvg(FedlmcMixin, FedAvg):
    """Flower's FedAvg aggregation of the replies that pass fedlmc's validation, plus the model config in
    every message and a per-round history."""

    def __init__(self, *, model_config: Optional[dict[str, Any]] = None, report_data=None,
                 report_batches: Optional[int] = None, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self._init_fedlmc(model_config, report_data, report_batches)

    def configure_train(self, server_round, arrays, config, grid):
        server_round = self.real_round(server_round)
        return super().configure_train(server_round, arrays, self._with_config(config), grid)

    def configure_evaluate(self, server_round, arrays, config, grid):
        server_round = self.real_round(server_round)
        return super().configure_evaluate(server_round, arrays, self._with_config(config), grid)

    def aggregate_train(self, server_round, replies):
        server_round = self.real_round(server_round)
        accepted = self.accept(server_round, replies)  # the same reply validation as every fedlmc strategy
        if accepted is None:
            return None, None
        valid, models, weights = accepted
        t0 = time.time()
        arrays, metrics = super().aggregate_train(server_round, valid)
        record = self.round_record(server_round, align_seconds=time.time() - t0, kept="plain")
        if arrays is not None:
            self.report(record, models, weights, model_from_arrays(arrays, self.global_config), None)
        self.history.append(record)
        return arrays, metrics
