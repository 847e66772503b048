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
