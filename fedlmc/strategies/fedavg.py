"""The baseline: Flower's FedAvg aggregation, unchanged, with what a fair comparison needs around it; or,
with ``reduce``, Flower's robust coordinate-wise aggregates (FedMedian, FedTrimmedAvg)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvgM
from flwr.serverapp.strategy.fedopt import FedOpt
from flwr.serverapp.strategy.multikrum import select_multikrum
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedlmc.averaging import robust_merge
from fedlmc.options import Robust, TaskMerge, one_of
from fedlmc.scaffold import CONTROL_KEY, VARIATES, pack, unpack
from fedlmc.task_vectors import task_vector_merge

from .base import FedlmcStrategy, loaded
from .knobs import ClientKnob, ConfirmedKnobs


class MeanFedAvg(FedlmcStrategy):
    """Flower's FedAvg mean of the replies that pass fedlmc's validation: what the strategies that change
    what is averaged, or how the mean is stepped, start from. It takes no ``robust``: a strategy that
    cannot apply a robust reduction does not accept one.

    Parameters
    ----------
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    def combine(self, server_round, replies, models, weights):
        arrays = aggregate_arrayrecords([m.content for m in replies], self.weighted_by_key)
        return self.model_of(arrays), {"kept": "average"}, None


class ReportingFedAvg(MeanFedAvg):
    """Flower's FedAvg aggregation of the replies that pass fedlmc's validation, plus the model config in
    every message and a per-round history: the baseline the other strategies are compared with.

    Parameters
    ----------
    robust : Robust, optional
        ``Robust(reduce="median" / "trimmed")`` takes the coordinate-wise median / trimmed mean instead,
        as Flower's FedMedian / FedTrimmedAvg do (``fedlmc.options.Robust``).
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    def __init__(self, *, robust: Optional[Robust] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.robust = robust if robust is not None else Robust()

    def combine(self, server_round, replies, models, weights):
        if self.robust.reduce != "mean":
            return robust_merge(models, self.robust.reduce, self.robust.trim), {"kept": self.robust.reduce}, None
        return super().combine(server_round, replies, models, weights)


class KrumFedAvg(MeanFedAvg):
    """Flower's Krum / Multi-Krum on the raw replies (``flwr.serverapp.strategy.MultiKrum``'s own
    ``select_multikrum``), with fedlmc's validation and a record of the replies it left out: the
    raw-coordinate baseline for screening modulo symmetries (``AlignedFedAvg(screen=...)``).

    Parameters
    ----------
    num_malicious_nodes : int, default 1
        Krum's f: each reply's score sums its squared distances to its M − f − 2 nearest replies.
    num_nodes_to_select : int or None, default None
        How many of the lowest-scoring replies are averaged: 1 is Krum; None: M − f (Multi-Krum keeping
        all but f).
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    def __init__(self, *, num_malicious_nodes: int = 1, num_nodes_to_select: Optional[int] = None, **kwargs: Any):
        super().__init__(**kwargs)
        if num_malicious_nodes < 0 or (num_nodes_to_select is not None and num_nodes_to_select < 1):
            raise ValueError(
                f"num_malicious_nodes must be >= 0 and num_nodes_to_select >= 1 (or None), got "
                f"{num_malicious_nodes} and {num_nodes_to_select}"
            )
        self.num_malicious_nodes, self.num_nodes_to_select = num_malicious_nodes, num_nodes_to_select

    def combine(self, server_round, replies, models, weights):
        keep, fields = self._select(server_round, replies)
        for seq in (replies, models, weights):
            seq[:] = [seq[i] for i in keep]
        arrays = aggregate_arrayrecords([m.content for m in replies], self.weighted_by_key)
        return self.model_of(arrays), fields, None

    def combine_arrays(self, server_round, replies, weights):
        keep, fields = self._select(server_round, replies)
        return aggregate_arrayrecords([replies[i].content for i in keep], self.weighted_by_key), fields

    def _select(self, server_round: int, replies: list) -> tuple[list[int], dict]:
        """The indices of the replies Flower's Multi-Krum selection keeps (the others are excluded, each
        with a reason) and the round record's fields."""
        contents = [m.content for m in replies]
        f = self.num_malicious_nodes
        select = self.num_nodes_to_select or max(1, len(replies) - f)
        chosen = {id(c) for c in select_multikrum(contents, num_malicious_nodes=f, num_nodes_to_select=select)}
        nodes = [int(m.metadata.src_node_id) for m in replies]
        left_out = [i for i, c in enumerate(contents) if id(c) not in chosen]
        for i in left_out:
            self.exclude(server_round, nodes[i], f"Krum (raw coordinates, f={f}): not among the {select} selected")
        screened = {"method": "krum-raw", "excluded": [nodes[i] for i in left_out]}
        keep = [i for i in range(len(replies)) if i not in left_out]
        return keep, {"kept": "krum" if select == 1 else "multikrum", "screen": screened}


PROXIMAL = ClientKnob(
    "proximal-mu",
    "fedlmc's ClientApp (clients/app.py) adds mu / 2 · ‖w − w_global‖² to its local loss "
    "(fedlmc.train.TrainConfig(proximal_mu=...)) and confirms it with "
    "fedlmc.strategies.knobs.confirm(metrics, config, 'proximal-mu'); a ClientApp of your own must do both.",
)
SCAFFOLD = ClientKnob(
    CONTROL_KEY,
    "fedlmc's ClientApp (clients/app.py) corrects its gradients by c − c_i (fedlmc.scaffold.correct), answers "
    "Δc_i in its 'scaffold' ConfigRecord and confirms it with "
    "fedlmc.strategies.knobs.confirm(metrics, config, 'scaffold'); a ClientApp of your own must do the same.",
)


class FedProxFedAvg(ConfirmedKnobs, ReportingFedAvg):
    """FedProx (Li et al., 2020) as Flower has it: FedAvg's aggregation, and every train message tells the
    clients the proximal term's weight (config ``proximal-mu``), which fedlmc's ClientApp adds to its
    local loss as ``mu / 2 · ‖w − w_global‖²`` (``TrainConfig.proximal_mu``).

    Parameters
    ----------
    proximal_mu : float, default 0.0
        The proximal term's weight (0: FedAvg, bit for bit).
    unconfirmed : {"warn", "error"}, default "warn"
        A round whose replies do not confirm the proximal term (``applied-proximal-mu``, a ClientApp that
        does not run FedProx) is warned about, or refused (``fedlmc.strategies.knobs.ConfirmedKnobs``).
    **kwargs
        ``ReportingFedAvg``'s parameters.
    """

    def __init__(self, *, proximal_mu: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if proximal_mu < 0:
            raise ValueError(f"proximal_mu must be non-negative, got {proximal_mu}")
        self.proximal_mu = proximal_mu

    def client_knobs(self) -> list[ClientKnob]:
        return [PROXIMAL] if self.proximal_mu > 0 else []

    def configure_train(self, server_round: int, arrays, config: ConfigRecord, grid):
        config["proximal-mu"] = self.proximal_mu
        return super().configure_train(server_round, arrays, config, grid)


class ServerOptFedAvg(MeanFedAvg):
    """A server optimiser of Flower's (``FedAvgM``, ``FedAdam``, ``FedYogi``, ``FedAdagrad``: Reddi et al.,
    2021) with fedlmc's validation and history: the valid replies go to the Flower strategy, whose own
    ``aggregate_train`` takes FedAvg's mean and steps from the previous global model with its state
    (momentum, moments) kept across rounds.

    Parameters
    ----------
    optimiser : flwr.serverapp.strategy.FedAvgM or FedOpt (FedAdam, FedYogi, FedAdagrad)
        The Flower strategy whose aggregation is used, with its hyper-parameters (``FedAdam(eta=0.01)``).
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    def __init__(self, *, optimiser: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(optimiser, (FedAvgM, FedOpt)):
            raise ValueError(f"optimiser must be Flower's FedAvgM, FedAdam, FedYogi or FedAdagrad, got {optimiser!r}")
        self.optimiser = optimiser

    def _step(self, server_round: int, replies: list) -> ArrayRecord:
        """The optimiser's aggregate of ``replies``, stepping from the global model sent this round."""
        if self._previous is None:
            raise RuntimeError(f"{type(self).__name__} steps from the global model: configure_train first")
        opt = self.optimiser
        if isinstance(opt, FedOpt):
            opt.current_arrays = {k: a.numpy() for k, a in self._previous.items()}
        else:
            opt.current_arrays = self._previous
        arrays, _ = opt.aggregate_train(server_round, replies)
        return arrays

    def combine(self, server_round, replies, models, weights):
        name = type(self.optimiser).__name__.lower()
        return self.model_of(self._step(server_round, replies)), {"kept": name}, None

    def combine_arrays(self, server_round, replies, weights):
        return self._step(server_round, replies), {"kept": type(self.optimiser).__name__.lower()}


class TaskVectorFedAvg(MeanFedAvg):
    """Task-vector merges for federations that fine-tune one shared base (Task Arithmetic, TIES, DARE,
    Model Stock: ``fedlmc.task_vectors``): each reply's task vector is its model minus the global model
    the round sent, and the merged task vector is added to that model.

    Parameters
    ----------
    merge : TaskMerge, optional
        The method and its knobs (``fedlmc.options.TaskMerge``); default Task Arithmetic at λ = 1, which
        is FedAvg.
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    def __init__(self, *, merge: Optional[TaskMerge] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.merge = merge if merge is not None else TaskMerge()

    def _base(self):
        if self._previous is None:
            raise RuntimeError(
                f"{type(self).__name__} merges task vectors from the global model: configure_train first"
            )
        return self._previous

    def combine(self, server_round, replies, models, weights):
        self._base()
        base = self.previous_model()
        states = [loaded(m).state_dict() for m in models]
        base.load_state_dict(task_vector_merge(base.state_dict(), states, weights, self.merge))
        return base, {"kept": self.merge.method}, None

    def combine_arrays(self, server_round, replies, weights):
        base = self._base().to_torch_state_dict()
        states = [m.content[self.arrayrecord_key].to_torch_state_dict() for m in replies]
        merged = task_vector_merge(base, states, weights, self.merge)
        return ArrayRecord(torch_state_dict=merged), {"kept": self.merge.method}


class ScaffoldFedAvg(ConfirmedKnobs, MeanFedAvg):
    """SCAFFOLD (Karimireddy et al., ICML 2020) on Flower's Message API: every train message carries the
    server's control variate ``c`` (config key ``scaffold``, safetensors bytes); fedlmc's ClientApp
    keeps its own variate in the node's ``context.state``, corrects its gradients by ``c − c_i`` and
    answers with ``Δc_i`` (``fedlmc.scaffold``). The model is aggregated as FedAvg's (global learning
    rate 1, weighted by ``num-examples``) and ``c ← c + |S|/N · Σ wᵢ Δc_i`` over the S replies of N nodes
    with the same weights ``wᵢ`` (normalised over the replies), so that with every node taking part ``c``
    is the weighted mean of the ``c_i`` and the corrections ``c − c_i`` cancel in the aggregate, as the
    paper's uniform means do. A reply without ``Δc_i`` (a ClientApp that does not run SCAFFOLD) is
    aggregated and counted as ``Δc_i = 0``, and the round records its node.

    Parameters
    ----------
    variate : {"trajectory", "gradient"}, default "trajectory"
        How the clients compute their new variate c_i⁺: the paper's option II (from the steps just taken)
        or option I (the local gradient at the received model); sent in every train message's config
        (``scaffold-variate``).
    unconfirmed : {"warn", "error"}, default "warn"
        A round whose replies do not confirm the control variates (``applied-scaffold``) is warned
        about, or refused (``fedlmc.strategies.knobs.ConfirmedKnobs``).
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters (no ``robust``: SCAFFOLD averages the
        replies and their control variates).
    """

    def __init__(self, *, variate: str = "trajectory", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        one_of(variate, VARIATES, "variate")
        self.variate = variate
        self.control: dict = {}
        self._nodes = 0

    def client_knobs(self) -> list[ClientKnob]:
        return [SCAFFOLD]

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid):
        config[CONTROL_KEY] = pack(self.control)
        config["scaffold-variate"] = self.variate
        self._nodes = len(list(grid.get_node_ids()))
        return super().configure_train(server_round, arrays, config, grid)

    def combine(self, server_round, replies, models, weights):
        merged, fields, plain = super().combine(server_round, replies, models, weights)
        return merged, {**fields, **self._update_control(replies, weights)}, plain

    def combine_arrays(self, server_round, replies, weights):
        arrays, fields = super().combine_arrays(server_round, replies, weights)
        return arrays, {**fields, **self._update_control(replies, weights)}

    def _update_control(self, replies: list, weights: list[float]) -> dict[str, Any]:
        """``c ← c + |S|/N · Σ wᵢ Δc_i`` from the replies (``weights``: the model's); the round's fields."""
        deltas, missing, fresh = [], [], []
        total = float(sum(weights))
        for msg, w in zip(replies, weights):
            rec = msg.content.config_records.get(CONTROL_KEY)
            if rec is None or "delta" not in rec:
                missing.append(int(msg.metadata.src_node_id))
                continue
            deltas.append((w / total, unpack(rec["delta"])))
            if not rec.get("had-variate", True):
                fresh.append(int(msg.metadata.src_node_id))
        share = len(replies) / max(self._nodes, len(replies))
        for name in set().union(*(d for _, d in deltas)):
            mean = sum(w * d[name] for w, d in deltas if name in d)
            self.control[name] = self.control.get(name, torch.zeros_like(mean)) + share * mean
        fields: dict[str, Any] = {
            "scaffold_control_norm": float(sum(float(c.pow(2).sum()) for c in self.control.values()) ** 0.5)
        }
        if missing:
            fields["scaffold_missing"] = missing
        if fresh:  # clients with no variate of their own yet (their first round, or a node that lost its state)
            fields["scaffold_new_variates"] = fresh
        return fields

    def state(self) -> dict[str, Any]:
        return {**super().state(), "scaffold_control": {k: v.tolist() for k, v in self.control.items()}}

    def load_state(self, state: dict[str, Any], round_offset: int) -> None:
        super().load_state(state, round_offset)
        self.control = {k: torch.tensor(v) for k, v in state.get("scaffold_control", {}).items()}
