"""The output ensemble of several models: the reference a one-shot merge tries to reach with one model."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn


class Ensemble(nn.Module):
    """Averages the members' predicted probabilities; returns their log (valid logits: softmax gives the
    averaged probabilities back, so cross-entropy on them is the ensemble's loss)."""

    def __init__(self, members: Sequence[nn.Module]) -> None:
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.members = nn.ModuleList(members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logp = torch.stack([torch.log_softmax(m(x), dim=-1) for m in self.members])
        return torch.logsumexp(logp, dim=0) - math.log(len(self.members))
