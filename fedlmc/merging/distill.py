"""Ensemble distillation: one model trained toward the outputs of several (FedDF, Lin et al., NeurIPS
2020), and the temperature calibration of a single model.

The student learns on unlabelled batches to match the teachers' ensemble (their mean logits, as FedDF
averages them, or their mean probabilities) under a softmax temperature ``T``: the loss is
``T² · KL(teacher_T ‖ student_T)`` averaged over every prediction (every token of a text model). The
checks score that loss on held-out batches and keep the best student, the start included, so the
returned student is never worse on the check data than the one it started as.
"""

from __future__ import annotations

import copy
import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedlmc.options import Distill
from fedlmc.train import pick_device


def teacher_logits(teachers: Sequence[nn.Module], x: torch.Tensor, kind: str = "logits") -> torch.Tensor:
    """The ensemble's logits on ``x``: the teachers' mean logits, or (``"probabilities"``) the log of
    their mean probabilities (softmax gives those back)."""
    with torch.no_grad():
        outs = torch.stack([t(x).float() for t in teachers])
    if kind == "logits":
        return outs.mean(0)
    return torch.logsumexp(torch.log_softmax(outs, dim=-1), dim=0) - math.log(len(teachers))


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``T² · KL(softmax(teacher / T) ‖ softmax(student / T))``, the mean over every prediction."""
    s = torch.log_softmax(student.reshape(-1, student.shape[-1]).float() / temperature, dim=-1)
    t = torch.log_softmax(teacher.reshape(-1, teacher.shape[-1]).float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def _inputs(data, batch_size: int, shuffle: bool, generator=None):
    for x, _ in data.batches(batch_size, shuffle=shuffle, generator=generator):
        yield x


def _check(student: nn.Module, held: list[tuple[torch.Tensor, torch.Tensor]], temperature: float) -> float:
    with torch.no_grad():
        losses = [float(distillation_loss(student(x), t, temperature)) for x, t in held]
    return sum(losses) / len(losses)


def distill(
    student: nn.Module,
    teachers: Sequence[nn.Module],
    options: Distill,
    device: Optional[str] = None,
) -> tuple[nn.Module, dict]:
    """``student`` (a copy; the argument is left alone) distilled toward the ensemble of ``teachers`` on
    ``options.data`` (``fedlmc.options.Distill``); returns it and a record: the steps run, the step
    kept, and the check loss at the start and at the step kept."""
    if options.data is None:
        raise ValueError("distill() needs data: Distill(data=...) (unlabelled server-side batches)")
    dev = pick_device(device)
    student = copy.deepcopy(student).to(dev).float()
    teachers = [copy.deepcopy(t).to(dev).float().eval() for t in teachers]
    student.eval()  # no dropout: the student is scored as it is trained
    gen = torch.Generator().manual_seed(options.seed)
    check_data = options.check_data if options.check_data is not None else options.data
    held = []
    for i, x in enumerate(_inputs(check_data, options.batch_size, shuffle=False)):
        if i >= options.check_batches:
            break
        held.append((x.to(dev), teacher_logits(teachers, x.to(dev), options.teacher)))
    best_loss = _check(student, held, options.temperature) if held and options.check_every else math.nan
    record = {"steps_run": 0, "best_step": 0, "check_start": best_loss, "check_best": best_loss}
    if options.steps == 0:
        return student, record
    best_state, stale, step = copy.deepcopy(student.state_dict()), 0, 0
    opt = torch.optim.Adam(student.parameters(), lr=options.lr)
    while step < options.steps:
        for x in _inputs(options.data, options.batch_size, shuffle=True, generator=gen):
            x = x.to(dev)
            loss = distillation_loss(student(x), teacher_logits(teachers, x, options.teacher), options.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if options.check_every and held and step % options.check_every == 0:
                now = _check(student, held, options.temperature)
                if now < best_loss:
                    best_loss, best_state, stale = now, copy.deepcopy(student.state_dict()), 0
                    record.update(best_step=step, check_best=now)
                else:
                    stale += 1
            if step >= options.steps or stale >= options.patience:
                break
        if stale >= options.patience:
            record["stopped"] = f"no better check in {options.patience} checks"
            break
    record["steps_run"] = step
    if options.check_every and held:
        student.load_state_dict(best_state)
    else:
        record["best_step"] = step
    return student, record


def calibrate_temperature(model: nn.Module, data, batches: int = 8, batch_size: int = 256, device=None) -> dict:
    """The softmax temperature ``T`` that minimises ``model``'s cross-entropy on ``data``'s first
    ``batches`` batches (its logits divided by ``T``; a 1-D search on ``log T``): the calibration the
    width-and-temperature control applies to an average. Returns ``T`` and the loss at 1 and at ``T``."""
    from scipy.optimize import minimize_scalar

    dev = pick_device(device)
    model = copy.deepcopy(model).to(dev).float().eval()
    logits, ys = [], []
    with torch.no_grad():
        for i, (x, y) in enumerate(data.batches(batch_size)):
            if i >= batches:
                break
            out = model(x.to(dev))
            logits.append(out.reshape(-1, out.shape[-1]).cpu())
            ys.append(y.reshape(-1))
    z, y = torch.cat(logits).double(), torch.cat(ys)

    def loss(log_t: float) -> float:
        return float(F.cross_entropy(z / math.exp(log_t), y))

    best = minimize_scalar(loss, bounds=(-3.0, 3.0), method="bounded")
    return {"temperature": math.exp(best.x), "loss_at_1": loss(0.0), "loss": float(best.fun)}


class Tempered(nn.Module):
    """``model`` with its logits divided by ``temperature`` (the calibrated model the control scores)."""

    def __init__(self, model: nn.Module, temperature: float) -> None:
        super().__init__()
        self.model, self.temperature = model, float(temperature)
        self.config = getattr(model, "config", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) / self.temperature


def calibrated(model: nn.Module, data, batches: int = 8, device=None) -> Tempered:
    """``model`` at the temperature ``calibrate_temperature`` finds on ``data``."""
    return Tempered(model, calibrate_temperature(model, data, batches=batches, device=device)["temperature"])


class Taught:
    """``data`` with its targets replaced by ``teacher``'s predicted distributions (soft targets, computed
    batch by batch): what a client distils on when its own trained model is the teacher. Exposes the
    ``batches(batch_size, shuffle, generator)`` of fedlmc's data sets."""

    def __init__(self, data, teacher: nn.Module, device=None) -> None:
        self.data, self.device = data, pick_device(device)
        self.teacher = teacher.to(self.device).eval()

    def __len__(self) -> int:
        return len(self.data)

    def batches(self, batch_size: int, shuffle: bool = False, generator=None):
        for x, _ in self.data.batches(batch_size, shuffle=shuffle, generator=generator):
            with torch.no_grad():
                y = torch.softmax(self.teacher(x.to(self.device)).float(), dim=-1).cpu()
            yield x, y


def _state(model: nn.Module) -> dict:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _remote_check(remote, model: nn.Module, step: int) -> Optional[float]:
    losses = remote.losses(_state(model), step)
    if losses is None:
        return None
    per = torch.cat([v.reshape(-1) for v in losses.values()])
    return float(per.mean()) if len(per) else None


def distill_on_clients(student: nn.Module, remote, options: Distill) -> tuple[nn.Module, dict]:
    """``student`` (a copy) distilled by the clients: every step the round's clients (``remote``, a
    ``fedlmc.flower.on_clients.ClientLosses`` asking for the distillation loss to each client's own model on
    its data) answer with the gradient at the student, and Adam steps on their weighted mean; the checks
    score the same loss on the clients' held-out batches. Stops when too few clients answer."""
    student = copy.deepcopy(student).cpu().float()
    remote.begin(student.config)
    params = dict(student.named_parameters())
    opt = torch.optim.Adam(params.values(), lr=options.lr)
    best = _remote_check(remote, student, 0) if options.check_every else None
    record = {"steps_run": 0, "best_step": 0, "check_start": best, "check_best": best}
    best_state, stale = copy.deepcopy(student.state_dict()), 0
    for step in range(1, options.steps + 1):
        got = remote.gradients([_state(student)], step)
        if got is None:
            record["stopped"] = f"too few clients answered at step {step}"
            break
        grads, _ = got
        for name, p in params.items():
            p.grad = grads[0][name].to(p.dtype) if name in grads[0] else None
        opt.step()
        record["steps_run"] = step
        if options.check_every and step % options.check_every == 0:
            now = _remote_check(remote, student, step)
            if now is None:
                record["stopped"] = f"too few clients scored the check at step {step}"
                break
            if best is None or now < best:
                best, best_state, stale = now, copy.deepcopy(student.state_dict()), 0
                record.update(best_step=step, check_best=now)
            else:
                stale += 1
                if stale >= options.patience:
                    record["stopped"] = f"no better check in {options.patience} checks"
                    break
    if options.check_every:
        student.load_state_dict(best_state)
    else:
        record["best_step"] = record["steps_run"]
    return student, record
