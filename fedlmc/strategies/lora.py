"""FedAvg for PEFT LoRA replies, aggregated by their product modulo the adapter's gauge
(``fedlmc.lora``): the drop-in for FlowerTune-style apps, whose FedAvg averages the factors."""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any, Optional

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedlmc.lora import KEEP_FACTOR, LoraAggregator, LoraInputError, LoraLayout, nbytes
from fedlmc.strategies.base import _wrapper_of, node_of
from fedlmc.strategies.knobs import ClientKnob, ConfirmedKnobs

BASE_UPDATE_KEY = "base-update"  # tail="fold": the accumulated dense update of the base weights
FOLD = ClientKnob(
    BASE_UPDATE_KEY,
    "tail='fold': the ClientApp adds the message's 'base-update' ArrayRecord to its base weights "
    "(fedlmc.lora.apply_base_update) and confirms it with "
    "fedlmc.strategies.knobs.confirm(metrics, msg.content, 'base-update').",
)


MIXED_RANKS_CODE = (
    "mixed_ranks: a client whose rank is below the one sent loads the factors with "
    "fedlmc.lora.set_adapter(peft_model, arrays), which takes their first r components (PEFT's "
    "set_peft_model_state_dict refuses factors of another rank)"
)


class LoraFedAvg(ConfirmedKnobs, FedAvg):
    """``FedAvg`` whose aggregate of LoRA adapters is the weighted mean of the clients' updates
    ``sᵢ·Bᵢ·Aᵢ``, sent back as rank-r factors (in the balanced SVD gauge by default: ``fedlmc.lora``).

    Replies are PEFT adapter states: keyed as ``get_peft_model_state_dict`` writes them (with or
    without the adapter name), or FlowerTune's ordered list of arrays (read in ``model``'s key order).
    The aggregate goes back in the form the replies came in. A reply that is not such an adapter
    (foreign keys, other target modules, a rank other than the declared one, NaN) is excluded with a
    logged reason; bad initial arrays are an error before round 1.

    Parameters
    ----------
    model : peft.PeftModel, optional
        The clients' PEFT model: its adapter gives the modules, the key order and the scaling (α, r,
        rsLoRA, ``rank_pattern``/``alpha_pattern``, ``fan_in_fan_out``).
    lora_config : peft.LoraConfig or dict, optional
        Instead of ``model``: the adapter's config; the modules and keys are read from the keyed
        ``initial_arrays`` (keyless arrays need ``model``).
    adapter_name : str, default "default"
        The PEFT adapter aggregated.
    tail : {"keep", "fold", "drop"}, default "keep"
        What the rank-r truncation of the mean drops: kept at the server for the next round, folded
        into the base weights (FedEx-LoRA: every message then carries a dense ``"base-update"``
        ArrayRecord for the clients to add to their base, see ``fedlmc.lora.apply_base_update``), or
        dropped (FlexLoRA).
    keep_factor : float, default 4.0
        ``tail="keep"``: the most singular components held per module, as a multiple of its rank
        (the largest are kept; ``math.inf``: all, which is FedAvg on the products exactly).
    gauge : {"balanced", "anchored", "even"}, default "balanced"
        How the product sent is split into factors (``fedlmc.lora.LoraAggregator``): the balanced SVD
        split, FedIT's mean ``A`` with the least-squares ``B``, or the SVD split with no floor on ``A``.
    mixed_ranks : bool, default False
        Accept clients of different ranks; each is sent the best approximation of the aggregate at
        its own rank (the rank of its last reply; before that, the declared rank, which its client
        truncates: the factors are ordered by singular value, so the first rᵢ components are the best
        rank-rᵢ approximation). Declare the largest rank in the config.
    unconfirmed : {"warn", "error"}, default "warn"
        With ``tail="fold"``: a round whose replies do not confirm that the client added the base update
        it was sent (``applied-base-update``) is warned about, or refused (``strategies.knobs``).
    **fedavg
        Flower's ``FedAvg`` parameters (``fraction_train``, ``min_available_nodes``...).
    """

    def __init__(
        self,
        *,
        model: Any = None,
        lora_config: Any = None,
        adapter_name: str = "default",
        tail: str = "keep",
        keep_factor: float = KEEP_FACTOR,
        gauge: str = "balanced",
        mixed_ranks: bool = False,
        unconfirmed: str = "warn",
        **fedavg: Any,
    ) -> None:
        super().__init__(unconfirmed=unconfirmed, **fedavg)
        if model is None and lora_config is None:
            raise LoraInputError("LoraFedAvg needs model=<your PeftModel> or lora_config=<its LoraConfig>")
        self.layout: Optional[LoraLayout] = (
            LoraLayout.of(model, adapter_name=adapter_name) if model is not None else None
        )
        self.lora_config, self.adapter_name = lora_config, adapter_name
        self.tail, self.keep_factor, self.gauge, self.mixed_ranks = tail, keep_factor, gauge, mixed_ranks
        LoraAggregator(self.layout or LoraLayout((), ()), tail, keep_factor, gauge)  # validates the options
        self.aggregator: Optional[LoraAggregator] = None
        self.keyless = False
        self.node_ranks: dict[int, dict[str, int]] = {}
        self.history: list[dict[str, Any]] = []
        self._sent = 0
        self._sent_base = False  # this round's train messages carried a base update (tail="fold")
        self._initial: Optional[ArrayRecord] = None  # the adapter set_initial read
        self._returned: Optional[ArrayRecord] = None  # the last aggregate this strategy returned

    # ---- before round 1 ---------------------------------------------------------------------------
    def start(self, grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any):
        """Flower's ``start``, after reading ``initial_arrays`` as the declared adapter."""
        self.set_initial(initial_arrays)
        return super().start(grid, initial_arrays, *args, **kwargs)

    def set_initial(self, initial_arrays: ArrayRecord) -> None:
        """Check ``initial_arrays`` against the declared adapter (``LoraInputError`` naming what is
        wrong) and take them as round 0's product."""
        keys = list(initial_arrays.keys())
        self.keyless = bool(keys) and all(k.isdigit() for k in keys)
        if self.layout is None:
            self.layout = LoraLayout.of(config=self.lora_config, arrays=initial_arrays, adapter_name=self.adapter_name)
        factors = self.layout.read(initial_arrays)
        self.aggregator = LoraAggregator(self.layout, self.tail, self.keep_factor, self.gauge)
        self.aggregator.start(factors)
        self._initial = initial_arrays

    def _sync(self, arrays: ArrayRecord) -> None:
        """The adapter Flower passes is the global one: it is read on first use (a wrapper such as
        Flower's DP wrappers never calls ``start``), and read again when it is not the aggregate this
        strategy returned (a wrapper changed it, e.g. added noise), so what the server keeps agrees with
        what the clients are sent. ``tail="fold"`` under a wrapper is refused: its dense base update
        travels beside the adapter, where a DP wrapper's noise does not reach it."""
        wrapper = _wrapper_of(self)
        if wrapper is not None and self.tail == "fold":
            raise ValueError(
                f"LoraFedAvg(tail='fold') sends every client a dense base update that {type(wrapper).__name__} "
                "does not see (nor add noise to): use tail='keep' or 'drop' under a wrapper"
            )
        if self.aggregator is not None and (arrays is self._returned or arrays is self._initial):
            return
        if self.aggregator is not None:
            log(
                INFO,
                "LoraFedAvg: the global adapter is not the aggregate it returned (a wrapper changed it): "
                "its state restarts from it",
            )
        self.set_initial(arrays)

    # ---- each round -------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        self._sync(arrays)
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        out, self._sent = [], 0
        base = self.aggregator.base_update() if self.aggregator is not None else {}
        self._sent_base = bool(base)
        for msg in msgs:
            node = msg.metadata.dst_node_id
            ranks = self.node_ranks.get(int(node))
            own = arrays
            if ranks and any(ranks[m.name] != m.rank for m in self.layout.modules):
                own = ArrayRecord(self.layout.write(self.aggregator.factors(ranks), keyless=self.keyless))
            if own is arrays and not base:
                out.append(msg)
            else:
                content = RecordDict(
                    {self.arrayrecord_key: own, self.configrecord_key: msg.content[self.configrecord_key]}
                )
                if base:
                    content[BASE_UPDATE_KEY] = ArrayRecord(base)
                out.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node))
            self._sent += own.count_bytes() + nbytes(base.values())
        return out

    def client_knobs(self) -> list[ClientKnob]:
        return [FOLD] if self._sent_base else []

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid
    ) -> Iterable[Message]:
        msgs = list(super().configure_evaluate(server_round, arrays, config, grid))
        base = self.aggregator.base_update() if self.aggregator is not None else {}
        if not base:
            return msgs
        out = []
        for msg in msgs:
            content = RecordDict({k: v for k, v in msg.content.items()})
            content[BASE_UPDATE_KEY] = ArrayRecord(base)
            out.append(
                Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=msg.metadata.dst_node_id)
            )
        return out

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        if self.aggregator is None:
            raise RuntimeError(
                "LoraFedAvg.aggregate_train before any adapter was given: run it through start() or "
                "configure_train(), or call set_initial(initial_arrays) first"
            )
        t0 = time.perf_counter()
        replies = list(replies)
        missing, before = self.check_confirmed(server_round, replies), len(self.history)
        try:
            return self._aggregate_adapters(server_round, replies, t0)
        finally:
            self.note_unconfirmed(missing, before)

    def _aggregate_adapters(self, server_round: int, replies: list, t0: float):
        failed = self._failed_at_their_first_rank(server_round, replies)
        ok, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        accepted, factors, weights, excluded, received = [], [], [], [], 0
        for msg in ok:
            node = node_of(msg)
            try:
                arrays, weight = self._unpack(msg)
                received += arrays.count_bytes()
                f = self.layout.read(arrays, mixed_ranks=self.mixed_ranks)
            except LoraInputError as err:
                log(WARNING, "LoraFedAvg: reply from node %s excluded: %s", node, err)
                excluded.append({"node": node, "reason": str(err)})
                continue
            self.node_ranks[node] = {name: a.shape[0] for name, (_, a) in f.items()}
            accepted.append(msg)
            factors.append(f)
            weights.append(weight)
        record = {
            "round": server_round,
            "replies": len(accepted),
            "excluded": excluded,
            **({"unconfirmed": {"mixed-ranks": failed}} if failed else {}),
            "bytes_sent": self._sent,
            "bytes_received": received,
        }
        if not accepted:
            log(WARNING, "LoraFedAvg: no valid LoRA reply in round %d: the adapter is kept", server_round)
            self.history.append({**record, "seconds": time.perf_counter() - t0})
            return None, None
        self.aggregator.aggregate(factors, weights)
        arrays = ArrayRecord(self.layout.write(self.aggregator.factors(), keyless=self.keyless))
        metrics = self.train_metrics_aggr_fn([m.content for m in accepted], self.weighted_by_key)
        seconds = time.perf_counter() - t0
        self.history.append({**record, "seconds": seconds, "server_state_bytes": self.aggregator.state_bytes})
        log(INFO, "LoraFedAvg: round %d aggregated %d adapters in %.3f s", server_round, len(accepted), seconds)
        self._returned = arrays
        return arrays, metrics

    def _failed_at_their_first_rank(self, server_round: int, replies: list) -> list:
        """With ``mixed_ranks``: the nodes that failed before the server saw their rank (they were sent the
        declared rank), warned about once, naming the client code a smaller rank needs."""
        if not self.mixed_ranks:
            return []
        failed = [node_of(m) for m in replies if m.has_error() and node_of(m) not in self.node_ranks]
        if failed and "mixed-ranks" not in self._warned:
            reason = next(m.error.reason for m in replies if m.has_error())
            log(
                WARNING,
                "LoraFedAvg round %d: nodes %s failed on the declared rank's adapter (%s). %s",
                server_round,
                failed,
                reason,
                MIXED_RANKS_CODE,
            )
            self._warned.add("mixed-ranks")
        return failed

    def _unpack(self, msg: Message) -> tuple[ArrayRecord, float]:
        records = list(msg.content.array_records.values())
        if len(records) != 1:
            raise LoraInputError(f"a reply must carry one ArrayRecord (the adapter), it carries {len(records)}")
        metrics = list(msg.content.metric_records.values())
        weight = next((m[self.weighted_by_key] for m in metrics if self.weighted_by_key in m), None)
        if weight is None or not float(weight) > 0:
            raise LoraInputError(f"a reply must report a positive '{self.weighted_by_key}' in its MetricRecord")
        return records[0], float(weight)

    def base_update(self) -> dict[str, torch.Tensor]:
        """``tail="fold"``: the base weights' accumulated update ``{base key: tensor}``."""
        return self.aggregator.base_update() if self.aggregator is not None else {}

    @property
    def server_state_bytes(self) -> int:
        return self.aggregator.state_bytes if self.aggregator is not None else 0


__all__ = ["LoraFedAvg", "BASE_UPDATE_KEY"]
