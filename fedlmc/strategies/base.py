"""What every fedlmc strategy shares, written once: Flower's round counter shifted for resumed runs, the
global model's config attached to every message, reply validation (baselines included), the
``aggregate_train`` skeleton, per-round history, optional reporting, and public ``state()`` /
``load_state()`` for checkpoints. A strategy only says how it combines the accepted replies
(``combine``) and, if it must, what each node is sent (``messages_for``).
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    FedAvg,
)
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from flwr.supercore import log

from fedlmc.hf import HFAdapter, recognise
from fedlmc.hf.adapter import key_mismatch
from fedlmc.merging.ensemble import Ensemble
from fedlmc.models import from_config
from fedlmc.models.layers import TransformerConfig
from fedlmc.options import Checks, Guard, Report, Robust, Scale, one_of
from fedlmc.scale.arrivals import ArrivalGrid
from fedlmc.scale.cpu import available_cores
from fedlmc.scale.replies import ReplyError, ReplyStore, StoredModel
from fedlmc.strategies.records import MODEL_CONFIG_KEY, model_from_arrays, state_arrays
from fedlmc.strategies.validation import InvalidReply, check_arrays, check_reply
from fedlmc.train import evaluate

# A reply trained from the global model keeps a clear correlation with it (gpt2-tiny: weight cosine 0.82
# after 100 local steps, 0.43 after 1500); an independently started one has none (|cos| ≤ 0.01), and
# seeding the universe with such an unrelated model ruined the merge (4 speaker clients of gpt2-tiny:
# test loss 4.22 against 3.09 from a reply's start; plain average 3.80).
DESCENT_COSINE = 0.1


def weight_cosine(model: nn.Module, reference: nn.Module) -> float:
    """Cosine between ``model``'s weight matrices (tensors of ≥ 2 dimensions: constant-initialised
    gains and biases would correlate any two models) and ``reference``'s same-named tensors, each cut
    to ``model``'s shape (a narrower client's prefix sub-model, as HeteroFL slices it)."""
    ref = reference.state_dict()
    dot = norm_a = norm_b = 0.0
    for k, a in model.state_dict().items():
        b = ref.get(k)
        if a.dim() < 2 or b is None or b.dim() != a.dim() or any(sb < sa for sa, sb in zip(a.shape, b.shape)):
            continue
        a, b = a.double(), b[tuple(slice(0, n) for n in a.shape)].double()
        dot, norm_a, norm_b = dot + float((a * b).sum()), norm_a + float(a.pow(2).sum()), norm_b + float(b.pow(2).sum())
    return dot / (norm_a * norm_b) ** 0.5 if norm_a > 0 and norm_b > 0 else 0.0


@dataclass
class RoundState:
    """What one round's aggregation carries from step to step: the round, the nodes aggregated (in the
    replies' order, shortened as replies are left out), the candidates the guard chose between (the
    report scores them) and what asking the clients cost. Made anew by every ``aggregate_train``;
    nothing of it outlives the round."""

    server_round: int
    nodes: list[int]
    candidates: dict[str, nn.Module] = field(default_factory=dict)
    clients_cost: Optional[dict[str, Any]] = None


class FedlmcStrategy(FedAvg):
    """``FedAvg`` with fedlmc's shared machinery; subclasses implement ``combine``.

    Parameters
    ----------
    model : model or config, optional
        The clients' model or its config: a fedlmc model, ``TransformerConfig`` (or its ``to_dict()``),
        or a ``transformers`` GPT-2, ViT or Llama model or config. With a Hugging Face model, replies
        come, and the aggregate goes back, under that model's own keys (``fedlmc.hf.HFAdapter``). The
        config travels to the clients with every message.
    report : Report, optional
        ``Report(data, batches)`` (e.g. the test split): every round also records each client model's
        loss, the plain average's and the aggregate's (costly: opt-in).
    checks : Checks, optional
        What a round accepts (``fedlmc.options.Checks``): the fewest valid replies it aggregates (else
        the previous model is kept), and the largest weight norm a reply may have, as a multiple of the
        global model's.
    fallback : {"error", "average"}, default "error"
        What ``start`` does with a model the strategy cannot align (no ``model``, or initial arrays that
        are not a model of it): stop with an error that names the fix, or average plainly (warned about
        every round).
    scale : Scale, optional
        Many replies: ``Scale(spool=True)`` writes each accepted reply to disk and reads it back
        (memory-mapped) when needed, so the server holds a few models whatever their number;
        ``Scale(workers=n)`` also aligns them in ``n`` worker processes (or Ray tasks on the cluster at
        ``ray_address``). A reply that cannot be written or read, or whose alignment fails twice, is
        excluded with the reason (``fedlmc.options.Scale``). Replies on disk are for the aligned
        strategies (``AlignedFedAvg``, ``RefinedFedAvg``); the others refuse them. ``Scale(threads=0)``
        combines a round on every core (None leaves the process's torch threads alone), and
        ``Scale(device=...)`` says where the alignments run (CUDA when present, else the CPU).
    **fedavg
        Flower's ``FedAvg`` parameters (``fraction_train``, ``min_available_nodes``...).
    """

    same_shape = True  # replies must have the global model's shape (mixed-width strategies say False)
    stored_replies = False  # combine() reads replies that wait on disk (``scale.on_disk``): the aligned ones
    needs_architecture = False  # strategies that align or slice must know the model before round 1

    def __init__(
        self,
        *,
        model: Any = None,
        report: Optional[Report] = None,
        checks: Optional[Checks] = None,
        fallback: str = "error",
        scale: Optional[Scale] = None,
        **fedavg: Any,
    ) -> None:
        super().__init__(**fedavg)
        one_of(fallback, ("error", "average"), "fallback")
        if fallback != "error" and not self.needs_architecture:
            raise TypeError(
                f"{type(self).__name__} averages arrays it cannot read as Flower's FedAvg does: fallback applies "
                "to the strategies that align or slice (they stop on such arrays unless fallback='average')"
            )
        self.adapter, self.client_keys, self.unknown_model = None, None, None
        self.global_config = self._config_of(model, fallback)
        self.fallback, self.arrays_only_reason = fallback, None
        self._ready = False  # check_architecture has run (start(), or the first configure / aggregate call)
        self._returned: Optional[ArrayRecord] = None  # the last aggregate this strategy returned
        self.report_data, self.report_batches = (report.data, report.batches) if report is not None else (None, None)
        self.checks = checks if checks is not None else Checks()
        self.history: list[dict[str, Any]] = []
        self.round_offset = 0  # rounds completed before this run started (a resumed run continues numbering)
        self._previous: Optional[ArrayRecord] = None
        self.round: Optional[RoundState] = None  # the round being aggregated (None between rounds)
        self.grid = None  # the round's grid (configure_train's): strategies that ask the clients more use it
        self._excluded: list[dict[str, Any]] = []
        self._partitions: dict[str, int] = {}
        self._failures: list[dict[str, Any]] = []
        self.scale = scale if scale is not None else Scale()
        if self.scale.on_disk and not self.stored_replies:
            raise ValueError(
                f"{type(self).__name__} combines replies held in memory: scale=Scale(spool=..., workers=...) is "
                "for AlignedFedAvg and RefinedFedAvg"
            )
        self.store: Optional[ReplyStore] = None  # this round's replies on disk (with ``scale.on_disk``)
        self._arrived: dict[tuple, Any] = {}  # arrival_key → (model, weight) or the reason, read as it arrived
        self._cosines: dict[str, float] = {}  # a stored reply's file → its weight_cosine with the global model
        self._previous_for_arrivals: Optional[tuple[ArrayRecord, nn.Module]] = None
        self._norm_of, self._norm = None, None  # the global model whose norm ``_reference_norm`` holds

    def _config_of(self, model: Any, fallback: str) -> Optional[dict[str, Any]]:
        """The global model's fedlmc config (as a dict) from ``model``; sets the Hugging Face adapter."""
        if model is None:
            return None
        cfg = getattr(model, "config", model)
        if isinstance(cfg, TransformerConfig):
            return cfg.to_dict()
        if isinstance(cfg, dict) and "arch" in cfg:
            return dict(cfg)
        if hasattr(cfg, "model_type"):  # a transformers model or config (clear error for an unsupported family)
            self.adapter = HFAdapter(cfg)
            return self.adapter.config.to_dict()
        reason = (
            f"{type(self).__name__}(model=...) got a {type(model).__name__}, which is neither a fedlmc nor a "
            "Hugging Face GPT-2 / ViT / Llama model: describe your own Transformer's parameters with "
            "fedlmc.symmetry.Roles (docs: models), or pass fallback='average' to average it plainly"
        )
        if fallback == "error" and self.needs_architecture:
            raise ValueError(reason)
        self.unknown_model = reason
        return None

    # ---- what subclasses provide ------------------------------------------------------------------
    def combine(
        self, server_round: int, replies: list[Message], models: list[nn.Module], weights: list[float]
    ) -> tuple[nn.Module, dict[str, Any], Optional[nn.Module]]:
        """The aggregate of the accepted ``replies`` (also given as ``models`` and their ``weights``),
        the fields it adds to the round's record, and the plain average when it was built (for the
        report). Must be overridden."""
        raise NotImplementedError

    def messages_for(self, messages: Iterable[Message], config: ConfigRecord, message_type: str) -> Iterable[Message]:
        """The messages actually sent (default: Flower's, unchanged)."""
        return messages

    # ---- Flower's hooks -------------------------------------------------------------------------------
    def real_round(self, server_round: int) -> int:
        """Flower's round counter shifted by ``round_offset`` (set when a run resumes from a checkpoint)."""
        return server_round + self.round_offset

    def _with_config(self, config: ConfigRecord) -> ConfigRecord:
        if self.global_config is not None:
            config[MODEL_CONFIG_KEY] = json.dumps(self.global_config)
        return config

    def aggregate_replies(
        self, server_round: int, replies: list[Message], global_arrays: ArrayRecord, grid=None
    ) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        """``aggregate_train`` outside Flower's loop, for replies trained from ``global_arrays``: several
        strategies aggregating the very same replies (a side-by-side comparison). ``grid``: where
        strategies that ask the clients more (the refinement on the clients) send their messages."""
        self.check_architecture(global_arrays)
        self._previous = global_arrays
        if grid is not None:
            self.grid = grid
        return self.aggregate_train(server_round, replies)

    def _ensure_ready(self, arrays: Optional[ArrayRecord]) -> None:
        """What ``start`` does before round 1, on first use instead when a wrapper (Flower's DP wrappers)
        calls ``configure_train`` / ``aggregate_train`` directly: the architecture check and the fallback
        decision, on the arrays Flower passes."""
        if not self._ready:
            self.check_architecture(arrays)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        self._ensure_ready(arrays)
        self._previous = arrays  # this round's aggregate starts from (and is checked against) the global model
        self.grid = grid
        if self.scale.on_disk and self.arrays_only_reason is None:  # replies written to disk as they arrive
            self._close_store()
            self.store, self._arrived = ReplyStore(self.scale.spool_dir), {}
        msgs = super().configure_train(self.real_round(server_round), arrays, self._with_config(config), grid)
        return self.messages_for(msgs, config, MessageType.TRAIN)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid
    ) -> Iterable[Message]:
        msgs = super().configure_evaluate(self.real_round(server_round), arrays, self._with_config(config), grid)
        return self.messages_for(msgs, config, MessageType.EVALUATE)

    def start(self, grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any):
        """Flower's ``start``, after checking that this strategy can handle the model at all. With
        ``scale.on_disk`` each train reply is validated and written to disk as it arrives
        (``ArrivalGrid``), so the round never holds every reply's arrays at once."""
        self.check_architecture(initial_arrays)
        if self.scale.on_disk:
            grid = ArrivalGrid(grid, self.arrived)
        try:
            return super().start(grid, initial_arrays, *args, **kwargs)
        finally:
            self._close_store()

    def summary(self) -> None:
        """Flower's summary; under a wrapper (Flower's DP wrappers call it from their ``start``, which
        this strategy's own never runs), ``Scale(spool=True)`` also hooks the grid that ``start`` runs
        on, so that train replies are written to disk as they arrive, as under this strategy's own
        ``start``."""
        super().summary()
        if self.scale.on_disk:
            wrapper, grid = _starting(self)
            if wrapper is not None:
                self._hook_grid(wrapper, grid)

    def _hook_grid(self, wrapper, grid) -> None:
        """Spool this strategy's train replies as they arrive through ``grid`` (its ``send_and_receive``
        goes through an ``ArrivalGrid``; every other message passes through unchanged, and so does every
        message outside this strategy's rounds), provided ``wrapper`` hands the replies on unchanged
        (Flower's client-side DP wrappers). A wrapper that rewrites them first (server-side clipping)
        needs them in memory: they are then written to disk when this strategy reads them."""
        if not isinstance(wrapper, PASS_THROUGH):
            log(
                INFO,
                "%s: %s rewrites the replies before they are aggregated, so they wait in memory until then",
                type(self).__name__,
                type(wrapper).__name__,
            )
            return
        if grid is None or not all(hasattr(grid, f) for f in ("push_messages", "pull_messages")):
            return  # a grid of replies all at once: they are written to disk when read
        try:
            grid.send_and_receive = ArrivalGrid(grid, self.arrived).send_and_receive
        except AttributeError:  # a grid that takes no attribute: replies are written when read
            pass

    def arrived(self, msg: Message) -> Message:
        """A reply as it arrives (``ArrivalGrid``): a train reply is read, validated and written to this
        round's store, and its arrays are dropped from the message (the file holds them now)."""
        if self.store is None or msg.has_error() or msg.metadata.message_type != MessageType.TRAIN:
            return msg
        try:
            self._arrived[arrival_key(msg)] = self.read_reply(msg, self._reference_norm(), seen=self.on_arrival)
        except (InvalidReply, ReplyError) as e:
            self._arrived[arrival_key(msg)] = str(e)
        if self.arrayrecord_key in msg.content:
            del msg.content[self.arrayrecord_key]
        return msg

    def on_arrival(self, handle: StoredModel, model: nn.Module, weight: float) -> None:
        """What is computed from a reply while it is in memory, as it arrives (everything else reads it
        back from its file ``handle``): its ``weight_cosine`` with the global model, for ``start_for``."""
        if self._previous is None or self.global_config is None:
            return
        if self._previous_for_arrivals is None or self._previous_for_arrivals[0] is not self._previous:
            self._previous_for_arrivals = (self._previous, self.model_of(self._previous))
        self._cosines[handle.path] = weight_cosine(model, self._previous_for_arrivals[1])

    def _close_store(self) -> None:
        if self.store is not None:
            self.store.close()  # the round's files: nothing is left on disk after a round
            self.store, self._arrived = None, {}
        self._cosines, self._previous_for_arrivals = {}, None

    def check_architecture(self, arrays: Optional[ArrayRecord]) -> None:
        """A model the strategy cannot align is an error before the first round (naming the fix), not a
        federation that silently stops learning because every reply is excluded; with
        ``fallback="average"`` it is averaged plainly instead, with a warning every round. A strategy
        that needs no architecture (``AverageFedAvg``, ``KrumFedAvg``) averages such replies as
        Flower's FedAvg does. ``arrays``: the global arrays (None: not known yet)."""
        self._ready = True
        if self.adapter is not None and arrays is not None:
            self.client_keys = sorted(arrays.keys())
        reason = self._unreadable(arrays)
        if reason is None:
            return
        if not self.needs_architecture:
            self.arrays_only_reason = reason
            log(INFO, "%s: %s; its replies are averaged as Flower's FedAvg averages them", type(self).__name__, reason)
            return
        if self.fallback == "error":
            raise ValueError(reason + "; or pass fallback='average' to average such a model plainly")
        self.arrays_only_reason = reason
        log(WARNING, "%s; averaging plainly (fallback='average')", reason)

    def _unreadable(self, arrays: Optional[ArrayRecord]) -> Optional[str]:
        """Why this strategy cannot read ``arrays`` as its model (None: it can, or cannot tell yet)."""
        name = type(self).__name__
        hf_class = recognise(arrays.keys()) if self.global_config is None and arrays is not None else None
        if hf_class is not None:
            return (
                f"{name}: these are a Hugging Face {hf_class}'s weights, whose head count is not in the "
                f"weights: pass model=<your {hf_class} or its config>"
            )
        if self.unknown_model is not None:
            return self.unknown_model
        if self.global_config is None:
            if not self.needs_architecture:
                return f"{name} has no model (model=...)"
            return (
                f"{name} needs the model's architecture to align replies and was given none: pass "
                "model=<your model or its config> (a fedlmc, Hugging Face GPT-2 / ViT / Llama model), or "
                "describe your own Transformer (fedlmc.models.register_architecture + fedlmc.symmetry.register_spec)"
            )
        if arrays is None:
            return None
        if self.adapter is not None:
            mismatch = self.adapter.mismatch(arrays.keys())
            if not mismatch:
                return None
            return f"{name}: the initial arrays are not a {self.adapter.describe()} of the given model ({mismatch})"
        try:
            model_from_arrays(arrays, self.global_config)
            return None
        except Exception as e:  # noqa: BLE001 -- any mismatch is reported with its cause
            why = _key_mismatch(arrays, self.global_config) or e
            return f"{name}: the initial arrays are not a model of the given model ({why})"

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        self._ensure_ready(self._previous)
        if self.arrays_only_reason is not None:
            if self.needs_architecture:
                log(
                    WARNING,
                    "round %d: averaging plainly, not aligning: %s",
                    self.real_round(server_round),
                    self.arrays_only_reason,
                )
            try:
                return self._arrays_round(self.real_round(server_round), replies)
            finally:
                self._close_store()
        server_round = self.real_round(server_round)
        if self.scale.on_disk and self.store is None:  # outside Flower's loop (aggregate_replies)
            self.store = ReplyStore(self.scale.spool_dir)
        try:
            return self._aggregate(server_round, replies)
        finally:
            self._close_store()

    def _aggregate(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        accepted = self.accept(server_round, replies)
        if accepted is None:
            return None, None
        valid, models, weights = accepted
        if self.global_config is None:
            self.global_config = models[0].config.to_dict()
        t0 = time.time()
        self.round = RoundState(server_round, [node_of(m) for m in valid])
        try:
            with torch_threads(self.scale.threads) as threads:
                result, fields, plain = self.combine(server_round, valid, models, weights)
            return self._recorded(server_round, valid, models, result, fields, plain, threads, t0)
        finally:
            self.round = None

    def _recorded(self, server_round, valid, models, result, fields, plain, threads, t0):
        """The round's record (with the report's scores), its train metrics and the aggregate's arrays."""
        record = self.round_record(server_round, nodes=[node_of(m) for m in valid], threads=threads, **fields)
        record.setdefault("align_seconds", time.time() - t0)
        self.report(record, models, result, plain)
        record["seconds"] = time.time() - t0
        metrics = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        record["train_metrics"] = dict(metrics) if metrics is not None else {}
        arrays = self.arrays_of(result)
        record["model_bytes"] = sum(a.numel() * a.element_size() for a in arrays.to_torch_state_dict().values())
        self.history.append(record)
        self.global_config = result.config.to_dict()
        self._returned = arrays
        return arrays, metrics

    # ---- replies that are not a model this strategy reads: Flower's aggregation, validated ------------------
    def _arrays_round(self, server_round: int, replies: Iterable[Message]):
        """Flower's aggregation of the replies (``combine_arrays``), after what can be validated without a
        model: each reply's weight, its arrays' keys and shapes against the global arrays sent (else the
        first reply's), finite values and the norm bound. The round is recorded as the others are."""
        replies = sorted(self._received(server_round, replies), key=reply_order)
        self._excluded = []
        reference = self._previous if self._previous is not None and len(self._previous) else None
        shapes = None if reference is None else {k: tuple(a.shape) for k, a in reference.items()}
        kept, weights = [], []
        for msg in replies:
            try:
                sd, w = check_arrays(
                    msg.content,
                    arrays_key=self.arrayrecord_key,
                    weight_key=self.weighted_by_key,
                    reference=shapes,
                    reference_norm=self._reference_norm(),
                    max_norm_ratio=self.checks.max_norm_ratio,
                )
            except InvalidReply as e:
                self.exclude(server_round, node_of(msg), str(e))
                continue
            shapes = shapes or {k: tuple(v.shape) for k, v in sd.items()}
            kept.append(msg)
            weights.append(w)
        if len(kept) < self.checks.min_replies:
            self._too_few(server_round, len(kept))
            return None, None  # Flower's contract: start() keeps the current arrays
        t0 = time.time()
        arrays, fields = self.combine_arrays(server_round, kept, weights)
        metrics = self.train_metrics_aggr_fn([m.content for m in kept], self.weighted_by_key)
        record = self.round_record(server_round, nodes=[node_of(m) for m in kept], arrays_only=True, **fields)
        record.update(align_seconds=time.time() - t0, train_metrics=dict(metrics) if metrics is not None else {})
        self.history.append(record)
        self._returned = arrays
        return arrays, metrics

    def combine_arrays(self, server_round: int, replies: list[Message], weights: list[float]):
        """The aggregate of replies read as arrays only, and the round record's fields: Flower's weighted
        mean (``aggregate_arrayrecords``), or with ``robust`` its FedMedian / FedTrimmedAvg result."""
        robust = getattr(self, "robust", None)
        contents = [m.content for m in replies]
        if robust is None or robust.reduce == "average":
            return aggregate_arrayrecords(contents, self.weighted_by_key), {"kept": "average"}
        return robust_arrays([c[self.arrayrecord_key] for c in contents], robust), {"kept": robust.reduce}

    def adapter_for(self, msg: Message) -> Optional[HFAdapter]:
        """The adapter a reply is read with (None: fedlmc keys); mixed-width strategies pick by shapes."""
        return self.adapter

    def arrays_of(self, model: nn.Module) -> ArrayRecord:
        """A fedlmc model as the ArrayRecord the clients load: their own keys and form with an adapter."""
        if self.adapter is None:
            return state_arrays(model)
        return ArrayRecord(torch_state_dict=self.adapter.to_client(model, self.client_keys))

    def returned_model(self, global_model: nn.Module, key: int, config: TransformerConfig) -> nn.Module:
        """The model client ``key`` (its partition, else its node) of architecture ``config`` trains next
        round: the global model, cut to the client's width and first blocks as fedlmc's ClientApp cuts a
        larger model it is sent (strategies that send each client its own model override this)."""
        from fedlmc.merging.widths import slice_prefix

        same = config.to_dict() == global_model.config.replace(norm=config.norm, norm_bias=config.norm_bias).to_dict()
        return global_model if same else slice_prefix(global_model, config)

    def model_of(self, arrays: ArrayRecord) -> nn.Module:
        """The fedlmc model of arrays in the clients' form (the inverse of ``arrays_of``)."""
        if self.adapter is not None:
            return self.adapter.to_fedlmc(arrays.to_torch_state_dict())
        return model_from_arrays(arrays, self.global_config)

    # ---- shared pieces ----------------------------------------------------------------------------------
    def accept(self, server_round: int, replies: Iterable[Message]):
        """The replies that pass validation (see ``strategies.validation``) as (messages, models, weights);
        each excluded reply gets one log line naming its node and the reason, and every failed message is
        logged and recorded. Returns None (and logs that the previous global model is kept) when fewer
        than ``checks.min_replies`` remain."""
        ok = sorted(self._received(server_round, replies), key=reply_order)
        ref_norm = self._reference_norm() if any(arrival_key(m) not in self._arrived for m in ok) else None
        kept, models, weights, self._excluded = [], [], [], []
        for msg in ok:
            read = self._arrived.pop(arrival_key(msg), None)  # read as it arrived (ArrivalGrid)
            try:
                if isinstance(read, str):
                    raise InvalidReply(read)
                model, w = read if read is not None else self.read_reply(msg, ref_norm)
            except (InvalidReply, ReplyError) as e:
                self.exclude(server_round, node_of(msg), str(e))
                continue
            kept.append(msg)
            models.append(model)
            weights.append(w)
        if len(kept) < self.checks.min_replies:
            return self._too_few(server_round, len(kept))
        return kept, models, weights

    def _received(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies that are not errors, with the failed messages logged and recorded, and who each
        node is (the partition its client declares)."""
        ok, failed = self._check_and_log_replies(list(replies), is_train=True, validate=False)
        self._failures = [{"node": node_of(m), "reason": str(m.error.reason)} for m in failed]
        self._partitions = {str(node_of(m)): p for m in ok for p in [declared_partition(m)] if p is not None}
        log(
            INFO,
            "%s round %d: replies from nodes %s; failures from nodes %s",
            type(self).__name__,
            server_round,
            sorted(str(node_of(m)) for m in ok) or "none",
            [f["node"] for f in self._failures] or "none",
        )
        return ok

    def _too_few(self, server_round: int, valid: int) -> None:
        """A round with fewer valid replies than ``checks.min_replies``: the previous model is kept, said
        in the log and the history."""
        log(
            WARNING,
            "%s round %d: only %d valid replies (minimum %d): keeping the previous global model",
            type(self).__name__,
            server_round,
            valid,
            self.checks.min_replies,
        )
        self.history.append(self.round_record(server_round, kept="previous", align_seconds=0.0))
        return None

    def _reference_norm(self) -> Optional[float]:
        """The global model's weight norm (a reply's norm is checked against it), once per global model."""
        if self._previous is None:
            return None
        if self._norm_of is not self._previous:
            arrays = self._previous.to_torch_state_dict().values()
            self._norm_of, self._norm = self._previous, sum(float(t.double().pow(2).sum()) for t in arrays) ** 0.5
        return self._norm

    def read_reply(self, msg: Message, ref_norm: Optional[float], seen=None) -> tuple[Any, float]:
        """A reply's model (written to this round's store when there is one: then its ``StoredModel``)
        and weight; ``InvalidReply`` / ``ReplyError`` with the reason. ``seen(handle, model, weight)``
        is called once a stored reply is written, while its model is still in memory."""
        cfg, sd, w = check_reply(
            msg.content,
            arrays_key=self.arrayrecord_key,
            weight_key=self.weighted_by_key,
            reference_config=self.global_config,
            reference_norm=ref_norm,
            same_shape=self.same_shape,
            max_norm_ratio=self.checks.max_norm_ratio,
            adapter=self.adapter_for(msg),
        )
        model = from_config(cfg)
        model.load_state_dict({k: v.float() for k, v in sd.items()})
        del sd
        if self.store is None:
            return model.eval(), w
        # with a store, the reply waits on disk and is read back (memory-mapped) when needed
        handle = self.store.put(model, f"node-{node_of(msg)}")
        if seen is not None:
            seen(handle, model.eval(), w)
        return handle, w

    def exclude(self, server_round: int, node: int, reason: str) -> None:
        """Leave a node's reply out of this round, with one log line and a record naming the reason."""
        log(WARNING, "%s round %d: excluded the reply of node %s: %s", type(self).__name__, server_round, node, reason)
        self._excluded.append({"node": node, "reason": reason})

    def round_record(self, server_round: int, **fields: Any) -> dict[str, Any]:
        """The history record of a round: what every strategy logs (replies excluded by validation,
        failed messages) plus ``fields``."""
        return {
            "round": server_round,
            "strategy": type(self).__name__,
            **fields,
            "excluded": self._excluded,
            "failures": self._failures,
            **({"partitions": self._partitions} if self._partitions else {}),
        }

    def _known_nodes(self, why: str) -> list[int]:
        """The round's nodes, or a ``ValueError`` naming the missing metadata and what needs it."""
        return require_nodes(self, self.round.nodes, why)

    def previous_model(self) -> Optional[nn.Module]:
        """The current global model (the one this round's replies started from), if known."""
        if self._previous is None or self.global_config is None:
            return None
        return self.model_of(self._previous)

    def start_for(self, models: list[nn.Module]) -> Optional[nn.Module]:
        """The universe's start: the previous global model if the replies were trained from it (their
        median ``weight_cosine`` with it ≥ ``DESCENT_COSINE``), else None (the universe then starts
        from a reply). Clients that ignore the global model (one-shot fusion of independently started
        models) are unrelated to it, and a universe seeded by an unrelated model merges badly."""
        previous = self.previous_model()
        if previous is None or not models:
            return None
        cosines = sorted(self._cosine(m, previous) for m in models)
        return previous if cosines[len(cosines) // 2] >= DESCENT_COSINE else None

    def _cosine(self, model: Any, previous: nn.Module) -> float:
        """``weight_cosine`` of a reply with the global model: as computed when it arrived, else now."""
        if isinstance(model, StoredModel) and model.path in self._cosines:
            return self._cosines[model.path]
        return weight_cosine(loaded(model), previous)

    def loss(self, model: nn.Module, data, batches: Optional[int]) -> float:
        return float(evaluate(model, data, max_batches=batches)["loss"])

    def guard_loss(self, guard: Guard, model: nn.Module) -> float:
        """A model's do-no-harm loss: ``guard.fn`` on the clients' form of it, else its loss on ``guard.data``."""
        if guard.fn is not None:
            return float(guard.fn(self.arrays_of(model)))
        return self.loss(model, guard.data, guard.batches)

    def guard_verdict(
        self, candidates: dict[str, nn.Module], losses: dict[str, float], where: str
    ) -> tuple[str, dict[str, Any]]:
        """The do-no-harm guard, for every strategy that has one: the first candidate (the strategy's own
        aggregate) is kept unless another scores strictly lower. Returns the name kept and the round
        record's fields (``guard_<name>`` losses, ``guard_where``); logs the verdict; the report scores
        every candidate."""
        self.round.candidates = dict(candidates)
        first = next(iter(candidates))
        kept = min(losses, key=lambda name: (losses[name], name != first))
        log(
            INFO,
            "%s round %d: kept %s (%s loss %s)",
            type(self).__name__,
            self.round.server_round,
            kept,
            where,
            " vs ".join(f"{name} {loss:.4f}" for name, loss in losses.items()),
        )
        return kept, {**{f"guard_{name}": loss for name, loss in losses.items()}, "guard_where": where}

    def report(
        self, record: dict[str, Any], models: list[nn.Module], result: nn.Module, plain: Optional[nn.Module]
    ) -> None:
        """With a ``report``: each client's loss, the aggregate's, its excess over the mean client,
        the plain average's (when built), each guard candidate's (``report_aligned``, ``report_average``:
        the report's verdict on the guard's choice) and the clients' output ensemble's loss and accuracy."""
        if self.report_data is None:
            return
        clients = [self.loss(loaded(m), self.report_data, self.report_batches) for m in models]
        record["client_losses"] = clients
        record["mean_client_loss"] = sum(clients) / len(clients)
        record["global_loss"] = self.loss(result, self.report_data, self.report_batches)
        record["excess"] = record["global_loss"] - record["mean_client_loss"]
        if plain is not None:
            record["average_loss"] = self.loss(plain, self.report_data, self.report_batches)
            record["average_excess"] = record["average_loss"] - record["mean_client_loss"]
        for name, model in self.round.candidates.items():  # what the guard chose between
            record[f"report_{name}"] = self.loss(model, self.report_data, self.report_batches)
        if len(models) > 1:  # the output ensemble: the reference a single merged model tries to reach
            ens = evaluate(Ensemble([loaded(m) for m in models]), self.report_data, max_batches=self.report_batches)
            record["ensemble_loss"], record["ensemble_acc"] = float(ens["loss"]), float(ens["acc"])

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a checkpoint must keep to resume this strategy (JSON-able, plus ``transforms``)."""
        return {"global_config": self.global_config, "history": self.history, "transforms": {}}

    def load_state(self, state: dict[str, Any], round_offset: int) -> None:
        """Continue from ``state()`` after ``round_offset`` completed rounds."""
        self.global_config, self.history, self.round_offset = state["global_config"], state["history"], round_offset


# wrappers that hand the replies on to the strategy they wrap as the clients sent them (Flower's client-side
# DP wrappers: the clients clip); a server-side clipping wrapper rewrites every reply's arrays first
PASS_THROUGH = (DifferentialPrivacyClientSideFixedClipping, DifferentialPrivacyClientSideAdaptiveClipping)


def _wrapper_of(strategy: Any) -> Any:
    """The strategy that wraps ``strategy`` (holds it as ``.strategy``) and is calling it now, if any."""
    return _starting(strategy, only_wrapper=True)[0]


def _starting(strategy: Any, only_wrapper: bool = False) -> tuple[Any, Any]:
    """The strategy that wraps ``strategy`` and is calling it now, and the grid its ``start`` runs on
    (None, None: no wrapper is calling; the grid is None when the call does not come from ``start``)."""
    from flwr.serverapp.strategy import Strategy

    frame = inspect.currentframe()
    wrapper = None
    try:
        f = frame.f_back if frame is not None else None
        while f is not None:
            caller = f.f_locals.get("self")
            if wrapper is None and caller is not strategy and getattr(caller, "strategy", None) is strategy:
                wrapper = caller
                if only_wrapper:
                    return wrapper, None
            if wrapper is not None and caller is wrapper and f.f_code is Strategy.start.__code__:
                return wrapper, f.f_locals.get("grid")
            f = f.f_back
        return wrapper, None
    finally:
        del frame


def robust_arrays(records: list[ArrayRecord], robust: Robust) -> ArrayRecord:
    """Flower's FedMedian / FedTrimmedAvg of ArrayRecords: the unweighted coordinate-wise median or
    trimmed mean (``robust.trim`` cut at each end), key by key, with Flower's own ``trim_mean``."""
    out = ArrayRecord()
    for key in records[0].keys():
        stacked = np.stack([r[key].numpy() for r in records])
        value = np.median(stacked, axis=0) if robust.reduce == "median" else trim_mean(stacked, robust.trim)
        out[key] = Array(np.asarray(value))
    return out


def node_of(msg: Message) -> Optional[int]:
    """The node a reply came from, or None for a reply without metadata (Flower's ``create_mock_reply``
    in its own strategy tests): plain averaging needs no node's identity; what does says so."""
    try:
        return int(msg.metadata.src_node_id)
    except (AttributeError, TypeError, ValueError):
        return None


def require_nodes(strategy: Any, nodes: list[Optional[int]], why: str) -> list[int]:
    """``nodes`` (replies' ``node_of``), or a ``ValueError`` naming the missing metadata and what needs it."""
    if any(n is None for n in nodes):
        raise ValueError(
            f"{type(strategy).__name__}: replies without metadata (no src_node_id, as Flower's create_mock_reply "
            f"makes them): {why} needs each reply's node"
        )
    return nodes


def arrival_key(msg: Message) -> tuple[int, str]:
    """A reply's key in a round: its node and the message it answers."""
    return node_of(msg), str(getattr(msg.metadata, "reply_to_message_id", ""))


def loaded(model) -> nn.Module:
    """A reply's model: itself, or read from its file (``fedlmc.scale.replies.StoredModel``)."""
    return model.load() if isinstance(model, StoredModel) else model


@contextmanager
def torch_threads(n: Optional[int]) -> Iterator[int]:
    """torch's intra-op threads set to ``n`` (0: one per available core, ``cpu.available_cores``; None:
    unchanged) inside the block, restored after it; yields the count in force."""
    before = torch.get_num_threads()
    if n == 0:
        n = available_cores()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def declared_partition(msg: Message) -> Optional[int]:
    """The partition id a fedlmc client declares in its reply (``client`` ConfigRecord), if any."""
    if msg.has_error():
        return None
    client = msg.content.config_records.get("client")
    pid = client.get("partition-id") if client is not None else None
    return int(pid) if isinstance(pid, int) and not isinstance(pid, bool) else None


def reply_order(msg: Message) -> tuple[int, int]:
    """A fixed order for the replies of a round, whatever order they arrived in: by the partition id a
    fedlmc client declares (its ``client`` ConfigRecord), then by node id. Alignment is discrete, so
    with independently started clients float sums in another order can change what matching finds;
    a resumed run must aggregate exactly as an uninterrupted one."""
    pid = declared_partition(msg)
    node = node_of(msg)
    return (pid if pid is not None else -1, node if node is not None else -1)


def _key_mismatch(arrays: ArrayRecord, config: dict[str, Any]) -> str:
    """The keys a model of ``config`` lacks and has that ``arrays`` do not, briefly ('' if they agree)."""
    try:
        want = set(from_config(config).state_dict())
    except Exception:  # noqa: BLE001 -- an unbuildable config is reported by the caller's exception
        return ""
    return key_mismatch(set(arrays.keys()), want)
