"""Mixed-width federations: clients train models of different widths.

* ``HeteroWidthFedAvg`` — every reply is lifted into the universe's width (exact zero-padding, then
  rectangular-orthogonal / permutation alignment by ``universe_merge``), aggregated there, and each
  client is sent ``project(universe, T_client)``: a model of its own width in its own coordinates.
  A node the server has not aligned yet receives the universe and slices it (HeteroFL-style prefix).
* ``SlicingFedAvg`` — the HeteroFL baseline: clients train index prefixes of one global model; each
  global entry is averaged over the clients whose sub-model contains it.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable
from logging import INFO
from typing import Any, Optional

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedlmc.merge import project, universe_merge
from fedlmc.models import from_config
from fedlmc.widths import prefix_average

from .aligned import FedlmcMixin, transform_distance
from .records import MODEL_CONFIG_KEY, state_arrays


class HeteroWidthFedAvg(FedlmcMixin, FedAvg):
    """Aggregate clients of different widths in one universe; send each its own-width projection.

    ``model_config`` is the universe's (widest) architecture. Options as ``AlignedFedAvg``
    (``iterations``, ``residual``, ``report_data``...). The global model is the universe in canonical
    (RMSNorm) form: its config travels with it (``model-config``).
    """

    def __init__(self, *, model_config: Optional[dict[str, Any]] = None, residual: str = "orthogonal",
                 iterations: int = 3, report_data=None, report_batches: Optional[int] = None,
                 device: Optional[str] = None, min_replies: int = 1, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self._init_fedlmc(model_config, report_data, report_batches, min_replies)
        self.residual, self.iterations, self.device = residual, iterations, device
        self._transforms: dict[int, Any] = {}  # node id -> its transform into the current universe
        self._universe = None

    def model_for(self, node: int):
        """The model node ``node`` is sent: the universe projected to its own width and coordinates
        (None for a node not aligned yet: it gets the universe and slices it)."""
        T = self._transforms.get(node)
        if T is None or self._universe is None:
            return None
        return project(self._universe, T)

    def _per_node(self, messages: Iterable[Message], config: ConfigRecord, message_type: str) -> list[Message]:
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            own = self.model_for(node)
            if own is None:
                out.append(msg)
                continue
            cfg = ConfigRecord(dict(config))
            cfg[MODEL_CONFIG_KEY] = json.dumps(own.config.to_dict())
            content = RecordDict({self.arrayrecord_key: state_arrays(own), self.configrecord_key: cfg})
            out.append(Message(content=content, message_type=message_type, dst_node_id=node))
        return out

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        server_round = self.real_round(server_round)
        self._previous = arrays
        msgs = super().configure_train(server_round, arrays, self._with_config(config), grid)
        return self._per_node(msgs, config, MessageType.TRAIN)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        server_round = self.real_round(server_round)
        msgs = super().configure_evaluate(server_round, arrays, self._with_config(config), grid)
        return self._per_node(msgs, config, MessageType.EVALUATE)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        server_round = self.real_round(server_round)
        # replies differ in shapes (and may differ in norm form): each is checked against its own declared config
        accepted = self.accept(server_round, replies, same_shape=False)
        if accepted is None:
            return None, None
        valid, models, weights = accepted
        contents = [m.content for m in valid]
        nodes = [m.metadata.src_node_id for m in valid]
        t0 = time.time()
        init = self.previous_model()
        universe, transforms = universe_merge(models, weights=weights, init=init, iterations=self.iterations,
                                              residual=self.residual, device=self.device)
        seconds = time.time() - t0
        self._universe = universe
        self._transforms.update(zip(nodes, transforms))
        record = self.round_record(server_round, align_seconds=seconds, moved=[transform_distance(T) for T in transforms],
                                   widths=[int(m.config.d_model) for m in models])
        self.report(record, models, weights, universe, None)
        log(INFO, "HeteroWidthFedAvg round %d: %d replies of widths %s aligned into width %d in %.2fs",
            server_round, len(models), sorted(set(record["widths"])), universe.config.d_model, seconds)
        self.history.append(record)
        self.global_config = universe.config.to_dict()
        return state_arrays(universe), self.train_metrics_aggr_fn(contents, self.weighted_by_key)


class SlicingFedAvg(FedlmcMixin, FedAvg):
    """HeteroFL-style baseline for mixed widths: clients train index prefixes of the global model
    (they slice what they receive); aggregation averages each entry over the clients that hold it."""

    def __init__(self, *, model_config: Optional[dict[str, Any]] = None, report_data=None,
                 report_batches: Optional[int] = None, min_replies: int = 1, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self._init_fedlmc(model_config, report_data, report_batches, min_replies)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        server_round = self.real_round(server_round)
        self._previous = arrays
        return super().configure_train(server_round, arrays, self._with_config(config), grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        server_round = self.real_round(server_round)
        return super().configure_evaluate(server_round, arrays, self._with_config(config), grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        server_round = self.real_round(server_round)
        if self._previous is None or self.global_config is None:
            raise ValueError("SlicingFedAvg needs model_config and a previous global model (configure_train)")
        accepted = self.accept(server_round, replies, same_shape=False)
        if accepted is None:
            return None, None
        valid, models, weights = accepted
        contents = [m.content for m in valid]
        t0 = time.time()
        previous = self._previous.to_torch_state_dict()
        total = sum(weights)
        sd = prefix_average([m.state_dict() for m in models], [w / total for w in weights], previous)
        result = from_config(self.global_config)
        result.load_state_dict(sd)
        record = self.round_record(server_round, align_seconds=time.time() - t0,
                                   widths=[int(m.config.d_model) for m in models])
        self.report(record, models, weights, result.eval(), None)
        self.history.append(record)
        return state_arrays(result), self.train_metrics_aggr_fn(contents, self.weighted_by_key)
