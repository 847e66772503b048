"""fedlmc ClientApp (Message API): trains the configured preset (ViT or GPT-2) on this node's partition.

Node config: ``partition-id`` and ``num-partitions`` (set by the simulation engine, or by
``flower-supernode --node-config``), optionally ``width-factor`` (this node trains at 1/width-factor of
the width). Run config: see ``fedlmc.federated.Settings``. A train reply carries the weights
(``arrays``), metrics (``metrics``: ``num-examples`` and the train loss — only quantities whose
weighted mean means something), the model's config (``model``: architecture and width) and who the
client is (``client``: partition id, training seconds).

For the ``*-clients`` strategies (no server data) it also answers refinement queries (``query.refine``:
the gradient of its loss at a merged model, or per-example held-out losses; ``fedlmc.flower.on_clients.answer``)
on its validation partition, and scores the guard's candidates (an evaluate with ``purpose = "guard"``)
on that partition's other half (``fedlmc.federated.refine_parts``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedlmc.baselines.scaffold import CONTROL_KEY, client_round, correct, pack, remove, trajectory_variate, unpack
from fedlmc.federated import (
    Settings,
    client_config,
    client_data,
    config_from_json,
    evaluate_model,
    fresh_client_model,
    local_train,
    refine_parts,
)
from fedlmc.flower.on_clients import answer
from fedlmc.hf import Logits, hf_model_for
from fedlmc.merging.distill import Taught
from fedlmc.merging.widths import shape_of, slice_prefix
from fedlmc.strategies.knobs import confirm
from fedlmc.strategies.records import MODEL_CONFIG_KEY, config_record, model_from_arrays


@dataclass
class Round:
    """What a client knows about the round it trains: its partition, the federation's size, the round."""

    partition: int
    partitions: int
    round: int
    seed: int


# fit(model, data, settings, round) -> history: trains ``model`` in place (default: ``local_train``)
Fit = Callable[[Any, Any, Settings, Round], dict]


def fit(model, data, s: Settings, rnd: Round) -> dict:
    """Local training: ``local_train`` on this client's partition."""
    return local_train(model, data, s, rnd.seed)


def _node(context: Context, overrides: dict, settings: type[Settings]) -> tuple[Settings, int, int, object]:
    s = settings.from_run_config({**overrides, **context.run_config}, client=True)
    s.apply_threads()
    nc = context.node_config
    pid, n = int(nc["partition-id"]), int(nc["num-partitions"])
    factor, depth = nc.get("width-factor"), nc.get("depth-factor")
    cfg = client_config(
        s, pid, float(factor) if factor is not None else None, float(depth) if depth is not None else None
    )
    return s, pid, n, cfg


def _received(msg: Message, own_cfg, s: Settings):
    """The model the server sent, at this client's width and depth (HeteroFL-style prefix when it sent a
    wider one, its first blocks when it sent a deeper one);
    with ``hf``, the preset's Hugging Face twin loaded strictly from the arrays (its own keys)."""
    if s.hf:
        model = hf_model_for(own_cfg)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict(), strict=True)
        return model
    config = msg.content["config"]
    if MODEL_CONFIG_KEY not in config:
        raise ValueError(
            "the server's message carries no model config (ConfigRecord key "
            f"'{MODEL_CONFIG_KEY}'): use a fedlmc strategy or add it to the train config"
        )
    cfg = config_from_json(str(config[MODEL_CONFIG_KEY]))
    model = model_from_arrays(msg.content["arrays"], cfg.to_dict())
    if shape_of(cfg) != shape_of(own_cfg) or cfg.n_layer != own_cfg.n_layer:  # a prefix: first blocks, widths
        model = slice_prefix(model, own_cfg.replace(norm=cfg.norm, norm_bias=cfg.norm_bias))
    return model


def train(
    msg: Message,
    context: Context,
    overrides: Optional[dict] = None,
    settings: type[Settings] = Settings,
    fit_fn: Fit = fit,
) -> Message:
    """Train the received (or, with independent start in round 1, a fresh) model on this partition."""
    s, pid, n, cfg = _node(context, overrides or {}, settings)
    data, _ = client_data(s, pid, n)
    rnd = int(msg.content["config"].get("server-round", 1))
    s = s.with_sent(msg.content["config"])  # what the strategy sends its clients (FedProx's mu, SCAFFOLD's variate)
    if s.independent_start and rnd == 1:
        model = fresh_client_model(s, pid, cfg)
    else:
        model = _received(msg, cfg, s)
    t0 = time.time()
    scaffold = _scaffold_start(msg, context, model, data, s)
    try:
        hist = fit_fn(model, data, s, Round(pid, n, rnd, seed=1000 * (s.seed + 1) + 100 * rnd + pid))
    finally:
        remove(scaffold[2] if scaffold else ())
    if scaffold and s.key("scaffold-variate") == "trajectory":  # option II: c_i⁺ from the steps just taken
        trained = Logits(model) if s.hf else model
        scaffold = (*trajectory_variate(scaffold[4], trained, *scaffold[5], hist["steps"], s.lr), *scaffold[2:])
    last = [v for _, v in hist["train_loss"][-5:]] or [float("nan")]
    # only quantities whose num-examples-weighted mean means something are metrics; who the client is
    # (partition, width) and how long it took travel as configuration
    metrics = MetricRecord({"num-examples": len(data), "train-loss": sum(last) / len(last)})
    confirm(metrics, msg.content["config"], "proximal-mu", *([CONTROL_KEY] if scaffold else []))
    client = ConfigRecord({"partition-id": pid, "train-seconds": time.time() - t0})
    state = {k: v.detach().cpu().float() for k, v in model.state_dict().items()}
    content = RecordDict({"arrays": ArrayRecord(torch_state_dict=state), "metrics": metrics, "client": client})
    if not s.hf:  # a Hugging Face client declares nothing: the server knows its model (model=)
        content["model"] = config_record(model)
    if msg.content["config"].get("keep-model"):  # distillation on the clients: this model is the teacher
        context.state[TEACHER_KEY] = ArrayRecord(torch_state_dict=state)
    if scaffold:  # SCAFFOLD: keep c_i⁺ for the next round, answer with Δc_i
        context.state[CONTROL_KEY] = ConfigRecord({"control": pack(scaffold[0])})
        content[CONTROL_KEY] = ConfigRecord({"delta": pack(scaffold[1]), "had-variate": scaffold[3]})
    return Message(content=content, reply_to=msg)


def _scaffold_start(msg: Message, context: Context, model, data, s: Settings) -> Optional[tuple]:
    """SCAFFOLD (the server sent its control variate ``c``): this client's new variate, its change, the
    hooks that correct its gradients by ``c − c_i`` while it trains (``fedlmc.baselines.scaffold``) and whether it
    had a variate already (kept in the node's state since an earlier round); None for every other
    strategy."""
    config = msg.content["config"]
    if CONTROL_KEY not in config:
        return None
    mine = unpack(context.state[CONTROL_KEY]["control"]) if CONTROL_KEY in context.state else {}
    trained, control = (Logits(model) if s.hf else model), unpack(config[CONTROL_KEY])
    if s.key("scaffold-variate") == "trajectory":  # option II: the variate comes after training (see fit)
        start = {k: p.detach().cpu().clone() for k, p in trained.named_parameters()}
        return None, None, correct(trained, control, mine), bool(mine), start, (control, mine)
    return (*client_round(trained, data, s.batch_size, control, mine, s.device or None), bool(mine))


def evaluate(
    msg: Message, context: Context, overrides: Optional[dict] = None, settings: type[Settings] = Settings
) -> Message:
    """Evaluate the received model on this node's validation partition (a guard's candidate: on the
    partition's guard half)."""
    s, pid, n, cfg = _node(context, overrides or {}, settings)
    _, val = client_data(s, pid, n)
    if msg.content["config"].get("purpose") == "guard":
        val = refine_parts(val)[2]
    model = _received(msg, cfg, s)
    ev = evaluate_model(model, val)
    metrics = MetricRecord({"num-examples": len(val), "eval-loss": ev["loss"], "eval-acc": ev["acc"]})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


def refine(
    msg: Message, context: Context, overrides: Optional[dict] = None, settings: type[Settings] = Settings
) -> Message:
    """A refinement query of a ``*-clients`` strategy: the gradient at the merged model it carries on this
    node's refinement data, or the held-out losses for a check (``fedlmc.flower.on_clients.answer``)."""
    s, pid, n, cfg = _node(context, overrides or {}, settings)
    _, val = client_data(s, pid, n)
    train_part, check_part, _ = refine_parts(val)
    if msg.content["config"].get("target") == "own-model":  # distillation: the soft targets of this round's model
        teacher = _teacher(context, cfg, s, str(msg.content["config"]["model-config"]))
        train_part, check_part = (
            Taught(train_part, teacher, s.device or None),
            Taught(check_part, teacher, s.device or None),
        )
    return answer(msg, train_part, check_part, device=s.device or None)


TEACHER_KEY = "teacher"  # the node state's copy of the model it trained last (distillation on the clients)


def _teacher(context: Context, own_cfg, s: Settings, model_config: str):
    """The model this node trained in the round (kept in its state), as the teacher of a distillation."""
    if TEACHER_KEY not in context.state:
        raise ValueError(
            "a distillation query, but this node kept no model: the round's train config had no keep-model"
        )
    state = context.state[TEACHER_KEY].to_torch_state_dict()
    if s.hf:
        model = hf_model_for(own_cfg)
        model.load_state_dict(state, strict=True)
        return Logits(model)
    return model_from_arrays(ArrayRecord(torch_state_dict=state), json.loads(model_config))


def query(msg: Message, context: Context) -> Message:
    """Which partition this node holds (a server that restarted re-learns it: node ids change, partition
    ids do not)."""
    pid = int(context.node_config["partition-id"])
    return Message(content=RecordDict({"client": ConfigRecord({"partition-id": pid})}), reply_to=msg)


def make_app(overrides: Optional[dict] = None, settings: type[Settings] = Settings, fit_fn: Fit = fit) -> ClientApp:
    """A ClientApp whose settings default to ``overrides`` (run_config keys win). ``flwr run`` uses
    ``app``; the experiment layer (``simulations.experiment``) builds one with its own ``settings``
    class and a ``fit_fn`` wrapped around ``fit``."""
    overrides = dict(overrides or {})
    client = ClientApp()

    @client.train()
    def _train(msg: Message, context: Context) -> Message:
        return train(msg, context, overrides, settings, fit_fn)

    @client.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:
        return evaluate(msg, context, overrides, settings)

    @client.query()
    def _query(msg: Message, context: Context) -> Message:
        return query(msg, context)

    @client.query("refine")
    def _refine(msg: Message, context: Context) -> Message:
        return refine(msg, context, overrides, settings)

    return client


app = make_app()
