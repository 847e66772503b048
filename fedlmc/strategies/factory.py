"""Build the strategy a run asks for (``fedlmc.federated.Settings.strategy``) with its server-side data."""
from __future__ import annotations

from typing import Any

from fedlmc.federated import Settings, halves

from .aligned import AlignedFedAvg, RefinedFedAvg
from .fedavg import ReportingFedAvg
from .hetero import HeteroWidthFedAvg, SlicingFedAvg


def build_strategy(s: Settings, model_config: dict[str, Any], splits, model: Any = None):
    """``average`` | ``permuted`` | ``aligned`` | ``refined`` | ``hetero`` | ``hetero-permuted`` |
    ``hetero-refined`` | ``slicing`` for the run's settings.

    The server's validation split is cut in two: the refinement learns on one half, the do-no-harm
    guard judges on the other (so the guard never scores a model on data it was refined on).
    ``s.report`` gives every strategy the test split to record client / plain / aggregate losses each
    round (it evaluates every reply: the comparison runner turns it on). ``model``: the clients' model
    when it is not a fedlmc one (``s.hf``: its Hugging Face twin).
    """
    common: dict[str, Any] = dict(fraction_train=s.fraction_train, fraction_evaluate=s.fraction_evaluate,
                                  min_train_nodes=s.min_nodes, min_available_nodes=s.min_nodes,
                                  min_evaluate_nodes=s.min_nodes if s.fraction_evaluate > 0 else 0,
                                  aggregate_threads=s.aggregate_threads if s.aggregate_threads >= 0 else None,
                                  **(dict(model=model) if model is not None else dict(model_config=model_config)))
    if s.report:
        common.update(report_data=splits.test, report_batches=s.eval_batches or None)
    refine_half, guard_half = halves(splits.val)
    # the peers' method (Git Re-Basin / FedMA style), at one width or across widths: permutations only, no rotation
    residual = "permutation" if s.strategy in ("permuted", "hetero-permuted") else s.residual
    aligned = dict(iterations=s.iterations, residual=residual, form=s.form, keep_layernorm=s.keep_layernorm,
                   guard_data=guard_half if s.guard else None, guard_batches=s.guard_batches or None,
                   device=s.device or None)
    robust = dict(reduce=s.reduce, trim=s.trim)
    if s.strategy == "average":
        return ReportingFedAvg(**common, **robust)
    if s.strategy in ("aligned", "permuted"):
        return AlignedFedAvg(**common, **aligned, **robust)
    if s.strategy == "refined":
        return RefinedFedAvg(**common, **aligned, refine_data=refine_half, alpha=s.refine_alpha,
                             refine_steps=s.refine_steps, refine_check_every=s.refine_check_every,
                             refine_patience=s.refine_patience, refine_check_sigmas=s.refine_check_sigmas)
    if s.strategy in ("hetero", "hetero-permuted", "hetero-refined"):
        refine = dict(refine_data=refine_half, alpha=s.refine_alpha, refine_steps=s.refine_steps,
                      refine_check_every=s.refine_check_every, refine_patience=s.refine_patience,
                      refine_check_sigmas=s.refine_check_sigmas) \
            if s.strategy == "hetero-refined" else {}
        return HeteroWidthFedAvg(**common, iterations=s.iterations, residual=residual, device=s.device or None,
                                 guard_data=aligned["guard_data"] if model is None else None,
                                 guard_batches=aligned["guard_batches"], **refine)
    if s.strategy == "slicing":
        return SlicingFedAvg(**common)
    raise ValueError(f"unknown strategy {s.strategy!r}")
