"""A model an aligning strategy cannot align is an error before the first round (naming the fix), or,
only when asked for, plain averaging with a warning every round — never a federation in which every
reply is silently excluded."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from conftest import metadata
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedlmc.models import from_preset
from fedlmc.options import Refinement
from fedlmc.strategies import AlignedFedAvg, HeteroWidthFedAvg, RefinedFedAvg


class Net(nn.Module):
    """The MLP of a hand-written Flower app (keys fc1 / fc2, nothing fedlmc knows)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)


def _reply(model: nn.Module, n: int, node: int) -> Message:
    """A reply as Flower's PyTorch quickstart ClientApp sends it: arrays and num-examples, nothing else."""
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": n})})
    md = metadata(node)
    return Message(content=content, metadata=md)


class NoGrid:
    """Any use of the grid means the strategy started a round: the check must come first."""

    def __getattr__(self, name):
        raise AssertionError(f"the strategy touched the grid ({name}) before refusing the model")


@pytest.mark.parametrize(
    "make", [lambda: AlignedFedAvg(), lambda: RefinedFedAvg(refine=Refinement(data=[])), lambda: HeteroWidthFedAvg()]
)
def test_no_architecture_is_an_error_before_round_one(make):
    with pytest.raises(ValueError, match=r"pass model=.*fallback='average'"):
        make().start(grid=NoGrid(), initial_arrays=ArrayRecord(Net(0).state_dict()), num_rounds=2)


def test_arrays_of_another_model_are_an_error_naming_the_keys():
    vit = from_preset("vit-digits")
    strategy = AlignedFedAvg(model=vit.config.to_dict())
    with pytest.raises(ValueError, match="not a model of the given model.*fc1.weight"):
        strategy.start(grid=NoGrid(), initial_arrays=ArrayRecord(Net(0).state_dict()), num_rounds=2)


def test_fallback_average_averages_plainly_and_warns_every_round(caplog):
    strategy = AlignedFedAvg(fallback="average")
    caplog.set_level(logging.WARNING)
    strategy.check_architecture(ArrayRecord(Net(0).state_dict()))
    a, b = Net(1), Net(2)
    for rnd in (1, 2):
        arrays, _ = strategy.aggregate_train(rnd, [_reply(a, 10, 1), _reply(b, 30, 2)])
        out = arrays.to_torch_state_dict()
        for k, v in a.state_dict().items():
            assert torch.allclose(out[k], 0.25 * v + 0.75 * b.state_dict()[k], atol=1e-6)
        assert any(f"round {rnd}: averaging plainly" in r.getMessage() for r in caplog.records)


def test_a_users_own_module_as_model_names_roles_and_the_fallback_rescues_it(caplog):
    """``model=`` a plain ``nn.Module`` (neither fedlmc nor Hugging Face): the constructor says how to
    describe it (``Roles``) or to average it plainly; with ``fallback="average"`` the federation runs."""
    with pytest.raises(
        ValueError, match=r"Net, which is neither a fedlmc nor a Hugging Face.*Roles.*fallback='average'"
    ):
        AlignedFedAvg(model=Net(0))
    strategy = AlignedFedAvg(model=Net(0), fallback="average")
    caplog.set_level(logging.WARNING)
    strategy.check_architecture(ArrayRecord(Net(0).state_dict()))
    a, b = Net(1), Net(2)
    arrays, _ = strategy.aggregate_train(1, [_reply(a, 10, 1), _reply(b, 10, 2)])
    out = arrays.to_torch_state_dict()
    assert all(torch.allclose(out[k], 0.5 * (v + b.state_dict()[k]), atol=1e-6) for k, v in a.state_dict().items())
    assert any("Roles" in r.getMessage() and "averaging plainly" in r.getMessage() for r in caplog.records)
