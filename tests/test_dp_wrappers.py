"""fedlmc's strategies inside Flower's differential-privacy wrappers, which call the inner strategy's
``configure_train`` / ``aggregate_train`` and never its ``start``: everything a strategy sets up before
round 1 happens on first use, a wrapped strategy behaves like an unwrapped one, and server-side
clipping reaches the replies a strategy aggregates."""

from __future__ import annotations

import pytest
import torch
import transformers
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
)
from test_flower_contract import Grid, _mlp_arrays, task_identity  # noqa: F401  (the fixture)

from fedlmc.data import ArrayData
from fedlmc.options import Refinement, Scale
from fedlmc.strategies import AlignedFedAvg, LoraFedAvg, RefinedFedAvg

WRAPPERS = {
    "server-fixed": lambda s: DifferentialPrivacyServerSideFixedClipping(s, 0.01, 10.0, 2),
    "client-fixed": lambda s: DifferentialPrivacyClientSideFixedClipping(s, 0.01, 10.0, 2),
    "server-adaptive": lambda s: DifferentialPrivacyServerSideAdaptiveClipping(s, 0.01, 2, initial_clipping_norm=10.0),
    "client-adaptive": lambda s: DifferentialPrivacyClientSideAdaptiveClipping(s, 0.01, 2, initial_clipping_norm=10.0),
}


def _gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg)


def _tokens() -> ArrayData:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32, (16, 8), generator=g)
    return ArrayData(x, torch.roll(x, -1, dims=1))


def _peft():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(_gpt2(), LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"]))


STRATEGIES = {
    "AlignedFedAvg": lambda: (AlignedFedAvg(model=_gpt2()), ArrayRecord(_gpt2().state_dict())),
    "RefinedFedAvg": lambda: (
        RefinedFedAvg(model=_gpt2(), refine=Refinement(data=_tokens(), steps=3, check_every=0)),
        ArrayRecord(_gpt2().state_dict()),
    ),
    "LoraFedAvg": lambda: _lora(),
}


def _lora():
    from peft import get_peft_model_state_dict

    model = _peft()
    return LoraFedAvg(model=model), ArrayRecord(get_peft_model_state_dict(model))


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=WRAPPERS.keys())
@pytest.mark.parametrize("make", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_a_wrapped_strategy_runs_two_rounds_with_a_hugging_face_model(make, wrap):
    strategy, initial = make()
    result = wrap(strategy).start(grid=Grid(nodes=2), initial_arrays=initial, num_rounds=2)
    assert len(result.arrays) == len(initial) and set(result.arrays.keys()) == set(initial.keys())
    assert len(strategy.history) == 2 and all(not r.get("excluded") for r in strategy.history)
    assert all(torch.isfinite(t).all() for t in result.arrays.to_torch_state_dict().values())


def test_a_wrapped_strategy_with_no_model_stops_with_the_clear_error_before_round_one():
    wrapped = DifferentialPrivacyServerSideFixedClipping(AlignedFedAvg(), 0.01, 10.0, 2)
    with pytest.raises(ValueError, match=r"pass model=.*fallback='average'"):
        wrapped.start(grid=Grid(nodes=2), initial_arrays=_mlp_arrays(), num_rounds=1)


def test_a_wrapped_fallback_averages_what_it_cannot_align():
    strategy = AlignedFedAvg(fallback="average")
    wrapped = DifferentialPrivacyClientSideFixedClipping(strategy, 0.0, 10.0, 2)
    result = wrapped.start(grid=Grid(nodes=2), initial_arrays=_mlp_arrays(), num_rounds=2)
    assert len(result.arrays) == 4 and [r["arrays_only"] for r in strategy.history] == [True, True]


@pytest.mark.parametrize("wrap", ["client-fixed", "server-fixed"])
def test_replies_on_disk_under_a_wrapper(wrap, tmp_path, monkeypatch):
    """With ``Scale(spool=True)`` a client-side DP wrapper hands the replies on unchanged, so they are
    written to disk as they arrive (the grid its ``start`` runs on is hooked), as under this strategy's
    own ``start``; a server-side one clips them first, so they wait in memory and are written when
    read: clipped either way, and the aggregate is the one the strategy makes with the replies in
    memory."""
    from fedlmc.strategies.base import FedlmcStrategy

    arrived = []
    spool_at_arrival = FedlmcStrategy.arrived
    monkeypatch.setattr(FedlmcStrategy, "arrived", lambda self, msg: arrived.append(msg) or spool_at_arrival(self, msg))
    results = {}
    for spool in (False, True):
        arrived.clear()
        strategy = AlignedFedAvg(model=_gpt2(), scale=Scale(spool=spool, spool_dir=str(tmp_path)))
        noiseless = WRAPPERS[wrap](strategy)
        noiseless.noise_multiplier, noiseless.clipping_norm = 0.0, 0.5  # clipping bites: updates are larger
        grid = Grid(nodes=2, step=0.5)
        results[spool] = noiseless.start(grid=grid, initial_arrays=ArrayRecord(_gpt2().state_dict()), num_rounds=1)
        trains = [m for m in arrived if m.metadata.message_type == "train"]
        assert len(trains) == (2 if spool and wrap.startswith("client") else 0), (spool, wrap)
        assert ("send_and_receive" in vars(grid)) == (spool and wrap.startswith("client"))
    a, b = (results[s].arrays.to_torch_state_dict() for s in (False, True))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert list(tmp_path.iterdir()) == []  # nothing left on disk after the round
