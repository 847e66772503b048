"""The strategy a run asks for (``Settings.strategy``), built by its registration
(``fedlmc.strategies.registry``) with its server-side data."""

from __future__ import annotations

from typing import Any

from fedlmc.federated import Settings
from fedlmc.strategies.registry import build


def build_strategy(s: Settings, model_config, splits, model: Any = None):
    """The registered strategy ``s.strategy`` for the run's settings (``fedlmc strategies`` lists them).

    The server's validation split is cut in two: the refinement learns on one half, the do-no-harm
    guard judges on the other (so the guard never scores a model on data it was refined on). The
    ``*-clients`` strategies use no server data: the clients' validation partitions, cut the same way
    (``fedlmc.federated.refine_parts``), give the refinement's gradients, its checks and the guard.
    ``s.report_data(splits)``, when not None, gives the strategy a data set on which it records
    client / plain / aggregate losses each round. ``model_config``: the global fedlmc model's config;
    ``model``: the clients' model when it is not a fedlmc one (``s.hf``: its Hugging Face twin).
    """
    return build(s, model_config, splits, model)
