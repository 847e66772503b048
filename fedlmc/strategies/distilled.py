"""Ensemble distillation: FedDF, and distillation started from the aligned or refined merge, at the
server or by the clients.

``DistilledFedAvg`` builds its start as ``AlignedFedAvg`` does (or as ``RefinedFedAvg`` does, with
``distill.refine``), or takes the replies' plain mean (``distill.student="average"``: FedDF, Lin et al.,
NeurIPS 2020), then trains it toward the replies' outputs (``fedlmc.merging.distill``): on the server's
unlabelled data toward their ensemble, or, with no server data, by the clients, each on its own data
toward the model it trained this round (``on_clients``). The do-no-harm guard then compares the
distilled model with the plain average, on the server's guard data or the clients' held-out data.
"""

from __future__ import annotations

import time
from typing import Any

from fedlmc.flower.on_clients import DISTILL_CODE
from fedlmc.merging.distill import distill as distill_model
from fedlmc.merging.distill import distill_on_clients
from fedlmc.options import Distill
from fedlmc.strategies.aligned import (
    REFINE_ON_CLIENTS,
    AlignedFedAvg,
    RefinedFedAvg,
    client_losses,
    refine_split,
    unconfirmed,
)
from fedlmc.strategies.base import loaded
from fedlmc.strategies.keys import Key, non_negative
from fedlmc.strategies.registry import Build, register


class DistilledFedAvg(AlignedFedAvg):
    """Ensemble distillation of each round's aggregate.

    Parameters
    ----------
    distill : Distill
        The distillation's data (the server's, unlabelled; None with ``on_clients``), start
        (``"average"``: FedDF; ``"merge"``: this strategy's aligned merge, refined first when
        ``distill.refine`` is given), budget, temperature and stopping rule (``fedlmc.options.Distill``).
        Its last quarter is held out for the checks unless ``check_data`` is given.
    **kwargs
        ``AlignedFedAvg``'s parameters (the matching, universe and guard of the merge it starts from;
        ``on_clients``: the refinement, the distillation and the guard by the clients).
    """

    def __init__(self, *, distill: Distill, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if distill is None or (distill.data is None and self.on_clients is None):
            raise ValueError(
                "DistilledFedAvg distils on server data, distill=Distill(data=...), or by the clients, "
                "on_clients=OnClients() (their ClientApp keeps its model and answers 'query.refine')"
            )
        refine = distill.refine
        if refine is not None and refine.data is None and self.on_clients is None:
            raise ValueError("Distill(refine=...) needs the refinement's data, or on_clients")
        self.distill = refine_split(distill) if distill.data is not None else distill
        self.refine = refine_split(refine) if refine is not None and refine.data is not None else refine
        self.refines = self.refine is not None

    def configure_train(self, server_round, arrays, config, grid):
        if self.distill.data is None:  # the clients keep this round's model: it is their teacher
            config["keep-model"] = True
        return super().configure_train(server_round, arrays, config, grid)

    def align(self, models, weights, start, matched=None):
        if self.refine is None:
            return super().align(models, weights, start, matched)
        return RefinedFedAvg.align(self, models, weights, start, matched)

    def combine(self, server_round, replies, models, weights):
        t0 = time.time()
        if self.distill.student == "average":  # FedDF: distil FedAvg's mean
            start = self.average(models, weights)
            fields: dict[str, Any] = {"kept": "average"}
        else:
            start, fields, _ = super().combine(server_round, replies, models, weights)
        student, record = self._distilled(start, models)
        fields.update({f"distill_{k}": v for k, v in record.items()}, distill_from=fields.get("kept"))
        unconfirmed(fields, "distill", record.get("clients", {}))
        result, plain = self._guarded(server_round, student, models, weights, fields)
        fields["kept"] = "distilled" if result is student else "average"
        fields["align_seconds"] = time.time() - t0
        return result, fields, plain

    def _distilled(self, start, models):
        """The start distilled at the server toward the replies' ensemble, or by the clients."""
        if self.distill.data is not None:
            student, record = distill_model(start, [loaded(m) for m in models], self.distill, device=self.scale.device)
            return student.cpu(), record
        remote = client_losses(self, self.distill, target="own-model")
        student, record = distill_on_clients(start, remote, self.distill)
        return student, {**record, "clients": remote.record()}


# ---- run_config keys and registrations ------------------------------------------------------------

DISTILL_STEPS = Key(
    "distill-steps",
    Distill.steps,
    "at most this many distillation steps on the server's refinement "
    "half (`Distill.steps`); it stops on its held-out loss to the ensemble",
    check=non_negative,
)
DISTILL_LR = Key(
    "distill-lr", Distill.lr, "the distillation's Adam learning rate on the weights (`Distill.lr`)", check=non_negative
)
DISTILL_TEMPERATURE = Key(
    "distill-temperature",
    Distill.temperature,
    "the distillation's softmax temperature (`Distill.temperature`)",
    check=lambda v: "" if v > 0 else "must be positive",
)
DISTILL_KEYS = (DISTILL_STEPS, DISTILL_LR, DISTILL_TEMPERATURE)


def distilled_strategy(b: Build, student: str, refine: bool = False, on_clients: bool = False):
    s = b.settings
    data = None if on_clients else b.halves()[0]  # the refinement's half: the same data, the same budget of steps
    options = Distill(
        data=data,
        student=student,
        refine=s.refinement(data) if refine else None,
        steps=b.key("distill-steps"),
        lr=b.key("distill-lr"),
        temperature=b.key("distill-temperature"),
    )
    return DistilledFedAvg(**b.common(), **b.aligned(on_clients=on_clients), distill=options)


@register(
    "aligned-distilled",
    summary="the aligned merge distilled toward the replies' ensemble on the server's data",
    server_data=True,
    universe=True,
    example="DistilledFedAvg(model=model, distill=Distill(data=data))",
    keys=DISTILL_KEYS,
)
def _aligned_distilled(b: Build):
    return distilled_strategy(b, "merge")


@register(
    "refined-distilled",
    summary="the refined merge distilled toward the replies' ensemble on the server's data",
    server_data=True,
    universe=True,
    example="DistilledFedAvg(model=model, distill=Distill(data=data, refine=Refinement(data=data)))",
    keys=DISTILL_KEYS,
)
def _refined_distilled(b: Build):
    return distilled_strategy(b, "merge", refine=True)


@register(
    "refined-clients-distilled",
    summary="refined on the clients, then distilled by them, each "
    "toward the model it trained on its own data (no server data)",
    on_clients=True,
    universe=True,
    example="DistilledFedAvg(model=model, distill=Distill(refine=Refinement()), on_clients=OnClients())",
    keys=(*DISTILL_KEYS, *REFINE_ON_CLIENTS),
    client=DISTILL_CODE,
)
def _refined_clients_distilled(b: Build):
    return distilled_strategy(b, "merge", refine=True, on_clients=True)
