"""Optimal-transport fusion as a Flower strategy: the one-shot fusion peer of ``AlignedFedAvg``."""

from __future__ import annotations

import time
from typing import Any, Optional

from fedlmc.options import Guard, OTFusion
from fedlmc.ot_fusion import ot_fusion

from .fedavg import MeanFedAvg


class OTFusionFedAvg(MeanFedAvg):
    """Each round's replies fused by optimal transport (``fedlmc.ot_fusion``: Imfeld et al., ICLR 2024,
    weight-based): every reply carried onto an anchor reply's units by soft transport maps, layer by
    layer, then averaged with the replies' weights. fedlmc's GPT-2 and ViT models.

    Parameters
    ----------
    fusion : OTFusion, optional
        The maps' regularisation (0: exact, permutations), the residual policy and the anchor.
    guard : Guard, optional
        The do-no-harm comparison with the plain average, as ``AlignedFedAvg``'s (None: none).
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters (no ``robust``: the transported replies
        are averaged).
    """

    needs_architecture = True

    def __init__(self, *, fusion: Optional[OTFusion] = None, guard: Optional[Guard] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fusion = fusion if fusion is not None else OTFusion()
        self.guard = guard

    def combine(self, server_round, replies, models, weights):
        t0 = time.time()
        fused = ot_fusion(models, weights, self.fusion)
        fields: dict[str, Any] = {"kept": "ot-fusion", "align_seconds": time.time() - t0}
        plain = super().combine(server_round, replies, models, weights)[0]  # FedAvg's mean: the guard's rival
        if self.guard is not None:
            losses = {"ot-fusion": self.guard_loss(self.guard, fused), "average": self.guard_loss(self.guard, plain)}
            kept, verdict = self.guard_verdict({"ot-fusion": fused, "average": plain}, losses, "server")
            fields.update(verdict, kept=kept)
            if kept == "average":
                fused = plain
        return fused, fields, plain
