"""Ensemble distillation at the server: FedDF, and distillation started from the aligned or refined merge.

``DistilledFedAvg`` builds its start as ``AlignedFedAvg`` does (or as ``RefinedFedAvg`` does, with
``distill.refine``), or takes the replies' plain mean (``distill.start="average"``: FedDF, Lin et al.,
NeurIPS 2020), then trains it on the server's unlabelled data toward the output ensemble of the very
replies it merged (``fedlmc.distill``). The do-no-harm guard then compares the distilled model with the
plain average on the guard's data, as the aligned strategies' guard does.
"""

from __future__ import annotations

import time
from typing import Any

from fedlmc.distill import distill as distill_model
from fedlmc.options import Distill

from .aligned import AlignedFedAvg, RefinedFedAvg, refine_split
from .base import loaded


class DistilledFedAvg(AlignedFedAvg):
    """Server-side ensemble distillation of each round's aggregate.

    Parameters
    ----------
    distill : Distill
        The distillation's data (the server's, unlabelled), start (``"average"``: FedDF; ``"merge"``:
        this strategy's aligned merge, refined first when ``distill.refine`` is given), budget,
        temperature and stopping rule (``fedlmc.options.Distill``). Its last quarter is held out for
        the checks unless ``check_data`` is given.
    **kwargs
        ``AlignedFedAvg``'s parameters (the matching, universe and guard of the merge it starts from).
    """

    def __init__(self, *, distill: Distill, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if distill is None or distill.data is None:
            raise ValueError("DistilledFedAvg distils on server data: distill=Distill(data=...)")
        if distill.refine is not None and distill.refine.data is None:
            raise ValueError("Distill(refine=...) refines on the server: give the refinement data too")
        self.distill = refine_split(distill)
        self.refine = refine_split(distill.refine) if distill.refine is not None else None
        self.refines = self.refine is not None

    def align(self, models, weights, start, matched=None):
        if self.refine is None:
            return super().align(models, weights, start, matched)
        return RefinedFedAvg.align(self, models, weights, start, matched)

    def combine(self, server_round, replies, models, weights):
        t0 = time.time()
        if self.distill.start == "average":  # FedDF: distil FedAvg's mean
            start, plain = self.plain(models, weights), None
            fields: dict[str, Any] = {"kept": "average"}
        else:
            start, fields, plain = super().combine(server_round, replies, models, weights)
        teachers = [loaded(m) for m in models]
        student, record = distill_model(start, teachers, self.distill, device=self.scale.device)
        student = student.cpu()
        fields.update({f"distill_{k}": v for k, v in record.items()}, distill_from=fields.get("kept"))
        fields["kept"] = "distilled" if record["best_step"] else fields["kept"]
        if self.guard is not None:
            plain = plain if plain is not None else self.plain(models, weights)
            losses = {"distilled": self.guard_loss(self.guard, student), "average": self.guard_loss(self.guard, plain)}
            kept, verdict = self.guard_verdict({"distilled": student, "average": plain}, losses, "server")
            fields.update(verdict)
            if kept == "average":
                student, fields["kept"] = plain, "average"
        fields["align_seconds"] = time.time() - t0
        return student, fields, plain
