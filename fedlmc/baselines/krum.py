"""Krum and Multi-Krum (Blanchard et al., NeurIPS 2017) on the raw replies: Flower's own selection with
fedlmc's validation, the raw-coordinate baseline for screening modulo symmetries."""

from __future__ import annotations

from typing import Any, Optional

from flwr.serverapp.strategy.multikrum import select_multikrum
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedlmc.strategies.base import node_of
from fedlmc.strategies.fedavg import AverageBase
from fedlmc.strategies.registry import Build, register


class KrumFedAvg(AverageBase):
    """Flower's Krum / Multi-Krum on the raw replies (``flwr.serverapp.strategy.MultiKrum``'s own
    ``select_multikrum``), with fedlmc's validation and a record of the replies it left out: the
    raw-coordinate baseline for screening modulo symmetries (``AlignedFedAvg(screen=...)``).

    Parameters
    ----------
    num_malicious_nodes : int, default 1
        Krum's f: each reply's score sums its squared distances to its M − f − 2 nearest replies.
    num_nodes_to_select : int or None, default None
        How many of the lowest-scoring replies are averaged: 1 is Krum; None: M − f (Multi-Krum keeping
        all but f).
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    def __init__(self, *, num_malicious_nodes: int = 1, num_nodes_to_select: Optional[int] = None, **kwargs: Any):
        super().__init__(**kwargs)
        if num_malicious_nodes < 0 or (num_nodes_to_select is not None and num_nodes_to_select < 1):
            raise ValueError(
                f"num_malicious_nodes must be >= 0 and num_nodes_to_select >= 1 (or None), got "
                f"{num_malicious_nodes} and {num_nodes_to_select}"
            )
        self.num_malicious_nodes, self.num_nodes_to_select = num_malicious_nodes, num_nodes_to_select

    def combine(self, server_round, replies, models, weights):
        keep, fields = self._select(server_round, replies)
        for seq in (replies, models, weights):
            seq[:] = [seq[i] for i in keep]
        arrays = aggregate_arrayrecords([m.content for m in replies], self.weighted_by_key)
        return self.model_of(arrays), fields, None

    def combine_arrays(self, server_round, replies, weights):
        keep, fields = self._select(server_round, replies)
        return aggregate_arrayrecords([replies[i].content for i in keep], self.weighted_by_key), fields

    def _select(self, server_round: int, replies: list) -> tuple[list[int], dict]:
        """The indices of the replies Flower's Multi-Krum selection keeps (the others are excluded, each
        with a reason) and the round record's fields."""
        contents = [m.content for m in replies]
        f = self.num_malicious_nodes
        select = self.num_nodes_to_select or max(1, len(replies) - f)
        chosen = {id(c) for c in select_multikrum(contents, num_malicious_nodes=f, num_nodes_to_select=select)}
        nodes = [node_of(m) for m in replies]
        left_out = [i for i, c in enumerate(contents) if id(c) not in chosen]
        for i in left_out:
            self.exclude(server_round, nodes[i], f"Krum (raw coordinates, f={f}): not among the {select} selected")
        screened = {"method": "krum-raw", "excluded": [nodes[i] for i in left_out]}
        keep = [i for i in range(len(replies)) if i not in left_out]
        return keep, {"kept": "krum" if select == 1 else "multikrum", "screen": screened}


@register(
    "krum",
    summary="Flower's Krum on the raw replies (f = malicious)",
    example="KrumFedAvg(num_malicious_nodes=1, num_nodes_to_select=1)",
)
def _krum(b: Build):
    return KrumFedAvg(**b.common(), num_malicious_nodes=b.settings.malicious, num_nodes_to_select=1)


@register(
    "multikrum",
    summary="Flower's Multi-Krum on the raw replies (all but f = malicious)",
    example="KrumFedAvg(num_malicious_nodes=1)",
)
def _multikrum(b: Build):
    return KrumFedAvg(**b.common(), num_malicious_nodes=b.settings.malicious, num_nodes_to_select=None)
