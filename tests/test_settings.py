"""One source of configuration: the run_config defaults Flower reads (``pyproject.toml``,
``[tool.flwr.app.config]``) and ``fedlmc.federated.Settings``' defaults are the same keys and values."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import tomllib

from fedlmc.federated import Settings
from fedlmc.options import Screen

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_run_config_reads_back_as_the_defaults():
    """The app's run_config (every key at its default: tests/test_docs.py) reads as the default settings,
    each strategy's own key at its declared default."""
    from fedlmc.strategies.registry import all_keys

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    s = Settings.from_run_config(config)
    assert s.to_run_config() == {**Settings().to_run_config(), **{k: key.default for k, key in all_keys().items()}}
    assert all(s.key(k) == key.default for k, key in all_keys().items())


def test_unknown_keys_and_values_are_clear_errors():
    with pytest.raises(ValueError, match="unknown run_config key 'rounds'"):
        Settings.from_run_config({"rounds": 3})
    with pytest.raises(ValueError, match="unknown strategy"):
        Settings.from_run_config({"strategy": "fedproxy"})
    assert {f.name for f in fields(Settings)} - {"strategy_keys"} == {
        k.replace("-", "_") for k in Settings().to_run_config()
    }


def test_one_name_per_strategy_and_no_experiment_keys_in_production():
    """No alias is accepted, and the experiment layer's keys (poisoning, the client cache, the report,
    the refinement's tuning) are unknown to the production app."""
    from simulations.experiment import ExperimentSettings

    assert Settings.from_run_config({"strategy": "average"}).strategy == "average"
    for alias in ("fedavg", "wm", "refine"):
        with pytest.raises(ValueError, match=f"unknown strategy '{alias}'"):
            Settings.from_run_config({"strategy": alias})
    experiment = {f.name for f in fields(ExperimentSettings)} - {f.name for f in fields(Settings)}
    assert {"poison_partition", "poison", "poison_scale", "client_cache", "report"} <= experiment
    for key in ("poison-partition", "client-cache", "report", "refine-alpha"):
        with pytest.raises(ValueError, match="unknown run_config key"):
            Settings.from_run_config({key: 1})
    with pytest.raises(ValueError, match="unknown poison"):
        ExperimentSettings.from_run_config({"poison": "noise"})


def test_the_production_client_app_has_no_experiment_code_path():
    """Poisoning and the client cache live in the experiment layer alone."""
    import inspect

    import clients.app
    import fedlmc.federated

    for module in (clients.app, fedlmc.federated):
        source = inspect.getsource(module)
        assert "poison" not in source and "client_cache" not in source, module.__name__


def _round(pid: int, seed: int):
    from clients.app import Round

    return Round(partition=pid, partitions=2, round=1, seed=seed)


def test_client_cache_keeps_a_tied_hf_client(tmp_path):
    """A Hugging Face GPT-2 client (tied head: two keys, one tensor) goes through the cache intact."""
    import torch

    from fedlmc.federated import client_config, client_data, fresh_client_model
    from simulations.experiment import ExperimentSettings, cached_first_round

    s = ExperimentSettings.from_run_config(
        {"preset": "gpt2-tiny", "local-steps": 2, "batch-size": 4, "hf": True, "client-cache": str(tmp_path)}
    )
    data, _ = client_data(s, 0, 2)
    cfg = client_config(s, 0).replace(n_layer=1)
    first = fresh_client_model(s, 0, cfg)
    cached_first_round(first, data, s, _round(0, 3))
    again = fresh_client_model(s, 0, cfg)
    cached_first_round(again, data, s, _round(0, 3))
    assert again.lm_head.weight is again.transformer.wte.weight  # still tied after loading
    assert torch.equal(again.lm_head.weight.cpu(), first.lm_head.weight.cpu())  # (trained on the GPU if any)


def test_client_cache_trains_a_one_shot_client_once(tmp_path):
    """The comparison runner's client cache: the second strategy's client is the first one's, exactly,
    and a change in anything training depends on (here the learning rate) trains anew."""
    import torch

    from fedlmc.federated import client_config, client_data, fresh_client_model
    from simulations.experiment import ExperimentSettings, cached_first_round

    s = ExperimentSettings.from_run_config({"preset": "vit-digits", "local-steps": 3, "client-cache": str(tmp_path)})
    data, _ = client_data(s, 0, 2)
    cfg = client_config(s, 0)
    first = fresh_client_model(s, 0, cfg)
    start = {k: v.clone() for k, v in first.state_dict().items()}
    assert cached_first_round(first, data, s, _round(0, 7)) is not None
    assert any(not torch.equal(start[k], v.cpu()) for k, v in first.state_dict().items())  # it trained
    refined = ExperimentSettings.from_run_config({**s.to_run_config(), "strategy": "refined"})
    again = fresh_client_model(refined, 0, cfg)
    cached_first_round(again, data, refined, _round(0, 7))
    assert all(torch.equal(first.state_dict()[k].cpu(), v.cpu()) for k, v in again.state_dict().items())
    other = ExperimentSettings.from_run_config({**s.to_run_config(), "lr": 0.01})
    third = fresh_client_model(other, 0, cfg)
    cached_first_round(third, data, other, _round(0, 7))
    assert any(not torch.equal(first.state_dict()[k].cpu(), v.cpu()) for k, v in third.state_dict().items())
    assert len(list(tmp_path.iterdir())) == 2


def test_permuted_is_the_permutation_only_baseline():
    """``strategy=permuted`` (the peers' method) is weight matching with a permuted, not rotated, residual."""
    from fedlmc.data import load
    from fedlmc.models import from_preset
    from fedlmc.strategies import AlignedFedAvg
    from strategies.factory import build_strategy

    s = Settings.from_run_config({"strategy": "permuted", "preset": "vit-digits"})
    model = from_preset("vit-digits")
    strategy = build_strategy(s, model.config.to_dict(), load("digits"))
    assert isinstance(strategy, AlignedFedAvg) and strategy.matching.residual == "permutation"
    assert (
        build_strategy(
            Settings.from_run_config({"strategy": "aligned", "preset": "vit-digits"}),
            model.config.to_dict(),
            load("digits"),
        ).matching.residual
        == "orthogonal"
    )


def test_run_config_sets_how_the_refinement_stops():
    """``refine-check-every``, ``refine-patience`` and ``refine-check-sigmas`` (experiment keys) reach the
    refined strategies' ``Refinement`` under the same names; production runs use its defaults."""
    from fedlmc.data import load
    from fedlmc.models import from_preset
    from fedlmc.strategies import HeteroWidthFedAvg, RefinedFedAvg
    from simulations.experiment import ExperimentSettings
    from strategies.factory import build_strategy

    model = from_preset("vit-digits")
    for strategy, cls in (("refined", RefinedFedAvg), ("hetero-refined", HeteroWidthFedAvg)):
        s = ExperimentSettings.from_run_config(
            {
                "strategy": strategy,
                "preset": "vit-digits",
                "refine-check-every": 5,
                "refine-patience": 3,
                "refine-check-sigmas": 0.5,
                "refine-steps": 7,
            }
        )
        got = build_strategy(s, model.config.to_dict(), load("digits"))
        assert isinstance(got, cls)
        assert (got.refine.check_every, got.refine.patience, got.refine.check_sigmas, got.refine.steps) == (
            5,
            3,
            0.5,
            7,
        )
        default = build_strategy(
            Settings.from_run_config({"strategy": strategy, "preset": "vit-digits"}),
            model.config.to_dict(),
            load("digits"),
        ).refine
        assert (default.check_every, default.patience, default.check_sigmas) == (
            10,
            2,
            2.0,
        ) and default.data is not None
    # the run_config's screen reaches the refined strategies as it does the aligned ones
    for strategy, method in (("refined", "information"), ("refined-clients", "distance"), ("aligned", "distance")):
        cfg = {"strategy": strategy, "preset": "vit-digits", "screen": method}
        got = build_strategy(Settings.from_run_config(cfg), model.config.to_dict(), load("digits"))
        assert got.screen == Screen(method=method), strategy


def test_universe_start_reaches_the_aligned_and_refined_strategies_and_nothing_else():
    """run_config ``universe-start`` is ``Universe.start`` of ``AlignedFedAvg`` (``RefinedFedAvg``'s too); a
    strategy without a universe refuses it, and an unknown start is a clear error."""
    from fedlmc.data import load
    from fedlmc.models import from_preset
    from strategies.factory import build_strategy

    model = from_preset("vit-digits")
    for strategy in ("aligned", "refined", "refined-clients", "permuted"):
        cfg = {"strategy": strategy, "preset": "vit-digits", "universe-start": "average"}
        got = build_strategy(Settings.from_run_config(cfg), model.config.to_dict(), load("digits"))
        assert got.universe.start == "average", strategy
    default = build_strategy(
        Settings.from_run_config({"preset": "vit-digits", "strategy": "aligned"}),
        model.config.to_dict(),
        load("digits"),
    )
    assert default.universe.start == "previous"
    for strategy in ("average", "hetero", "krum"):
        with pytest.raises(ValueError, match="universe-start"):
            Settings.from_run_config({"strategy": strategy, "universe-start": "average"})
    with pytest.raises(ValueError, match="universe-start"):
        Settings.from_run_config({"strategy": "aligned", "universe-start": "median"})


def test_ff_lift_reaches_the_mixed_width_strategies_and_nothing_else():
    """run_config ``ff-lift`` is ``Universe.ff_lift`` of ``HeteroWidthFedAvg``; a strategy without a
    mixed-width universe refuses it, and an unknown lift is a clear error."""
    from fedlmc.data import load
    from fedlmc.models import from_preset
    from strategies.factory import build_strategy

    model = from_preset("vit-digits")
    for strategy in ("hetero", "hetero-refined"):
        cfg = {"strategy": strategy, "preset": "vit-digits", "ff-lift": "split", "width-factors": "1,2"}
        got = build_strategy(Settings.from_run_config(cfg), model.config.to_dict(), load("digits"))
        assert got.universe.ff_lift == "split", strategy
    with pytest.raises(ValueError, match="ff-lift"):
        Settings.from_run_config({"strategy": "aligned", "ff-lift": "split"})
    with pytest.raises(ValueError, match="ff-lift"):
        Settings.from_run_config({"strategy": "hetero", "ff-lift": "copies"})


def test_ot_cost_gives_ot_fusion_the_server_data():
    """run_config ``ot-cost = "activations"``: ``OTFusionFedAvg`` costs its maps on activations of the
    server's refinement half (the data ``refined`` learns on); an unknown cost is a clear error."""
    from fedlmc.data import load
    from fedlmc.models import from_preset
    from strategies.factory import build_strategy

    model = from_preset("vit-digits")
    cfg = {"strategy": "ot-fusion", "preset": "vit-digits", "ot-cost": "activations"}
    got = build_strategy(Settings.from_run_config(cfg), model.config.to_dict(), load("digits"))
    assert got.fusion.cost == "activations" and len(got.fusion.data) > 0
    plain = build_strategy(
        Settings.from_run_config({"strategy": "ot-fusion", "preset": "vit-digits"}),
        model.config.to_dict(),
        load("digits"),
    )
    assert plain.fusion.cost == "weights" and plain.fusion.data is None
    with pytest.raises(ValueError, match="ot-cost"):
        Settings.from_run_config({"strategy": "ot-fusion", "ot-cost": "gradients"})
