"""Training alone: no federation. Every client is sent back its own last model each round, so it trains
on its own data only; the reference a federation of different devices must beat on each client's own
model (what a 4-layer phone gains by federating with 6-layer workstations, and what it loses)."""

from __future__ import annotations

from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedlmc.merging.widths import shape_of
from fedlmc.models import ARCHS
from fedlmc.strategies.base import node_of, require_nodes
from fedlmc.strategies.hetero import HeteroWidthFedAvg
from fedlmc.strategies.registry import Build, register


class LocalFedAvg(HeteroWidthFedAvg):
    """Each client trains alone: after round 1 it is sent its own last reply (its own width and depth).
    The global model is Flower's FedAvg of the replies of the global architecture, a reference that no
    client trains from; after a restart every client starts again from it.

    Parameters
    ----------
    **kwargs
        ``FedlmcStrategy``'s parameters (``model``: the global model or config, required) and Flower's
        ``FedAvg``'s.
    """

    def __init__(self, **kwargs) -> None:
        unused = sorted(k for k in ("matching", "universe", "guard", "refine") if kwargs.get(k) is not None)
        if unused:
            raise ValueError(f"LocalFedAvg aligns and merges nothing: {', '.join(unused)} would be ignored")
        super().__init__(**kwargs)
        self.own: dict[int, object] = {}  # client -> its last reply

    def combine(self, server_round, replies, models, weights):
        nodes = require_nodes(self, [node_of(m) for m in replies], "sending each node its own model")
        keys = [self.client_key(n) for n in nodes]
        self.own.update(zip(keys, models))
        ref = ARCHS[self.global_config["arch"]][0].from_dict(self.global_config)
        full = [
            i for i, m in enumerate(models) if (shape_of(m.config), m.config.n_layer) == (shape_of(ref), ref.n_layer)
        ]
        record = {"alone": keys, "depths": [int(m.config.n_layer) for m in models]}
        if not full:  # no reply of the global architecture: the reference stays
            return self.previous_model(), {**record, "kept": "previous"}, None
        arrays = aggregate_arrayrecords([replies[i].content for i in full], self.weighted_by_key)
        return self.model_of(arrays), {**record, "kept": "average"}, None

    def _own_model(self, key: int, universe=None):
        return self.own.get(key)


@register(
    "local",
    summary="no federation: each client trains alone (sent back its own model); the global model a reference",
    mixed_widths=True,
    mixed_depths=True,
    example="LocalFedAvg(model=model)",
    client="builds its model at the width and depth of the arrays it receives",
)
def _local(b: Build):
    return LocalFedAvg(**b.common())
