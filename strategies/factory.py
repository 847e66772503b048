"""The strategy a run asks for (``Settings.strategy``), built with its server-side data."""

from __future__ import annotations

from typing import Any

from fedlmc.federated import Settings, halves
from fedlmc.strategies import (
    AlignedFedAvg,
    HeteroWidthFedAvg,
    KrumFedAvg,
    RefinedFedAvg,
    ReportingFedAvg,
    SlicingFedAvg,
)


def build_strategy(s: Settings, model_config, splits, model: Any = None):
    """``average`` | ``permuted`` | ``aligned`` | ``aligned-clients`` | ``refined`` | ``refined-clients`` |
    ``hetero`` | ``hetero-permuted`` | ``hetero-refined`` | ``slicing`` | ``krum`` | ``multikrum`` for the
    run's settings (``screen`` screens the aligned and refined strategies' replies; ``krum`` / ``multikrum``
    are Flower's raw-coordinate Krum and Multi-Krum, f = ``malicious``).

    The server's validation split is cut in two: the refinement learns on one half, the do-no-harm
    guard judges on the other (so the guard never scores a model on data it was refined on). The
    ``*-clients`` strategies use no server data: the clients' validation partitions, cut the same way
    (``fedlmc.federated.refine_parts``), give the refinement's gradients, its checks and the guard.
    ``s.report_data(splits)``, when not None, gives the strategy a data set on which it records
    client / plain / aggregate losses each round. ``model_config``: the global fedlmc model's config;
    ``model``: the clients' model when it is not a fedlmc one (``s.hf``: its Hugging Face twin).
    """
    common: dict[str, Any] = dict(
        fraction_train=s.fraction_train,
        fraction_evaluate=s.fraction_evaluate,
        min_train_nodes=s.min_nodes,
        min_available_nodes=s.min_nodes,
        min_evaluate_nodes=s.min_nodes if s.fraction_evaluate > 0 else 0,
        aggregate_threads=s.aggregate_threads if s.aggregate_threads >= 0 else None,
        model=model if model is not None else model_config,
    )
    report = s.report_data(splits)
    if report is not None:
        common.update(report_data=report, report_batches=s.eval_batches or None)
    refine_half, guard_half = halves(splits.val)
    guard = dict(guard_data=guard_half if s.guard else None, guard_batches=s.guard_batches or None)
    aligned = dict(
        matching=s.matching(),
        iterations=s.iterations,
        form=s.form,
        keep_layernorm=s.keep_layernorm,
        device=s.device or None,
        scale=s.scale(),
        **guard,
    )
    robust = dict(reduce=s.reduce, trim=s.trim)
    if s.strategy == "average":
        return ReportingFedAvg(**common, **robust)
    if s.strategy in ("krum", "multikrum"):
        return KrumFedAvg(
            **common, num_malicious_nodes=s.malicious, num_nodes_to_select=1 if s.strategy == "krum" else None
        )
    screen = s.screen_options()
    screened = dict(robust, screen=screen)
    clients = dict(aligned, guard_data=None, on_clients=s.on_clients())  # the *-clients: no server data
    universe = None
    if s.strategy in ("aligned", "permuted"):
        universe = AlignedFedAvg(**common, **aligned, **screened)
    elif s.strategy == "refined":
        universe = RefinedFedAvg(**common, **aligned, screen=screen, refine=s.refinement(refine_half))
    elif s.strategy == "aligned-clients":  # the clients score the guard's candidates
        universe = AlignedFedAvg(**common, **clients, **screened)
    elif s.strategy == "refined-clients":  # the clients compute the refinement's gradients and checks
        universe = RefinedFedAvg(**common, **clients, screen=screen, refine=s.refinement(None))
    if universe is not None:
        universe.universe_start = s.universe_start
        return universe
    if s.strategy in ("hetero", "hetero-permuted", "hetero-refined"):
        refine = s.refinement(refine_half) if s.strategy == "hetero-refined" else None
        return HeteroWidthFedAvg(
            **common,
            matching=s.matching(),
            iterations=s.iterations,
            device=s.device or None,
            guard_data=guard["guard_data"] if model is None else None,
            guard_batches=guard["guard_batches"],
            refine=refine,
        )
    if s.strategy == "slicing":
        return SlicingFedAvg(**common)
    raise ValueError(f"unknown strategy {s.strategy!r}")
