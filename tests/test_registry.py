"""The strategy registry: a strategy defined here is one class plus one ``register`` call, and from then on
the run's settings check it, the apps' factory builds it and the side-by-side comparison runs it."""

from __future__ import annotations

import pytest
import torch
from test_flower_contract import Grid

from fedlmc.federated import Settings, global_model
from fedlmc.strategies import AverageFedAvg, register
from fedlmc.strategies.registry import REGISTRY, names, registered, table, unregister


class HalfStep(AverageFedAvg):
    """A strategy of a user's: FedAvg's mean, then only half the way from the previous global model to it."""

    def combine(self, server_round, replies, models, weights):
        merged, fields, plain = super().combine(server_round, replies, models, weights)
        previous = self.previous_model()
        with torch.no_grad():
            for p, q in zip(merged.parameters(), previous.parameters()):
                p.copy_(0.5 * (p + q))
        return merged, {**fields, "kept": "half-step"}, plain


@pytest.fixture
def half_step():
    @register("half-step", summary="half the way from the global model to FedAvg's mean")
    def _build(b):
        return HalfStep(**b.common())

    yield "half-step"
    unregister("half-step")


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)


def test_a_registered_strategy_is_checked_built_and_compared(half_step, tmp_path):
    from server.app import write_json
    from server.comparison import run_comparison
    from strategies.factory import build_strategy

    assert half_step in names() and registered(half_step).summary.startswith("half the way")
    assert f"| `{half_step}` |" in table()
    run = {"preset": "vit-digits", "out-dir": str(tmp_path), "eval-batches": 2, "independent-start": False}
    s = Settings.from_run_config({**run, "strategy": half_step})
    model = global_model(s)
    strategy = build_strategy(s, model.config, None)
    assert isinstance(strategy, HalfStep)
    with pytest.raises(ValueError, match="reduce='median' applies to strategies .*not 'half-step'"):
        Settings.from_run_config({**run, "strategy": half_step, "reduce": "median"})
    with pytest.raises(ValueError, match="mixed-width federation.*hetero.*not 'half-step'"):
        Settings.from_run_config({**run, "strategy": half_step, "width-factors": "1,2"})

    doc = run_comparison(
        Grid(nodes=2, step=0.05), Settings.from_run_config({**run, "strategy": f"average,{half_step}"}), write_json
    )
    rows = doc["strategies"]
    assert set(rows) == {"average", half_step} and rows[half_step]["kept"] == "half-step"
    # half the way to the mean: every weight is the midpoint of the initial model and FedAvg's aggregate
    from fedlmc import io

    avg, half = io.load(tmp_path / "final" / "average"), io.load(tmp_path / "final" / half_step)
    for (k, a), b, g in zip(avg.state_dict().items(), half.state_dict().values(), model.state_dict().values()):
        assert torch.allclose(b.float(), 0.5 * (a.float() + g.float()), atol=1e-6), k


def test_the_comparison_runner_reads_its_strategies_from_the_registry(half_step):
    from simulations.compare import SETTINGS, variant

    assert variant(f"{half_step}") == (half_step, "", "")
    assert variant("aligned@median+distance") == ("aligned", "median", "distance")
    with pytest.raises(ValueError, match="unknown strategy 'alinged'"):
        variant("alinged@median")
    for spec in SETTINGS.values():  # every row of every setting names a registered strategy
        for label in spec["strategies"]:
            assert variant(label)[0] in REGISTRY


def test_a_name_is_registered_once_and_has_no_separator(half_step):
    with pytest.raises(ValueError, match="registered already"):
        register(half_step, summary="again")(lambda b: None)
    for bad in ("a,b", "a@b", "a+b"):
        with pytest.raises(ValueError, match="no ','"):
            register(bad, summary="bad")(lambda b: None)
    register(half_step, summary="replaced", override=True)(lambda b: None)
    assert registered(half_step).summary == "replaced"


def test_the_capabilities_say_what_settings_accept():
    """Each capability the registry states is what ``Settings.validate`` lets through, for every
    registered strategy."""
    for name, r in REGISTRY.items():
        keys = {"strategy": name}
        for cap, extra in (("reduce", {"reduce": "median"}), ("screen", {"screen": "distance"})):
            if getattr(r.can, cap):
                Settings.from_run_config({**keys, **extra})
            else:
                with pytest.raises(ValueError):
                    Settings.from_run_config({**keys, **extra})
        if r.can.mixed_widths:
            Settings.from_run_config({**keys, "width-factors": "1,2"})
        else:
            with pytest.raises(ValueError, match="mixed-width"):
                Settings.from_run_config({**keys, "width-factors": "1,2"})
