"""Client-side knobs that are confirmed: a strategy whose method runs partly in the ClientApp (FedProx's
proximal term, SCAFFOLD's control variates) sends its knob in the train config, and a client that applied
it says so in its reply's metrics (``applied-<knob>`` = 1, written by ``confirm``). A round whose replies
lack the confirmation is warned about, naming the client code that is missing (or refused, with
``unconfirmed="error"``), so that no run is FedAvg under another name in silence."""

from __future__ import annotations

from dataclasses import dataclass
from logging import WARNING
from typing import Any, Iterable

from flwr.app import Message, MetricRecord
from flwr.supercore import log

from fedlmc.options import UNCONFIRMED, one_of
from fedlmc.strategies.base import node_of


@dataclass(frozen=True)
class ClientKnob:
    """A knob the clients apply: its train-config key and the client code that applies it."""

    key: str
    code: str

    @property
    def metric(self) -> str:
        return applied_metric(self.key)


def applied_metric(key: str) -> str:
    """The reply metric by which a client confirms that it applied the train-config knob ``key``."""
    return f"applied-{key}"


def confirm(metrics: MetricRecord, config: Any, *keys: str) -> MetricRecord:
    """Add ``applied-<key>`` = 1 to a train reply's ``metrics`` for each of ``keys`` present in the train
    ``config`` the server sent (what a ClientApp calls once it applied them); returns ``metrics``."""
    for key in keys:
        if key in config:
            metrics[applied_metric(key)] = 1.0
    return metrics


class ConfirmedKnobs:
    """Mixin for a ``FedlmcStrategy`` with client-side knobs: ``client_knobs()`` lists the knobs in force
    this run; the replies of each round are checked for their confirmation before they are aggregated.

    Parameters
    ----------
    unconfirmed : {"warn", "error"}, default "warn"
        What a round whose replies do not confirm a knob does: warn (once per knob, naming the nodes and the
        missing client code; every such round's record lists them under ``unconfirmed``), or raise.
    """

    def __init__(self, *, unconfirmed: str = "warn", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        one_of(unconfirmed, UNCONFIRMED, "unconfirmed")
        self.unconfirmed = unconfirmed
        self._warned: set[str] = set()

    def client_knobs(self) -> list[ClientKnob]:
        """The knobs the clients must apply this run (none: nothing to confirm)."""
        return []

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        missing = self.check_confirmed(server_round, replies)
        before = len(self.history)
        out = super().aggregate_train(server_round, replies)
        self.note_unconfirmed(missing, before)
        return out

    def check_confirmed(self, server_round: int, replies: list[Message]) -> dict[ClientKnob, list]:
        """Each knob in force that some replies do not confirm, and their nodes: warned about once per knob
        (naming the client code), or a ``ValueError`` with ``unconfirmed="error"``."""
        missing = self._missing(replies)
        for knob, nodes in missing.items():
            why = (
                f"{type(self).__name__} round {getattr(self, 'real_round', int)(server_round)}: the replies of nodes "
                f"{nodes} do not confirm '{knob.key}' (metric '{knob.metric}'): their ClientApp did not apply it, so "
                f"this round is not {type(self).__name__}'s method. {knob.code}"
            )
            if self.unconfirmed == "error":
                raise ValueError(why)
            if knob.key not in self._warned:
                log(WARNING, "%s", why)
                self._warned.add(knob.key)
        return missing

    def note_unconfirmed(self, missing: dict[ClientKnob, list], before: int) -> None:
        """Record the unconfirmed knobs in the round's record (when the round added one)."""
        if missing and len(self.history) > before:
            self.history[-1]["unconfirmed"] = {k.key: nodes for k, nodes in missing.items()}

    def _missing(self, replies: list[Message]) -> dict[ClientKnob, list]:
        """Each knob in force and the nodes whose (non-error) replies do not confirm it."""
        out: dict[ClientKnob, list] = {}
        answered = [m for m in replies if not m.has_error() and m.has_content()]
        for knob in self.client_knobs():
            nodes = [node_of(m) for m in answered if not _confirms(m, knob.metric)]
            if nodes:
                out[knob] = nodes
        return out


def _confirms(msg: Message, metric: str) -> bool:
    return any(metric in rec and rec[metric] for rec in msg.content.metric_records.values())
