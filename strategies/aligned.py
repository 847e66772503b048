"""Aligned aggregation: Flower's FedAvg with the average taken modulo the models' symmetries.

``AlignedFedAvg`` is a drop-in subclass of ``flwr.serverapp.strategy.FedAvg``: it aligns every reply to
a universe seeded by the previous global model (``fedlmc.merge.universe_merge``), averages there
(weighted by ``num-examples``) and sends back a model of the clients' own shape (LayerNorm kept by
default). With a server-side ``guard_data`` set it also builds the plain average and keeps whichever
has the lower loss (do no harm); without one, weight matching's data-free identity guard applies.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO
from typing import Any, Optional

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from flwr.supercore import log

from fedlmc.merge import universe_merge
from fedlmc.train import evaluate

from .records import model_from_arrays, reply_config


class AlignedFedAvg(FedAvg):
    """FedAvg whose aggregation aligns replies along their symmetries before averaging.

    Parameters (beyond FedAvg's): ``model_config`` — the model's ``config.to_dict()`` when replies do
    not carry a ``model`` ConfigRecord; ``residual`` — "orthogonal" or "permutation"; ``form`` —
    "factored" (default; same-shape model) or "circuit"; ``keep_layernorm`` (default True: the global
    model stays an ordinary LayerNorm model); ``iterations`` — universe iterations; ``guard_data`` — a
    fedlmc data set (e.g. the preset's validation split) to compare aligned vs plain averaging on;
    ``guard_batches`` — how many of its batches to use.
    """

    def __init__(self, *, model_config: Optional[dict[str, Any]] = None, residual: str = "orthogonal",
                 form: str = "factored", keep_layernorm: bool = True, iterations: int = 3,
                 guard_data=None, guard_batches: int = 8, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self.model_config = model_config
        self.residual, self.form, self.keep_layernorm = residual, form, keep_layernorm
        self.iterations, self.guard_data, self.guard_batches = iterations, guard_data, guard_batches
        self._previous: Optional[ArrayRecord] = None
        self.history: list[dict[str, Any]] = []

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        self._previous = arrays  # the universe of this round starts from the current global model
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        contents = [m.content for m in valid]
        t0 = time.time()
        cfg = reply_config(contents[0], self.model_config)
        models = [model_from_arrays(c[self.arrayrecord_key], reply_config(c, cfg)) for c in contents]
        weights = [float(next(iter(c.metric_records.values()))[self.weighted_by_key]) for c in contents]
        init = model_from_arrays(self._previous, cfg) if self._previous is not None else None
        merged, transforms = universe_merge(models, weights=weights, init=init, iterations=self.iterations,
                                           form=self.form, keep_layernorm=self.keep_layernorm, residual=self.residual)
        seconds = time.time() - t0
        record = {"round": server_round, "align_seconds": seconds, "moved": [_distance(T) for T in transforms]}
        arrays = ArrayRecord(torch_state_dict={k: v.detach().float() for k, v in merged.state_dict().items()})
        if self.guard_data is not None:
            plain = aggregate_arrayrecords(contents, self.weighted_by_key)
            l_aligned = evaluate(merged, self.guard_data, max_batches=self.guard_batches)["loss"]
            l_plain = evaluate(model_from_arrays(plain, cfg), self.guard_data, max_batches=self.guard_batches)["loss"]
            record.update(guard_aligned=l_aligned, guard_plain=l_plain, kept="aligned" if l_aligned <= l_plain else "plain")
            if l_plain < l_aligned:
                arrays = plain
            log(INFO, "AlignedFedAvg round %d: kept %s (aligned %.4f vs plain %.4f on server data)",
                server_round, record["kept"], l_aligned, l_plain)
        log(INFO, "AlignedFedAvg round %d: aligned %d replies in %.2fs, mean transform distance %.4f",
            server_round, len(models), seconds, sum(record["moved"]) / len(models))
        self.history.append(record)
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        return arrays, metrics


def _distance(T) -> float:
    """How far a transform moved from the identity: ‖O − I‖_F/√d plus the fraction of moved units."""
    total = 0.0
    for name, el in T.elements.items():
        if el.is_floating_point() and el.dim() == 2:
            total += float((el - torch.eye(*el.shape, dtype=el.dtype)).norm() / el.shape[0] ** 0.5)
        elif not el.is_floating_point():
            total += float((el != torch.arange(len(el))).float().mean())
    return total
