"""Aligned aggregation: Flower's FedAvg with the average taken modulo the models' symmetries.

``AlignedFedAvg`` is a drop-in subclass of ``flwr.serverapp.strategy.FedAvg``: it aligns every reply to
a universe seeded by the previous global model when the replies were trained from it, else by a reply
(``start_for``; ``fedlmc.merging.universe.universe_merge``), averages there
(weighted by ``num-examples``) and sends back a model of the clients' own shape (LayerNorm kept by
default). ``RefinedFedAvg`` adds Dirichlet learned refinement on a small server-side data set.

Do no harm: with a server-side ``guard`` set, the strategy also builds the plain average and keeps
whichever has the lower loss there (and logs which won, by how much); with ``on_clients`` and no server
data, the clients score both (``fedlmc.flower.on_clients.client_guard``); without either, weight matching's
data-free identity guard applies (the identity transform — plain averaging — is one of its candidates).
``RefinedFedAvg(on_clients=...)`` refines with no server data: the clients compute its gradients.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from logging import INFO
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from flwr.app import ConfigRecord
from flwr.supercore import log

from fedlmc.data import split
from fedlmc.flower.on_clients import REFINE_CODE, ClientLosses, guard_code
from fedlmc.flower.on_clients import client_guard as score_on_clients
from fedlmc.merging.averaging import aligned_state, merge, robust_merge, streamed_mean
from fedlmc.merging.screen import screen as screen_replies
from fedlmc.merging.universe import Aligned, ArrivingMean, universe_merge
from fedlmc.options import (
    PREDICTION_SCREENS,
    RAW_SCREENS,
    Guard,
    Matching,
    OnClients,
    Refinement,
    Robust,
    Screen,
    Universe,
)
from fedlmc.scale.replies import StoredModel
from fedlmc.strategies.base import FedlmcStrategy, loaded
from fedlmc.strategies.keys import Key, non_negative
from fedlmc.strategies.registry import Build, register
from fedlmc.symmetry import canonical, spec_for
from fedlmc.train import predictions


class AlignedFedAvg(FedlmcStrategy):
    """FedAvg whose aggregation aligns replies along their symmetries before averaging.

    Parameters
    ----------
    matching : Matching, optional
        Weight matching's knobs (``fedlmc.options.Matching``); ``Matching(residual="permutation")`` is
        the permutation-only peers' method.
    universe : Universe, optional
        Where each round's universe starts ("previous": the previous global model when the replies were
        trained from it; "average": their plain weighted mean; otherwise a reply), how many iterations it
        runs, the merge's form and whether the global model stays a LayerNorm model
        (``fedlmc.options.Universe``). With replies on disk and ``start="average"`` the mean is summed as the
        replies arrive, while each is in memory anyway (``fedlmc.merging.universe.ArrivingMean``).
    guard : Guard, optional
        The do-no-harm guard on the server (``fedlmc.options.Guard``): the aligned aggregate is kept only
        if it scores no worse than the plain one on ``guard.data`` (or by ``guard.fn``).
    robust : Robust, optional
        ``Robust(reduce="median" / "trimmed")``: the coordinate-wise median or trimmed mean among the
        *aligned* replies (robust aggregation modulo the symmetries; the guard compares it with Flower's
        plain FedMedian / FedTrimmedAvg).
    on_clients : OnClients, optional
        With no ``guard``: the guard's candidates are scored by the round's clients on their held-out
        data (``evaluate`` messages their ClientApp answers; ``fedlmc.options.OnClients`` says how many
        clients, the loss metric's key, the timeout).
    screen : Screen, optional
        Screen the replies (``fedlmc.options.Screen``): the outliers among them are excluded with the
        reason logged, and the rest are merged with the same reduction. The distance screens compare
        the weight-matched replies (holding the round's aligned replies in memory), and the round is
        merged again without the outliers; the loss screen scores each reply with the guard (then
        required), the agreement and information screens compare their predictions on ``guard.data``'s
        inputs (then required): these score the replies as they came, before the one alignment of the
        replies they keep.
    **kwargs
        ``FedlmcStrategy``'s (``model``, ``report``, ``scale``...) and Flower's ``FedAvg``'s parameters.
    """

    needs_architecture = True
    stored_replies = True

    def __init__(
        self,
        *,
        matching: Optional[Matching] = None,
        universe: Optional[Universe] = None,
        guard: Optional[Guard] = None,
        robust: Optional[Robust] = None,
        on_clients: Optional[OnClients] = None,
        screen: Optional[Screen] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.matching = matching if matching is not None else Matching()
        self.universe = universe if universe is not None else Universe()
        self.guard = guard
        self.robust = robust if robust is not None else Robust()
        self.on_clients, self.screen = on_clients, screen
        self._arriving: Optional[ArrivingMean] = None  # this round's replies' mean, summed as they arrive
        if screen is not None and screen.method == "loss" and guard is None:
            raise ValueError("Screen(method='loss') scores each reply with the guard: pass guard=Guard(data or fn)")
        if screen is not None and screen.method in PREDICTION_SCREENS and (guard is None or guard.data is None):
            raise ValueError(
                f"Screen(method={screen.method!r}) compares the replies' predictions on the guard's data: pass "
                "guard=Guard(data=...)"
            )

    refines = False  # RefinedFedAvg: the final alignment learns more than the screen's weight matching

    def on_arrival(self, handle: StoredModel, model: nn.Module, weight: float) -> None:
        """Also adds the reply to the round's ``ArrivingMean`` when the universe may start at the mean."""
        super().on_arrival(handle, model, weight)
        if self.universe.start == "average":
            if self._arriving is None:
                self._arriving = ArrivingMean()
            self._arriving.add(handle.path, model, weight)

    def _close_store(self) -> None:
        super()._close_store()
        self._arriving = None

    def start_model(self, models: list, weights: list[float], start: Union[nn.Module, str, None]):
        """``start``, with "average" replaced by the mean summed as the replies arrived when it holds exactly
        ``models`` with ``weights`` (a screen or a failed alignment may have dropped some: then "average",
        streamed by the merge)."""
        if not (isinstance(start, str) and start == "average") or self._arriving is None:
            return start
        paths = {m.path: w for m, w in zip(models, weights) if isinstance(m, StoredModel)}
        mean = self._arriving.model_for(paths) if len(paths) == len(models) else None
        if mean is not None:
            log(INFO, "%s: the universe starts at the replies' mean, summed as they arrived", type(self).__name__)
        return start if mean is None else mean

    def align(
        self,
        models: list[nn.Module],
        weights: list[float],
        start: Union[nn.Module, str, None],
        matched: Optional[tuple[nn.Module, list]] = None,
    ):
        """The aligned aggregate and each reply's transform (subclasses change how). ``matched``: these
        very replies' weight-matched universe (factored) and transforms, from the screen's merge."""
        return matched if matched is not None else self.weight_matched(models, weights, start)

    def weight_matched(self, models: list[nn.Module], weights: list[float], start: Union[nn.Module, str, None]):
        """The universe by weight matching alone: ``AlignedFedAvg``'s merge, and the coordinates in which
        a screen compares the replies."""
        return universe_merge(
            models,
            weights,
            self.start_model(models, weights, start),
            matching=self.matching,
            universe=self.universe,
            robust=self.robust,
            device=self.scale.device,
            scale=self.scale,
        )

    def average(self, models: list, weights: list[float]) -> nn.Module:
        """The unaligned counterpart: FedAvg's weighted mean, or Flower's FedMedian / FedTrimmedAvg
        (replies on disk: the mean streamed, one reply at a time)."""
        if self.robust.reduce != "average":
            return robust_merge([loaded(m) for m in models], self.robust.reduce, self.robust.trim)
        total = sum(weights)
        if not any(isinstance(m, StoredModel) for m in models):
            return merge(models, [w / total for w in weights])
        return streamed_mean((loaded(m) for m in models), [w / total for w in weights])

    def require_grid(self):
        if self.grid is None:
            raise RuntimeError(
                f"{type(self).__name__} asks the clients (on_clients) and has no grid: run it through Flower's "
                "start(), or pass grid= to aggregate_replies"
            )
        return self.grid

    def combine(self, server_round, replies, models, weights):
        t0 = time.time()
        previous = self.start_for(models)
        start = "average" if previous is not None and self.universe.start == "average" else previous
        merged, transforms, screened = self._merge_screened(server_round, replies, models, weights, start)
        fields: dict[str, Any] = {
            "align_seconds": time.time() - t0,
            "kept": "aligned",
            "start": "reply" if start is None else self.universe.start,
            "moved": [transform_distance(T, spec_for(merged)) for T in transforms],
        }
        if screened is not None:
            fields["screen"] = screened
        on = Counter(T.info["node"] for T in transforms if "node" in T.info)
        if on:  # parallel workers (Scale(workers=...)): how many replies each node (Ray: its id) aligned
            fields["aligned_on"] = dict(on)
        refined = next((T.info for T in transforms if T.info.get("method") == "refined"), None)
        if refined is not None:  # how long the refinement ran, and which of its steps it kept
            fields.update(refine_steps_run=refined["steps_run"], refine_best_step=refined["best_step"])
            if "stopped" in refined:
                fields["refine_stopped"] = refined["stopped"]
        if self.round.clients_cost is not None:
            fields["refine_clients"] = self.round.clients_cost
            unconfirmed(fields, "refine", self.round.clients_cost)
        result, plain = self._guarded(server_round, merged, models, weights, fields)
        log(
            INFO,
            "%s round %d: aligned %d replies in %.2fs, mean distance from identity %.4f",
            type(self).__name__,
            server_round,
            len(models),
            fields["align_seconds"],
            sum(fields["moved"]) / len(models),
        )
        return result, fields, plain

    def _merge_screened(self, server_round, replies, models, weights, start):
        """The round's aligned merge and transforms, with the screen's outliers left out (in place) and
        its record (None without a screen)."""
        raw = self.screen is not None and self.screen.method in RAW_SCREENS  # the replies as they came
        screened = self._screen(server_round, replies, models, weights, None) if raw else None
        if self.screen is None or raw:
            merged, transforms = self.align(models, weights, start)
            self._drop_failed(server_round, replies, models, weights, transforms)
            return merged, transforms, screened
        # a distance screen compares the weight-matched replies
        merged, transforms = self.weight_matched(models, weights, start)
        self._drop_failed(server_round, replies, models, weights, transforms)
        screened = self._screen(server_round, replies, models, weights, transforms)
        if screened["excluded"] or self.refines:  # merged again without the outliers, or refined
            # nobody excluded: the refinement starts from the screen's universe, not a second matching
            reuse = not screened["excluded"] and self.universe.form == "factored"
            merged, transforms = self.align(models, weights, start, (merged, transforms) if reuse else None)
            self._drop_failed(server_round, replies, models, weights, transforms)
        return merged, transforms, screened

    def _guarded(self, server_round, merged, models, weights, fields):
        """The aggregate the guard keeps (the aligned one, or the plain average when it scores better on
        the server's guard or the clients' held-out data) and the plain average when one was built."""
        on_server = self.guard is not None
        guarded = on_server or (self.on_clients is not None and self.on_clients.guard)
        plain = self.average(models, weights) if guarded or self.report_data is not None else None
        losses = None
        if on_server:
            losses = {"aligned": self.guard_loss(self.guard, merged), "average": self.guard_loss(self.guard, plain)}
        elif guarded:
            losses, cost = score_on_clients(
                self.require_grid(),
                self._known_nodes("scoring the guard on the clients"),
                {"aligned": self.arrays_of(merged), "average": self.arrays_of(plain)},
                self._with_config(ConfigRecord({"server-round": server_round})),
                self.on_clients,
            )
            fields["guard_clients"] = cost
            unconfirmed(fields, "guard", cost)
            if losses is None:
                fields["guard"] = "no verdict (too few clients answered): kept the aligned aggregate"
        if losses is None:
            return merged, plain
        kept, verdict = self.guard_verdict(
            {"aligned": merged, "average": plain}, losses, "server" if on_server else "clients"
        )
        fields.update(verdict, kept=kept)
        return (plain if kept == "average" else merged), plain

    def _drop_failed(self, server_round, replies, models, weights, transforms) -> None:
        """Exclude the replies the merge could not use (unreadable, or failed in a worker), in place: the
        round's record, metrics and report see only the replies aggregated."""
        gone = [i for i, T in enumerate(transforms) if "excluded" in T.info]
        for i in gone:
            self.exclude(server_round, self.round.nodes[i], transforms[i].info["excluded"])
        if gone:
            self._drop(gone, replies, models, weights, transforms)

    def _drop(self, gone, replies, models, weights, transforms) -> None:
        """Leave the replies at indices ``gone`` out of the round, in place (``transforms``: None before
        the alignment)."""
        keep = [i for i in range(len(models)) if i not in gone]
        for seq in (replies, models, weights, transforms, self.round.nodes):
            if seq is not None:
                seq[:] = [seq[i] for i in keep]

    def _screen(self, server_round, replies, models, weights, transforms) -> dict[str, Any]:
        """Score the replies (``fedlmc.merging.screen``; a distance screen: aligned by ``transforms``, the others as
        they came), exclude the outliers (in place), and return the round record's ``screen`` field:
        each node's score and the nodes excluded."""
        t0 = time.time()
        if self.screen.method == "loss":  # held-out losses: the same for a reply and its aligned self
            found = screen_replies([], self.screen, losses=[self.guard_loss(self.guard, loaded(m)) for m in models])
        elif self.screen.method in PREDICTION_SCREENS:  # top-1 predictions on the guard's inputs
            preds = [predictions(loaded(m), self.guard.data, max_batches=self.guard.batches) for m in models]
            found = screen_replies([], self.screen, predictions=preds)
        else:
            states = [aligned_state(canonical(loaded(m)), T) for m, T in zip(models, transforms)]
            found = screen_replies(states, self.screen)
            del states
        nodes = list(self.round.nodes)
        for i, reason in sorted(found.excluded.items()):
            self.exclude(server_round, nodes[i], f"screen ({found.method}): {reason}")
        self._drop(sorted(found.excluded), replies, models, weights, transforms)
        return {
            "method": found.method,
            "scores": {str(n): s for n, s in zip(nodes, found.scores)},
            **({"values": {str(n): v for n, v in zip(nodes, found.values)}} if found.values is not None else {}),
            "excluded": [nodes[i] for i in sorted(found.excluded)],
            "seconds": time.time() - t0,
        }


def unconfirmed(fields: dict[str, Any], what: str, cost: dict[str, Any]) -> None:
    """The round record's ``unconfirmed``: for each query (``refine``, ``guard``, ``distill``) that no
    client answered with the method's result, the client code their ClientApp lacks."""
    if cost.get("unconfirmed"):
        fields.setdefault("unconfirmed", {})[what] = cost["unconfirmed"]


class RefinedFedAvg(AlignedFedAvg):
    """``AlignedFedAvg`` plus Dirichlet refinement of every reply's alignment on a small server-side data
    set (``fedlmc.matching.refine``).

    The refinement stops on its objective: every ``refine.check_every`` steps the aggregate (the merge
    at the replies' weights) is scored on held-out batches (the last quarter of ``refine.data``, split
    off by ``refine_split``), the best alignment scored (the weight-matched start included) is kept,
    and it stops after ``refine.patience`` checks without a significant improvement. Keep ``guard.data``
    disjoint from ``refine.data`` so the do-no-harm comparison stays honest.

    With no server data (``refine.data`` None) and ``on_clients``, the clients compute the refinement:
    every step sends the merged model at fresh λ draws to a sample of the round's clients, which answer
    with their loss's gradient on a few local batches (a ``query.refine`` message, answered by
    ``fedlmc.flower.on_clients.answer``); the checks and the guard are scored by the clients' held-out losses.
    A client that fails, times out or answers badly is excluded from that step with a reason; with
    fewer than ``on_clients.min_clients`` answers the refinement stops and keeps the best alignment
    checked so far. ``history[-1]["refine_clients"]`` records messages, bytes and seconds.

    Parameters
    ----------
    refine : Refinement
        The refinement's data (at the server; None with ``on_clients``), steps, Dirichlet α, loss and
        stopping rule (``fedlmc.options.Refinement``).
    on_clients : OnClients, optional
        Where the gradients and the checks' losses come from when the server has no data.
    screen : Screen, optional
        As in ``AlignedFedAvg``: the refinement learns on the replies the screen kept only (with
        ``on_clients``, only their clients are asked). After a distance screen that excluded nobody it
        starts from the screen's weight matching (no second one).
    **kwargs
        ``AlignedFedAvg``'s parameters but ``robust`` (refinement learns weighted means).
    """

    refines = True

    def __init__(self, *, refine: Refinement, on_clients: Optional[OnClients] = None, **kwargs: Any) -> None:
        if "robust" in kwargs:
            raise TypeError(
                "RefinedFedAvg learns mixtures (weighted means) of the aligned replies: it takes no robust "
                "(AlignedFedAvg(robust=...) reduces the aligned replies robustly)"
            )
        super().__init__(on_clients=on_clients, **kwargs)
        if refine is None or (refine.data is None and on_clients is None):
            raise ValueError(
                "RefinedFedAvg needs data for its refinement, at the server or at the clients: "
                "refine=Refinement(data=...) (a small server-side data set), or on_clients=OnClients() (the "
                "clients compute the gradients: their ClientApp answers 'query.refine' messages with "
                "fedlmc.flower.on_clients.answer)"
            )
        self.refine = refine

    def align(self, models, weights, start, matched=None):
        remote = client_losses(self, self.refine) if self.refine.data is None else None
        try:
            return universe_merge(
                models,
                weights,
                self.start_model(models, weights, start) if matched is None else Aligned(*matched),
                matching=self.matching,
                refine=refine_split(self.refine) if remote is None else replace(self.refine, data=remote),
                universe=self.universe,
                device=self.scale.device,
                scale=self.scale,
            )
        finally:
            self.round.clients_cost = remote.record() if remote is not None else None


def client_losses(strategy, options, target: str = "") -> ClientLosses:
    """The round's clients as the loss of a refinement or a distillation (``options``: its batch size,
    check batches and seed; ``target``: ``ClientLosses``')."""
    return ClientLosses(
        strategy.require_grid(),
        strategy._known_nodes("asking the clients for the refinement"),
        strategy.on_clients,
        options.batch_size,
        options.check_batches,
        seed=options.seed,
        server_round=strategy.round.server_round,
        target=target,
    )


def refine_split(refine: Refinement) -> Refinement:
    """``refine`` with held-out checks: with ``check_every`` and no ``check_data``, the descent trains on
    the first three quarters of ``refine.data`` and the checks score the last quarter (data fedlmc cannot
    split, e.g. a user's own batch source, or too small to split, is scored as it is trained on)."""
    if not refine.check_every or refine.check_data is not None:
        return refine
    try:
        train, held = split(refine.data, 0.75)
    except TypeError:
        return refine
    if len(train) == 0 or len(held) == 0:
        return refine
    return replace(refine, data=train, check_data=held)


def transform_distance(T, spec) -> float:
    """How far a transform moved from the identity: ‖O − I‖_F/√d plus the fraction of moved units
    (group kinds from ``spec``, the universe's; gauges are not counted)."""
    total = 0.0
    for name, el in T.elements.items():
        kind = spec.groups[name].kind
        if kind == "orthogonal":
            total += float((el - torch.eye(*el.shape, dtype=el.dtype)).norm() / el.shape[0] ** 0.5)
        elif kind == "permutation":
            total += float((el != torch.arange(len(el))).float().mean())
    return total


# ---- run_config keys and registrations ------------------------------------------------------------

CLIENTS_PER_STEP = Key(
    "clients-per-step",
    OnClients.clients_per_step,
    "clients asked for gradients at each refinement step (`OnClients.clients_per_step`; 0: every client)",
    check=non_negative,
)
BATCHES_PER_CLIENT = Key(
    "batches-per-client",
    OnClients.batches_per_client,
    "local batches each client's gradient averages over (`OnClients.batches_per_client`)",
    check=lambda v: "" if v >= 1 else "at least 1",
)
SAMPLES_PER_MESSAGE = Key(
    "samples-per-message",
    OnClients.samples_per_message,
    "merge-weight draws λ per message, one gradient each (`OnClients.samples_per_message`)",
    check=lambda v: "" if v >= 1 else "at least 1",
)
CHECK_CLIENTS = Key(
    "check-clients",
    OnClients.check_clients,
    "clients that score the checks and the guard (`OnClients.check_clients`; 0: every client)",
    check=non_negative,
)
REFINE_ON_CLIENTS = (CLIENTS_PER_STEP, BATCHES_PER_CLIENT, SAMPLES_PER_MESSAGE, CHECK_CLIENTS)


@register(
    "permuted",
    summary="aligned with permutations only (heads, FF, the residual's coordinates): the Git "
    "Re-Basin / FedMA-style peer",
    server_data=True,
    reduce=True,
    screen=True,
    universe=True,
    example='AlignedFedAvg(model=model, matching=Matching(residual="permutation"))',
)
def _permuted(b: Build):
    return AlignedFedAvg(**b.common(), **b.aligned(permutations=True), **b.robust())


@register(
    "aligned",
    summary="weight matching along every symmetry (orthogonal residual, head and FF "
    "permutations, QK/OV gauges) to a universe, then averaging; guarded by the plain average",
    server_data=True,
    reduce=True,
    screen=True,
    universe=True,
    example="AlignedFedAvg(model=model)",
)
def _aligned(b: Build):
    return AlignedFedAvg(**b.common(), **b.aligned(), **b.robust())


@register(
    "aligned-clients",
    summary="aligned, its guard scored by the clients (no server data)",
    on_clients=True,
    reduce=True,
    screen=True,
    universe=True,
    example="AlignedFedAvg(model=model, on_clients=OnClients())",
    keys=(CHECK_CLIENTS,),
    client=guard_code(),
)
def _aligned_clients(b: Build):
    return AlignedFedAvg(**b.common(), **b.aligned(on_clients=True), **b.robust())


@register(
    "refined",
    summary="aligned, then Dirichlet refinement of the alignments on the server's data",
    server_data=True,
    screen=True,
    universe=True,
    example="RefinedFedAvg(model=model, refine=Refinement(data=data))",
)
def _refined(b: Build):
    return RefinedFedAvg(**b.common(), **b.aligned(), refine=b.settings.refinement(b.halves()[0]))


@register(
    "refined-clients",
    summary="the refinement's gradients and the guard computed by the clients (no server data)",
    on_clients=True,
    screen=True,
    universe=True,
    example="RefinedFedAvg(model=model, refine=Refinement(), on_clients=OnClients())",
    keys=REFINE_ON_CLIENTS,
    client=REFINE_CODE,
)
def _refined_clients(b: Build):
    return RefinedFedAvg(**b.common(), **b.aligned(on_clients=True), refine=b.settings.refinement(None))
