"""Extending fedlmc from one file outside the package: a strategy with a knob of its own is its class, one
``register`` call and one ``Key``. From then on run_config sets the knob, validation checks it, the apps'
factory builds the strategy with it, the comparison runner runs it beside the others, and a Flower
simulation runs it; no other file changes."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from test_flower_contract import Grid

from fedlmc.federated import Settings, global_model
from fedlmc.strategies import AverageFedAvg, register
from fedlmc.strategies.keys import Key
from fedlmc.strategies.registry import key_table, table, unregister


class Damped(AverageFedAvg):
    """FedAvg's mean, taken only ``damping`` of the way from the global model.

    Parameters
    ----------
    damping : float, default 1.0
        The share of the step from the global model to the replies' mean (1: FedAvg).
    **kwargs
        ``AverageFedAvg``'s parameters.
    """

    def __init__(self, *, damping: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.damping = damping

    def combine(self, server_round, replies, models, weights):
        merged, fields, plain = super().combine(server_round, replies, models, weights)
        previous = self.previous_model()
        with torch.no_grad():
            for p, q in zip(merged.parameters(), previous.parameters()):
                p.copy_(q + self.damping * (p - q))
        return merged, {**fields, "kept": "damped", "damping": self.damping}, plain


DAMPING = Key(
    "damping",
    1.0,
    "the share of the step from the global model to the replies' mean (1: FedAvg)",
    check=lambda v: "" if 0 < v <= 1 else "must be in (0, 1]",
)


@pytest.fixture
def damped():
    @register("damped", summary="FedAvg's step, damped", example="Damped(damping=0.5)", keys=(DAMPING,))
    def _build(b):
        return Damped(**b.common(), damping=b.key("damping"))

    yield "damped"
    unregister("damped")


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)


RUN = {"preset": "vit-digits", "eval-batches": 2, "independent-start": False}


def test_the_knob_is_validated_from_run_config(damped):
    s = Settings.from_run_config({**RUN, "strategy": damped, "damping": "0.25"})
    assert s.key("damping") == 0.25 and s.to_run_config()["damping"] == 0.25
    assert Settings.from_run_config({**RUN, "strategy": damped}).key("damping") == 1.0
    with pytest.raises(ValueError, match="damping=0.5 is an option of the strategies damped, not of 'average'"):
        Settings.from_run_config({**RUN, "strategy": "average", "damping": 0.5})
    with pytest.raises(ValueError, match="'damping' = 2.0: must be in"):
        Settings.from_run_config({**RUN, "strategy": damped, "damping": 2})
    with pytest.raises(ValueError, match="'damping' is a float"):
        Settings.from_run_config({**RUN, "strategy": damped, "damping": "half"})
    # the listings read the declaration
    assert "| `damping` | `1.0` | `damped` |" in key_table() and "| `damped` | `Damped(damping=0.5)` |" in table()


def test_another_meaning_for_a_declared_name_is_refused(damped):
    with pytest.raises(ValueError, match="declared already, with another meaning"):
        register("other", summary="x", keys=(Key("damping", 0.5, "something else"),))(lambda b: None)
    with pytest.raises(ValueError, match="one of the run's own keys"):
        register("other", summary="x", keys=(Key("lr", 0.5, "a second learning rate"),))(lambda b: None)
    unregister("other")


def test_the_factory_and_the_comparison_runner_build_it_with_the_knob(damped, tmp_path):
    from fedlmc import io
    from server.app import write_json
    from server.comparison import run_comparison
    from simulations.compare import row_config, variant
    from strategies.factory import build_strategy

    s = Settings.from_run_config({**RUN, "strategy": damped, "damping": 0.25})
    model = global_model(s)
    built = build_strategy(s, model.config, None)
    assert isinstance(built, Damped) and built.damping == 0.25
    label = f"{damped}:damping=0.25"  # a row of the comparison runner
    assert variant(label)[0] == damped
    assert Settings.from_run_config({**RUN, "strategy": damped, **row_config(label)}).key("damping") == 0.25

    run = {**RUN, "out-dir": str(tmp_path), "damping": 0.25, "strategy": f"average,{damped}"}
    doc = run_comparison(Grid(nodes=2, step=0.05), Settings.from_run_config(run), write_json)
    assert doc["strategies"][damped]["kept"] == "damped"
    avg, mine = io.load(tmp_path / "final" / "average"), io.load(tmp_path / "final" / damped)
    for (k, a), b, g in zip(avg.state_dict().items(), mine.state_dict().values(), model.state_dict().values()):
        assert torch.allclose(b.float(), g.float() + 0.25 * (a.float() - g.float()), atol=1e-6), k


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_it_runs_in_a_two_client_flower_simulation(damped):
    """Flower's simulation engine runs the ServerApp in this process (where the strategy is registered);
    the ClientApps, in Ray's workers, read the run_config without knowing the strategy's key."""
    from simulations.simulate import simulate

    out = Path(tempfile.mkdtemp(prefix="fl-ext-", dir="/tmp"))
    try:
        run = {**RUN, "strategy": damped, "damping": 0.5, "num-server-rounds": 2, "local-steps": 3}
        doc = simulate({**run, "out-dir": str(out), "threads": 1}, num_supernodes=2, total_cpus=2)
        rounds = [r for r in doc["rounds"] if r["round"] > 0]
        assert [r["round"] for r in rounds] == [1, 2]
        assert all(r["strategy"]["kept"] == "damped" and r["strategy"]["damping"] == 0.5 for r in rounds)
    finally:
        shutil.rmtree(out, ignore_errors=True)
