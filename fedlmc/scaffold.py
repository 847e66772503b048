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

from typing import Iterable, Optional

import torch
import torch.nn as nn
from safetensors.torch import load, save

from .train import loss_and_correct, pick_device

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
