"""Ensemble distillation (FedDF and distillation from the aligned or refined merge) and temperature
calibration: analytic and planted checks."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
from test_flower_contract import task_identity  # noqa: F401  (the fixture)

from fedlmc.data import ArrayData
from fedlmc.merging.distill import calibrate_temperature, distill, distillation_loss, teacher_logits
from fedlmc.models import from_preset
from fedlmc.options import Distill, Refinement

KW = dict(n_layer=1, d_model=16, n_head=2, d_ff=32, image_size=8, patch_size=4)


def _data(n: int = 256, seed: int = 1) -> ArrayData:
    g = torch.Generator().manual_seed(seed)
    return ArrayData(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return from_preset("vit-tiny", **KW)


def test_the_loss_is_the_temperature_scaled_kl_and_zero_on_the_teacher():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    T = 2.5
    p, q = torch.softmax(t / T, -1), torch.softmax(s / T, -1)
    want = (p * (p.log() - q.log())).sum(-1).mean() * T**2
    assert float(distillation_loss(s, t, T)) == pytest.approx(float(want), rel=1e-5)
    assert float(distillation_loss(t, t, T)) == pytest.approx(0.0, abs=1e-6)


def test_the_ensemble_is_the_mean_logit_or_the_mean_probability():
    teachers = [_model(s).eval() for s in (1, 2, 3)]
    x = _data(8).x
    outs = torch.stack([m(x) for m in teachers]).detach()
    assert torch.allclose(teacher_logits(teachers, x, "logits"), outs.mean(0), atol=1e-6)
    probs = torch.softmax(teacher_logits(teachers, x, "probabilities"), -1)
    assert torch.allclose(probs, torch.softmax(outs, -1).mean(0), atol=1e-6)


def test_distillation_lowers_the_held_out_loss_to_the_ensemble_and_never_returns_worse():
    teachers = [_model(s).eval() for s in (1, 2)]
    student = _model(7)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    options = Distill(data=_data(512), check_data=_data(128, seed=2), steps=60, lr=3e-3, check_every=5, patience=100)
    got, record = distill(student, teachers, options, device="cpu")
    assert all(torch.equal(student.state_dict()[k], v) for k, v in before.items())  # the argument is untouched
    assert record["steps_run"] == 60 and record["best_step"] > 0
    assert record["check_best"] < 0.5 * record["check_start"], record
    # a student that is the ensemble already (one teacher, itself) keeps its start: no check improves on 0
    same, rec = distill(teachers[0], [teachers[0]], options, device="cpu")
    assert rec["best_step"] == 0 and rec["check_start"] == pytest.approx(0.0, abs=1e-6)
    assert all(torch.equal(same.state_dict()[k], v) for k, v in teachers[0].state_dict().items())


def test_distill_options_refuse_what_no_run_could_use():
    with pytest.raises(ValueError, match="student"):
        Distill(student="median")
    with pytest.raises(ValueError, match="merge"):
        Distill(student="average", refine=Refinement())
    with pytest.raises(ValueError, match="data"):
        distill(_model(0), [_model(1)], Distill(), device="cpu")


class _Scaled(nn.Module):
    def __init__(self, model: nn.Module, factor: float) -> None:
        super().__init__()
        self.model, self.factor = model, factor

    def forward(self, x):
        return self.model(x) * self.factor


def test_temperature_calibration_undoes_a_planted_logit_scale():
    """Labels drawn from a model's own softmax: its calibrated temperature is about 1, and the same model
    with logits × 3 is calibrated back to a temperature of about 3 at a lower loss."""
    model = _model(3).eval()
    x = _data(4096).x
    with torch.no_grad():
        y = torch.distributions.Categorical(logits=model(x) * 4).sample()  # a peaked, learnable target
    data = ArrayData(x, y)
    sharp = _Scaled(model, 4.0)
    base = calibrate_temperature(sharp, data, batches=16)
    assert base["temperature"] == pytest.approx(1.0, abs=0.15)
    hot = calibrate_temperature(_Scaled(model, 12.0), data, batches=16)
    assert hot["temperature"] == pytest.approx(3.0, rel=0.15)
    assert hot["loss"] < hot["loss_at_1"] and math.isfinite(hot["loss"])


@pytest.mark.usefixtures("task_identity")
def test_feddf_and_the_distilled_merges_run_on_the_same_replies(tmp_path):
    """FedDF with no steps is FedAvg bit for bit; with steps, it and the distillation from the refined
    merge end no farther from the replies' ensemble on the held-out check data than they started."""
    from test_flower_contract import Grid

    from fedlmc import io
    from fedlmc.federated import Settings
    from server.app import write_json
    from server.comparison import run_comparison

    run = {"preset": "vit-digits", "out-dir": str(tmp_path), "eval-batches": 2, "guard": False}
    names = "average,feddf,refined-distilled"
    s = Settings.from_run_config({**run, "strategy": names, "distill-steps": 0, "refine-steps": 0})
    run_comparison(Grid(nodes=2, step=0.3), s, write_json)
    avg, feddf = io.load(tmp_path / "final" / "average"), io.load(tmp_path / "final" / "feddf")
    assert all(torch.equal(a, b) for a, b in zip(avg.state_dict().values(), feddf.state_dict().values()))

    s = Settings.from_run_config({**run, "strategy": names, "distill-steps": 20, "distill-lr": 1e-3})
    run_comparison(Grid(nodes=2, step=0.3), s, write_json)
    records = json.loads((tmp_path / "metrics.json").read_text())["comparison"]
    for name in ("feddf", "refined-distilled"):
        row = records[name]
        assert row["distill_steps_run"] > 0 and row["distill_check_best"] <= row["distill_check_start"], row
    assert records["feddf"]["distill_from"] == "average" and records["refined-distilled"]["distill_from"] == "aligned"
    assert records["refined-distilled"]["refine_steps_run"] > 0  # refined first, then distilled


@pytest.mark.usefixtures("task_identity")
def test_distillation_by_the_clients_each_toward_its_own_model_lowers_their_held_out_loss():
    """With no server data, the clients answer with the gradient of the cross-entropy to the soft
    predictions of the model each trained (``Taught``), on their own data: the student moves toward
    both teachers on both clients' held-out batches."""
    from test_on_clients import FakeGrid

    from fedlmc.flower.on_clients import ClientLosses, answer
    from fedlmc.merging.distill import Taught, distill_on_clients
    from fedlmc.options import OnClients

    teachers = {1: _model(1).eval(), 2: _model(2).eval()}
    for t in teachers.values():  # confident teachers: their soft targets are far from the student's
        with torch.no_grad():
            t.head.weight.mul_(30.0)
    data = {n: (_data(256, seed=10 + n), _data(64, seed=20 + n)) for n in teachers}

    def handler(node):
        train_part, check_part = data[node]
        return lambda msg: answer(msg, Taught(train_part, teachers[node]), Taught(check_part, teachers[node]))

    grid = FakeGrid({n: handler(n) for n in teachers})
    remote = ClientLosses(grid, [1, 2], OnClients(min_clients=2), batch_size=32, check_batches=2, target="own-model")
    options = Distill(steps=30, lr=3e-3, check_every=5, patience=100)
    student, record = distill_on_clients(_model(7), remote, options)
    assert record["steps_run"] == 30 and record["best_step"] > 0
    assert record["check_best"] < record["check_start"] - 0.2, record
    assert all(m.content["config"]["target"] == "own-model" for m in grid.sent)


def test_a_client_without_a_kept_model_refuses_a_distillation_query():
    from flwr.app import Context, RecordDict

    from clients.app import _teacher
    from fedlmc.federated import Settings

    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match="keep-model"):
        _teacher(ctx, None, Settings(), "{}")
