"""FedDF (Lin et al., NeurIPS 2020): FedAvg's mean distilled toward the replies' output ensemble on the
server's unlabelled data; ``DistilledFedAvg`` with ``Distill(student="average")``."""

from __future__ import annotations

from fedlmc.strategies.distilled import DISTILL_KEYS, distilled_strategy
from fedlmc.strategies.registry import Build, register


@register(
    "feddf",
    summary="FedDF, FedAvg's mean distilled toward the replies' ensemble on the server's unlabelled data",
    server_data=True,
    example='DistilledFedAvg(model=model, distill=Distill(data=data, student="average"))',
    keys=DISTILL_KEYS,
)
def _feddf(b: Build):
    return distilled_strategy(b, "average")
