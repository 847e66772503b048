"""One source of configuration: the run_config defaults Flower reads (``pyproject.toml``,
``[tool.flwr.app.config]``) and ``fedlmc.federated.Settings``' defaults are the same keys and values."""
from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from fedlmc.federated import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_run_config_and_settings_agree():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    defaults = Settings().to_run_config()
    assert set(config) == set(defaults), (set(config) ^ set(defaults))
    for key, value in config.items():
        assert defaults[key] == pytest.approx(value) if isinstance(value, float) else defaults[key] == value, key
    assert Settings.from_run_config(config) == Settings()


def test_unknown_keys_and_values_are_clear_errors():
    with pytest.raises(ValueError, match="unknown run_config key 'rounds'"):
        Settings.from_run_config({"rounds": 3})
    with pytest.raises(ValueError, match="unknown strategy"):
        Settings.from_run_config({"strategy": "fedprox"})
    assert {f.name for f in fields(Settings)} == {k.replace("-", "_") for k in Settings().to_run_config()}


def test_one_vocabulary_with_deprecated_aliases():
    from fedlmc.vocabulary import method_name

    assert Settings.from_run_config({"strategy": "average"}).strategy == "average"
    with pytest.warns(DeprecationWarning, match="'fedavg' is deprecated: use 'average'"):
        assert Settings.from_run_config({"strategy": "fedavg"}).strategy == "average"
    with pytest.warns(DeprecationWarning, match="'wm' is deprecated"):
        assert method_name("wm", ("aligned", "refined")) == "aligned"
    with pytest.raises(ValueError, match="unknown method 'average'; choose one of aligned, refined"):
        method_name("average", ("aligned", "refined"))


def test_client_cache_keeps_a_tied_hf_client(tmp_path):
    """A Hugging Face GPT-2 client (tied head: two keys, one tensor) goes through the cache intact."""
    import torch

    from fedlmc.federated import Settings, cached_first_round, client_config, client_data, fresh_client_model

    s = Settings.from_run_config({"preset": "gpt2-tiny", "local-steps": 2, "batch-size": 4, "hf": True,
                                  "client-cache": str(tmp_path)})
    data, _ = client_data(s, 0, 2)
    cfg = client_config(s, 0).replace(n_layer=1)
    first = fresh_client_model(s, 0, cfg)
    cached_first_round(first, data, s, 3, 0, 2)
    again = fresh_client_model(s, 0, cfg)
    cached_first_round(again, data, s, 3, 0, 2)
    assert again.lm_head.weight is again.transformer.wte.weight  # still tied after loading
    assert torch.equal(again.lm_head.weight, first.lm_head.weight)


def test_client_cache_trains_a_one_shot_client_once(tmp_path):
    """The comparison runner's client cache: the second strategy's client is the first one's, exactly,
    and a change in anything training depends on (here the learning rate) trains anew."""
    import torch

    from fedlmc.federated import Settings, cached_first_round, client_config, client_data, fresh_client_model

    s = Settings.from_run_config({"preset": "vit-digits", "local-steps": 3, "client-cache": str(tmp_path)})
    data, _ = client_data(s, 0, 2)
    cfg = client_config(s, 0)
    first = fresh_client_model(s, 0, cfg)
    start = {k: v.clone() for k, v in first.state_dict().items()}
    assert cached_first_round(first, data, s, 7, 0, 2) is not None
    assert any(not torch.equal(start[k], v) for k, v in first.state_dict().items())  # it trained
    again = fresh_client_model(Settings.from_run_config({**s.to_run_config(), "strategy": "refined"}), 0, cfg)
    cached_first_round(again, data, Settings.from_run_config({**s.to_run_config(), "strategy": "refined"}), 7, 0, 2)
    assert all(torch.equal(first.state_dict()[k], v) for k, v in again.state_dict().items())
    other = Settings.from_run_config({**s.to_run_config(), "lr": 0.01})
    third = fresh_client_model(other, 0, cfg)
    cached_first_round(third, data, other, 7, 0, 2)
    assert any(not torch.equal(first.state_dict()[k], v) for k, v in third.state_dict().items())
    assert len(list(tmp_path.iterdir())) == 2


def test_permuted_is_the_permutation_only_baseline():
    """``strategy=permuted`` (the peers' method) is weight matching with a permuted, not rotated, residual."""
    from fedlmc.data import load
    from fedlmc.models import from_preset
    from fedlmc.strategies import AlignedFedAvg
    from fedlmc.strategies.factory import build_strategy

    s = Settings.from_run_config({"strategy": "permuted", "preset": "vit-digits"})
    model = from_preset("vit-digits")
    strategy = build_strategy(s, model.config.to_dict(), load("digits"))
    assert isinstance(strategy, AlignedFedAvg) and strategy.residual == "permutation"
    assert build_strategy(Settings.from_run_config({"strategy": "aligned", "preset": "vit-digits"}),
                          model.config.to_dict(), load("digits")).residual == "orthogonal"


def test_run_config_sets_how_the_refinement_stops():
    """``refine-check-every``, ``refine-patience`` and ``refine-check-sigmas`` reach the refined strategies."""
    from fedlmc.data import load
    from fedlmc.models import from_preset
    from fedlmc.strategies import HeteroWidthFedAvg, RefinedFedAvg
    from fedlmc.strategies.factory import build_strategy

    model = from_preset("vit-digits")
    for strategy, cls in (("refined", RefinedFedAvg), ("hetero-refined", HeteroWidthFedAvg)):
        s = Settings.from_run_config({"strategy": strategy, "preset": "vit-digits", "refine-check-every": 5,
                                      "refine-patience": 3, "refine-check-sigmas": 0.5})
        got = build_strategy(s, model.config.to_dict(), load("digits"))
        assert isinstance(got, cls) and got.refine_checks == {"check_every": 5, "patience": 3, "sigmas": 0.5}
