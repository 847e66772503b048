"""The baseline: Flower's FedAvg aggregation, unchanged, with what a fair comparison needs around it."""
from __future__ import annotations

import time
from typing import Any, Optional

from flwr.serverapp.strategy import FedAvg

from .aligned import FedlmcMixin
from .records import model_from_arrays


class ReportingFedAvg(FedlmcMixin, FedAvg):
    """Flower's FedAvg aggregation, plus the model config in every message and a per-round history."""

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
        replies = list(replies)
        t0 = time.time()
        arrays, metrics = super().aggregate_train(server_round, replies)
        record: dict[str, Any] = {"round": server_round, "strategy": "FedAvg", "align_seconds": time.time() - t0}
        if arrays is not None and self.report_data is not None:
            valid, _ = self._check_and_log_replies(replies, is_train=True)
            models, weights = self.reply_models([m.content for m in valid])
            self.report(record, models, weights, model_from_arrays(arrays, self.global_config), None)
        self.history.append(record)
        return arrays, metrics
