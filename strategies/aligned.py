"""Aligned aggregation: Flower's FedAvg with the average taken modulo the models' symmetries.

``AlignedFedAvg`` is a drop-in subclass of ``flwr.serverapp.strategy.FedAvg``: it aligns every reply to
a universe seeded by the previous global model (``fedlmc.merge.universe_merge``), averages there
(weighted by ``num-examples``) and sends back a model of the clients' own shape (LayerNorm kept by
default). ``RefinedFedAvg`` adds Dirichlet learned refinement on a small server-side data set.

Do no harm: with a server-side ``guard_data`` set, the strategy also builds the plain average and keeps
whichever has the lower loss there (and logs which won, by how much); without one, weight matching's
data-free identity guard applies (the identity transform — plain averaging — is one of its candidates).
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any, Optional

import torch
import torch.nn as nn
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedlmc.merge import merge, universe_merge
from fedlmc.models import from_config
from fedlmc.train import evaluate

from .records import MODEL_CONFIG_KEY, model_from_arrays, reply_config, state_arrays


class FedlmcMixin:
    """What every fedlmc strategy shares: the global model's config travels with the arrays (ConfigRecord
    key ``model-config``), replies are turned into models, and each round leaves a ``history`` record.

    ``report_data`` (optional, e.g. the test split) makes every round also record each client model's
    loss, the plain average's and the aggregate's, so excess losses can be compared across strategies.
    """

    global_config: Optional[dict[str, Any]]
    history: list[dict[str, Any]]

    def _init_fedlmc(self, model_config, report_data, report_batches, min_replies: int = 1,
                     max_norm_ratio: float = 100.0) -> None:
        self.global_config = model_config
        self.report_data, self.report_batches = report_data, report_batches
        self.min_replies, self.max_norm_ratio = max(1, int(min_replies)), max_norm_ratio
        self.history = []
        self._previous: Optional[ArrayRecord] = None
        self._excluded: list[dict[str, Any]] = []
        self._failures: list[dict[str, Any]] = []

    def accept(self, server_round: int, replies: Iterable[Message], same_shape: bool = True):
        """The replies that pass validation (see ``strategies.validation``) as (messages, models, weights);
        each excluded reply gets one log line naming its node and the reason. Returns None (and logs that
        the previous global model is kept) when fewer than ``min_replies`` remain."""
        from .validation import InvalidReply, check_reply

        replies = list(replies)
        ok, failed = self._check_and_log_replies(replies, is_train=True, validate=False)
        self._failures = [{"node": m.metadata.src_node_id, "reason": str(m.error.reason)} for m in failed]
        log(INFO, "%s round %d: replies from nodes %s; failures from nodes %s", type(self).__name__, server_round,
            sorted(m.metadata.src_node_id for m in ok) or "none", [f["node"] for f in self._failures] or "none")
        ref_norm = None
        if self._previous is not None:
            ref_norm = sum(float(t.double().pow(2).sum()) for t in self._previous.to_torch_state_dict().values()) ** 0.5
        kept, models, weights, excluded = [], [], [], []
        for msg in ok:
            node = msg.metadata.src_node_id
            try:
                cfg, sd, w = check_reply(msg.content, arrays_key=self.arrayrecord_key, weight_key=self.weighted_by_key,
                                         reference_config=self.global_config, reference_norm=ref_norm,
                                         same_shape=same_shape, max_norm_ratio=self.max_norm_ratio)
            except InvalidReply as e:
                log(WARNING, "%s round %d: excluded the reply of node %s: %s", type(self).__name__, server_round, node, e)
                excluded.append({"node": node, "reason": str(e)})
                continue
            model = from_config(cfg)
            model.load_state_dict({k: v.float() for k, v in sd.items()})
            kept.append(msg)
            models.append(model.eval())
            weights.append(w)
        self._excluded = excluded
        if len(kept) < self.min_replies:
            log(WARNING, "%s round %d: only %d valid replies (minimum %d): keeping the previous global model",
                type(self).__name__, server_round, len(kept), self.min_replies)
            self.history.append(self.round_record(server_round, kept="previous", align_seconds=0.0))
            return None
        return kept, models, weights

    def round_record(self, server_round: int, **fields: Any) -> dict[str, Any]:
        """The history record of a round: what every strategy logs (replies excluded by validation,
        failed messages) plus ``fields``."""
        return {"round": server_round, "strategy": type(self).__name__, **fields,
                "excluded": self._excluded, "failures": self._failures}

    round_offset: int = 0  # rounds completed before this run started (a resumed run continues numbering)

    def real_round(self, server_round: int) -> int:
        """Flower's round counter shifted by ``round_offset`` (set when a run resumes from a checkpoint)."""
        return server_round + getattr(self, "round_offset", 0)

    def _with_config(self, config: ConfigRecord) -> ConfigRecord:
        if self.global_config is not None:
            config[MODEL_CONFIG_KEY] = json.dumps(self.global_config)
        return config

    def previous_model(self) -> Optional[nn.Module]:
        if self._previous is None or self.global_config is None:
            return None
        return model_from_arrays(self._previous, self.global_config)

    def reply_models(self, contents) -> tuple[list[nn.Module], list[float]]:
        models = [model_from_arrays(c[self.arrayrecord_key], reply_config(c, self.global_config)) for c in contents]
        weights = [float(next(iter(c.metric_records.values()))[self.weighted_by_key]) for c in contents]
        return models, weights

    def _loss(self, model: nn.Module, data, batches) -> float:
        return float(evaluate(model, data, max_batches=batches)["loss"])

    def report(self, record: dict[str, Any], models: list[nn.Module], weights: list[float], result: nn.Module,
               plain: Optional[nn.Module]) -> None:
        if self.report_data is None:
            return
        clients = [self._loss(m, self.report_data, self.report_batches) for m in models]
        record["client_losses"] = clients
        record["mean_client_loss"] = sum(clients) / len(clients)
        record["global_loss"] = self._loss(result, self.report_data, self.report_batches)
        record["excess"] = record["global_loss"] - record["mean_client_loss"]
        if plain is not None:
            record["plain_loss"] = self._loss(plain, self.report_data, self.report_batches)
            record["plain_excess"] = record["plain_loss"] - record["mean_client_loss"]


class AlignedFedAvg(FedlmcMixin, FedAvg):
    """FedAvg whose aggregation aligns replies along their symmetries before averaging.

    Parameters (beyond FedAvg's): ``model_config`` — the global model's ``config.to_dict()`` (sent to
    clients, and used when replies carry no ``model`` ConfigRecord); ``residual`` — "orthogonal" or
    "permutation"; ``form`` — "factored" (default; same-shape model) or "circuit"; ``keep_layernorm``
    (default True: the global model stays an ordinary LayerNorm model); ``iterations`` — universe
    iterations; ``guard_data`` — a fedlmc data set (e.g. the preset's validation split) on which the
    aligned aggregate must beat plain averaging to be kept; ``guard_batches`` — how many of its batches
    to use; ``report_data``/``report_batches`` — see ``FedlmcMixin``; ``device`` — where matching runs;
    ``min_replies`` — fewest valid replies a round aggregates (else the previous model is kept);
    ``max_norm_ratio`` — a reply whose weight norm exceeds this multiple of the global model's is excluded.
    """

    method = "wm"

    def __init__(self, *, model_config: Optional[dict[str, Any]] = None, residual: str = "orthogonal",
                 form: str = "factored", keep_layernorm: bool = True, iterations: int = 3,
                 guard_data=None, guard_batches: Optional[int] = 8, report_data=None,
                 report_batches: Optional[int] = None, device: Optional[str] = None, min_replies: int = 1,
                 max_norm_ratio: float = 100.0, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self._init_fedlmc(model_config, report_data, report_batches, min_replies, max_norm_ratio)
        self.residual, self.form, self.keep_layernorm = residual, form, keep_layernorm
        self.iterations, self.guard_data, self.guard_batches = iterations, guard_data, guard_batches
        self.device = device

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        server_round = self.real_round(server_round)
        self._previous = arrays  # the universe of this round starts from the current global model
        return super().configure_train(server_round, arrays, self._with_config(config), grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        server_round = self.real_round(server_round)
        return super().configure_evaluate(server_round, arrays, self._with_config(config), grid)

    def align(self, models: list[nn.Module], weights: list[float], init: Optional[nn.Module]):
        """The aligned aggregate and each reply's transform (subclasses change how)."""
        return universe_merge(models, weights=weights, init=init, iterations=self.iterations, form=self.form,
                              keep_layernorm=self.keep_layernorm, residual=self.residual, device=self.device)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        server_round = self.real_round(server_round)
        accepted = self.accept(server_round, replies)
        if accepted is None:
            return None, None
        valid, models, weights = accepted
        contents = [m.content for m in valid]
        if self.global_config is None:
            self.global_config = models[0].config.to_dict()
        t0 = time.time()
        merged, transforms = self.align(models, weights, self.previous_model())
        seconds = time.time() - t0
        record = self.round_record(server_round, align_seconds=seconds, moved=[transform_distance(T) for T in transforms],
                                   kept="aligned")
        total = sum(weights)
        plain = merge(models, [w / total for w in weights]) if self.guard_data is not None or self.report_data is not None else None
        result = merged
        if self.guard_data is not None:
            l_aligned = self._loss(merged, self.guard_data, self.guard_batches)
            l_plain = self._loss(plain, self.guard_data, self.guard_batches)
            record.update(guard_aligned=l_aligned, guard_plain=l_plain)
            if l_plain < l_aligned:
                result, record["kept"] = plain, "plain"
            log(INFO, "%s round %d: kept %s (server loss aligned %.4f vs plain %.4f, Δ %+.4f)", type(self).__name__,
                server_round, record["kept"], l_aligned, l_plain, l_aligned - l_plain)
        self.report(record, models, weights, result, plain)
        record["seconds"] = time.time() - t0
        log(INFO, "%s round %d: aligned %d replies in %.2fs, mean distance from identity %.4f%s", type(self).__name__,
            server_round, len(models), seconds, sum(record["moved"]) / len(models),
            f", global loss {record['global_loss']:.4f}" if "global_loss" in record else "")
        self.history.append(record)
        self.global_config = result.config.to_dict()
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        return state_arrays(result), metrics


class RefinedFedAvg(AlignedFedAvg):
    """``AlignedFedAvg`` plus Dirichlet(``alpha``) learned refinement of every reply's alignment on a small
    server-side data set ``refine_data`` (``refine_steps`` steps; see ``fedlmc.matching.refine``). Keep
    ``guard_data`` disjoint from ``refine_data`` so the do-no-harm comparison stays honest."""

    method = "refine"

    def __init__(self, *, refine_data, alpha: float = 0.1, refine_steps: int = 100, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if refine_data is None:
            raise ValueError("RefinedFedAvg needs refine_data (a small server-side data set)")
        self.refine_data, self.alpha, self.refine_steps = refine_data, alpha, refine_steps

    def align(self, models, weights, init):
        return universe_merge(models, method="refine", weights=weights, init=init, iterations=self.iterations,
                              form=self.form, keep_layernorm=self.keep_layernorm, residual=self.residual,
                              data=self.refine_data, alpha=self.alpha, refine_steps=self.refine_steps, device=self.device)


def transform_distance(T) -> float:
    """How far a transform moved from the identity: ‖O − I‖_F/√d plus the fraction of moved units."""
    total = 0.0
    for name, el in T.elements.items():
        if el.is_floating_point() and el.dim() == 2:
            total += float((el - torch.eye(*el.shape, dtype=el.dtype)).norm() / el.shape[0] ** 0.5)
        elif not el.is_floating_point():
            total += float((el != torch.arange(len(el))).float().mean())
    return total
