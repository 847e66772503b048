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
from logging import INFO
from typing import Any, Optional

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.supercore import log

from fedlmc.models import from_config
from fedlmc.symmetry import spec_for
from fedlmc.universe import project, universe_merge
from fedlmc.widths import prefix_average

from .aligned import transform_distance
from .base import FedlmcStrategy
from .records import MODEL_CONFIG_KEY, state_arrays


class HeteroWidthFedAvg(FedlmcStrategy):
    """Aggregate clients of different widths in one universe; send each its own-width projection.

    ``model_config`` is the universe's (widest) architecture. Options as ``AlignedFedAvg``
    (``iterations``, ``residual``...). The global model is the universe in canonical (RMSNorm) form: its
    config travels with it (``model-config``).
    """

    needs_architecture = True

    same_shape = False  # replies differ in shape: each is checked against its own declared config

    def __init__(self, *, residual: str = "orthogonal", iterations: int = 3, device: Optional[str] = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.adapter is not None:
            raise ValueError("HeteroWidthFedAvg aligns fedlmc models, whose replies declare their own width "
                             "(a model ConfigRecord); Hugging Face clients of several widths are not supported yet")
        self.residual, self.iterations, self.device = residual, iterations, device
        self.transforms: dict[int, Any] = {}  # node id -> its transform into the current universe
        self._universe = None

    def model_for(self, node: int):
        """The model node ``node`` is sent: the universe projected to its own width and coordinates
        (None for a node not aligned yet: it gets the universe and slices it)."""
        T = self.transforms.get(node)
        if T is None or self._universe is None:
            return None
        return project(self._universe, T)

    def messages_for(self, messages, config: ConfigRecord, message_type: str) -> list[Message]:
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

    def combine(self, server_round, replies, models, weights):
        universe, transforms = universe_merge(models, weights=weights, start=self.previous_model(),
                                              iterations=self.iterations, residual=self.residual, device=self.device)
        self._universe = universe
        self.transforms.update(zip([m.metadata.src_node_id for m in replies], transforms))
        widths = [int(m.config.d_model) for m in models]
        log(INFO, "HeteroWidthFedAvg round %d: %d replies of widths %s aligned into width %d", server_round,
            len(models), sorted(set(widths)), universe.config.d_model)
        return universe, {"moved": [transform_distance(T, spec_for(universe)) for T in transforms], "widths": widths}, None

    def state(self) -> dict[str, Any]:
        return {**super().state(), "transforms": dict(self.transforms)}

    def load_state(self, state: dict[str, Any], round_offset: int) -> None:
        super().load_state(state, round_offset)
        self.transforms = dict(state.get("transforms", {}))


class SlicingFedAvg(FedlmcStrategy):
    """HeteroFL-style baseline for mixed widths: clients train index prefixes of the global model
    (they slice what they receive); aggregation averages each entry over the clients that hold it."""

    needs_architecture = True

    same_shape = False

    def combine(self, server_round, replies, models, weights):
        if self._previous is None or self.global_config is None:
            raise ValueError("SlicingFedAvg needs model_config and a previous global model (configure_train)")
        total = sum(weights)
        sd = prefix_average([m.state_dict() for m in models], [w / total for w in weights],
                            self._previous.to_torch_state_dict())
        result = from_config(self.global_config)
        result.load_state_dict(sd)
        return result.eval(), {"widths": [int(m.config.d_model) for m in models]}, None
