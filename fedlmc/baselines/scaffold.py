"""SCAFFOLD's client side (Karimireddy et al., ICML 2020): control variates that correct client drift.

Each client keeps a control variate ``c_i`` and the server keeps their mean ``c``. A client trains with
every gradient corrected by ``c − c_i`` (a hook on each parameter, so the local optimiser and its
schedule are the ones every other strategy's clients use), and answers with ``Δc_i = c_i⁺ − c_i``.
The new variate is the paper's option II by default, ``c_i⁺ = c_i − c + (x − y_i)/(K·η)``: with plain
SGD the mean raw gradient along the K local steps (``trajectory_variate``); option I, the local
gradient at the received model ``x`` (``client_round``), over-corrects where local gradients change
along the way (label skew) and diverges in fedlmc's multi-round setting. The variates travel as
safetensors bytes inside a ConfigRecord, so a reply keeps exactly one ArrayRecord (what Flower's
strategies and wrappers check).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn as nn
from flwr.app import ArrayRecord, ConfigRecord
from safetensors.torch import load, save

from fedlmc.options import one_of
from fedlmc.strategies.base import node_of
from fedlmc.strategies.fedavg import AverageBase
from fedlmc.strategies.keys import Key
from fedlmc.strategies.knobs import ClientKnob, ConfirmedKnobs
from fedlmc.strategies.registry import Build, register
from fedlmc.train import loss_and_correct, pick_device

CONTROL_KEY = "scaffold"  # the ConfigRecord: the server's ``control`` in train messages, ``delta`` in replies


def pack(tensors: dict[str, torch.Tensor]) -> bytes:
    """Tensors as safetensors bytes (never pickle)."""
    return save({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()})


def unpack(data: Optional[bytes]) -> dict[str, torch.Tensor]:
    return dict(load(bytes(data))) if data else {}


def local_gradient(model: nn.Module, data, batch_size: int, device: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The mean gradient of the training loss over one pass of ``data`` (in order) at the model's
    current weights, per named parameter: SCAFFOLD's option I control variate."""
    dev = pick_device(device)
    model.to(dev)
    params = dict(model.named_parameters())
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    count = 0
    for x, y in data.batches(batch_size):
        model.zero_grad(set_to_none=True)
        loss, _ = loss_and_correct(model(x.to(dev)), y.to(dev))
        loss.backward()
        k = len(x)
        for n, p in params.items():
            if p.grad is not None:
                total[n] += p.grad.detach() * k
        count += k
    model.zero_grad(set_to_none=True)
    if count == 0:
        raise ValueError("local_gradient() got an empty data set")
    return {n: (t / count).cpu() for n, t in total.items()}


def corrected(model: nn.Module, correction: dict[str, torch.Tensor]) -> list:
    """Add ``correction[name]`` to every gradient of that parameter from now on (hooks; remove them with
    ``h.remove()`` for each handle returned). All-zero corrections add nothing."""
    handles = []
    for name, p in model.named_parameters():
        c = correction.get(name)
        if c is None or not bool(c.any()):
            continue
        c = c.to(p.device, p.dtype)
        handles.append(p.register_hook(lambda g, c=c: g + c))
    return handles


def client_round(
    model: nn.Module, data, batch_size: int, control: dict, mine: dict, device: Optional[str] = None
) -> tuple[dict, dict, list]:
    """What a SCAFFOLD client does before training ``model`` (the global model it received): its new
    control variate ``c_i⁺`` (the local gradient at it), ``Δc_i = c_i⁺ − c_i`` and the gradient hooks
    that add ``c − c_i`` while it trains. A variate a side does not have counts as zero."""
    fresh = local_gradient(model, data, batch_size, device)
    delta = {n: fresh[n] - mine[n] if n in mine else fresh[n] for n in fresh}
    return fresh, delta, correct(model, control, mine)


def remove(handles: Iterable) -> None:
    for h in handles:
        h.remove()


VARIATES = ("trajectory", "gradient")  # option II (default), option I


def correct(model: nn.Module, control: dict, mine: dict) -> list:
    """Option II's start: the hooks that add ``c − c_i`` to ``model``'s gradients (a variate a side does
    not have counts as zero)."""
    correction = {}
    for n, p in model.named_parameters():
        zero = torch.zeros(p.shape)
        correction[n] = control.get(n, zero) - mine.get(n, zero)
    return corrected(model, correction)


def trajectory_variate(
    start: dict[str, torch.Tensor], model: nn.Module, control: dict, mine: dict, steps: int, lr: float
) -> tuple[dict, dict]:
    """Option II after ``steps`` local steps at learning rate ``lr`` from the weights ``start``:
    ``c_i⁺ = c_i − c + (x − y_i)/(K·η)`` and ``Δc_i = c_i⁺ − c_i``, per named parameter."""
    if steps < 1 or lr <= 0:
        raise ValueError(f"SCAFFOLD's option II needs local steps ≥ 1 and lr > 0, got {steps} and {lr}")
    fresh, delta = {}, {}
    for n, p in model.named_parameters():
        y = p.detach().cpu()
        zero = torch.zeros_like(y)
        fresh[n] = mine.get(n, zero) - control.get(n, zero) + (start[n] - y) / (steps * lr)
        delta[n] = fresh[n] - mine.get(n, zero)
    return fresh, delta


# ---- the strategy --------------------------------------------------------------------------------

SCAFFOLD = ClientKnob(
    CONTROL_KEY,
    "fedlmc's ClientApp (clients/app.py) corrects its gradients by c − c_i "
    "(fedlmc.baselines.scaffold.correct), answers Δc_i in its 'scaffold' ConfigRecord and confirms it with "
    "fedlmc.strategies.knobs.confirm(metrics, config, 'scaffold'); a ClientApp of your own must do the same.",
)


class ScaffoldFedAvg(ConfirmedKnobs, AverageBase):
    """SCAFFOLD (Karimireddy et al., ICML 2020) on Flower's Message API: every train message carries the
    server's control variate ``c`` (config key ``scaffold``, safetensors bytes); fedlmc's ClientApp
    keeps its own variate in the node's ``context.state``, corrects its gradients by ``c − c_i`` and
    answers with ``Δc_i`` (``fedlmc.baselines.scaffold``). The model is aggregated as FedAvg's (global learning
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
                missing.append(node_of(msg))
                continue
            deltas.append((w / total, unpack(rec["delta"])))
            if not rec.get("had-variate", True):
                fresh.append(node_of(msg))
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


SCAFFOLD_VARIATE = Key(
    "scaffold-variate",
    "trajectory",
    "the clients' variate c_i⁺: the paper's option II "
    "(`trajectory`) or option I (`gradient`, the local gradient at the received model)",
    choices=VARIATES,
    client=True,
)


@register(
    "scaffold",
    summary="SCAFFOLD, the clients' gradients corrected by control variates (c − c_i) that travel with the messages",
    example="ScaffoldFedAvg()",
    keys=(SCAFFOLD_VARIATE,),
    client="corrects its gradients by c − c_i (`fedlmc.baselines.scaffold`), answers Δc_i and confirms it (fedlmc's "
    "ClientApp does)",
)
def _scaffold(b: Build):
    return ScaffoldFedAvg(**b.common(), variate=b.key("scaffold-variate"))
