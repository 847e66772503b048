"""The strategy registry: a strategy defined here is one class plus one ``register`` call, and from then on
the run's settings check it, the apps' factory builds it and the side-by-side comparison runs it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import metadata
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedlmc.federated import Settings, global_model
from fedlmc.strategies import ReportingFedAvg, register
from fedlmc.strategies.records import MODEL_CONFIG_KEY, config_record, model_from_arrays
from fedlmc.strategies.registry import REGISTRY, names, registered, table, unregister


class HalfStep(ReportingFedAvg):
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


class TrainingGrid:
    """Two nodes that answer a train message with the global model plus a fixed, node-specific step."""

    def get_node_ids(self):
        return [1, 2]

    def send_and_receive(self, messages, timeout=None):
        out = []
        for m in messages:
            node = m.metadata.dst_node_id
            model = model_from_arrays(
                m.content.array_records["arrays"], json.loads(m.content["config"][MODEL_CONFIG_KEY])
            )
            g = torch.Generator().manual_seed(node)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
            content = RecordDict(
                {
                    "arrays": ArrayRecord(torch_state_dict=model.state_dict()),
                    "metrics": MetricRecord({"num-examples": 10 * node}),
                    "model": config_record(model),
                }
            )
            out.append(Message(content=content, metadata=metadata(node)))
        return out


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
        TrainingGrid(), Settings.from_run_config({**run, "strategy": f"average,{half_step}"}), write_json
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
