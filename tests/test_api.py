"""The public API's shape: one import path and one name per thing, option objects instead of long
parameter lists, and a wheel that installs only the library."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from dataclasses import fields
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
RETIRED = {
    "init",
    "model_config",
    "starts",
    "max_iter",
    "rtol",
    "refine_data",
    "refine_steps",
    "refine_check_every",
    "refine_patience",
    "refine_check_sigmas",
    "refine_check_data",
    "refine_lr",
    "method",
}


def _public_functions():
    for path in sorted((ROOT / "fedlmc").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and (not node.name.startswith("_") or node.name == "__init__"):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                yield path.relative_to(ROOT), node.name, names


def test_no_public_function_takes_a_long_parameter_list():
    long = {(str(p), f): len(n) for p, f, n in _public_functions() if len(n) > 12}
    assert long == {}, long


def _knobs(cls) -> list[str]:
    """A strategy's fedlmc knobs: the keyword parameters of every ``__init__`` along its class chain below
    Flower's ``FedAvg`` (whose own parameters a fedlmc strategy passes through unchanged)."""
    from flwr.serverapp.strategy import FedAvg

    out: list[str] = []
    for c in cls.__mro__:
        if c is FedAvg or not issubclass(c, FedAvg):
            break
        if "__init__" in vars(c):
            params = inspect.signature(c.__init__).parameters.values()
            out += [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in out]
    return out


def test_no_strategy_takes_more_than_twelve_fedlmc_knobs():
    import fedlmc.strategies as strategies

    counts = {name: len(_knobs(getattr(strategies, name))) for name in strategies.__all__ if name[0].isupper()}
    assert max(counts.values()) <= 12 and counts["AlignedFedAvg"] >= 10, counts


def test_one_default_per_knob_from_run_config_to_the_functions():
    """run_config's keys, the option objects they fill, and the functions that take the objects agree on
    each default: a knob has one default, defined on its option object."""
    from fedlmc.baselines import OTFusion
    from fedlmc.federated import Settings
    from fedlmc.merging.universe import universe_merge
    from fedlmc.options import Distill, Guard, Matching, OnClients, Refinement, Robust, Scale, Screen, Universe
    from fedlmc.strategies.registry import Build

    s = Settings()
    pairs = {
        "iterations": (s.iterations, Universe.iterations),
        "universe-start": (s.universe_start, Universe.start),
        "reduce": (s.reduce, Robust.reduce),
        "trim": (s.trim, Robust.trim),
        "min-gain": (s.min_gain, Matching.min_gain),
        "refine-steps": (s.refine_steps, Refinement.steps),
        "workers": (s.workers, Scale.workers),
        "spool": (s.spool, Scale.spool),
        "screen-threshold": (s.screen_threshold, Screen.threshold),
        "malicious": (s.malicious, Screen.malicious),
        "clients-per-step": (s.key("clients-per-step"), OnClients.clients_per_step),
        "form": (Settings.form, Universe.form),
        "keep_layernorm": (Settings.keep_layernorm, Universe.keep_layernorm),
        "guard_batches": (Settings.guard_batches, Guard.batches),
        "distill-steps": (s.key("distill-steps"), Distill.steps),
        "ot-reg": (s.key("ot-reg"), OTFusion.reg),
        "distill-lr": (s.key("distill-lr"), Distill.lr),
        "distill-temperature": (s.key("distill-temperature"), Distill.temperature),
    }
    assert {k: a for k, (a, b) in pairs.items() if a != b} == {}
    # the functions below take the objects, with the objects' own defaults (None: the object's default)
    params = inspect.signature(universe_merge).parameters
    assert params["universe"].default is None and params["robust"].default is None
    # the defaults Settings builds are the objects' defaults
    b = Build(s, None, None)
    assert b.aligned(on_clients=True)["universe"] == Universe() and b.robust()["robust"] == Robust()
    assert s.matching() == Matching() and s.scale() == Scale(threads=None)


def test_no_retired_name_in_a_public_signature():
    found = [(str(p), f, sorted(set(n) & RETIRED)) for p, f, n in _public_functions() if set(n) & RETIRED]
    assert not found, found


@pytest.mark.parametrize(
    "module",
    ["fedlmc.merge", "fedlmc.canonical", "fedlmc.vocabulary", "fedlmc.strategies.factory", "simulations.server_app"],
)
def test_the_old_import_paths_are_gone(module):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)


def test_one_name_per_knob_from_run_config_to_the_option_objects():
    """Every refinement key of run_config is ``refine-<field>`` of ``Refinement`` (the same name below
    the prefix), and its default is the object's."""
    from fedlmc.options import Refinement
    from simulations.experiment import ExperimentSettings

    refine = {f.name: f.default for f in fields(Refinement)}
    keys = [f for f in fields(ExperimentSettings) if f.name.startswith("refine_")]
    assert {f.name for f in keys} == {
        "refine_steps",
        "refine_alpha",
        "refine_check_every",
        "refine_patience",
        "refine_check_sigmas",
    }
    for f in keys:
        assert f.default == refine[f.name.removeprefix("refine_")], f.name


def test_universe_merge_takes_the_option_objects():
    from fedlmc.merging.universe import universe_merge

    params = inspect.signature(universe_merge).parameters
    assert {"matching", "refine"} <= set(params) and not {"data", "alpha", "gauge", "residual"} & set(params)


def test_the_wheel_installs_only_the_library():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["fedlmc*"]


def test_the_fab_carries_the_apps_and_not_the_library(tmp_path):
    """``flwr run .`` ships a FAB: it must hold the apps only, so that ``fedlmc`` is imported from where it
    is installed, with its data (a FAB drops the shipped Tiny Shakespeare text: .txt is not a FAB type)."""
    import shutil
    import subprocess
    import sys
    import zipfile

    flwr = shutil.which("flwr") or str(Path(sys.executable).parent / "flwr")
    # Flower takes the app's name from its folder (letters, digits, hyphens): build a copy of the checkout
    # under such a name, whatever folder this checkout was cloned into
    app = tmp_path / "fedlmc-app"
    shutil.copytree(
        ROOT, app, ignore=shutil.ignore_patterns(".git", ".venv", ".flwr", "runs", "__pycache__", "*.egg-info")
    )
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run([flwr, "build", "--app", str(app)], cwd=out, check=True, capture_output=True, timeout=120)
    names = zipfile.ZipFile(next(out.glob("*.fab"))).namelist()
    assert {"clients/app.py", "server/app.py", "server/comparison.py", "strategies/factory.py"} <= set(names)
    assert not [n for n in names if n.startswith(("fedlmc/", "simulations/", "tests/"))], names


# names more than one option object uses, each with one meaning wherever it appears
SHARED = {
    "batch_size": "examples per optimisation step of the object's own loop",
    "batches": "how many batches of the object's data are scored",
    "check_batches": "held-out batches each check scores",
    "check_data": "the held-out data the checks score",
    "check_every": "steps between two checks",
    "check_sigmas": "standard errors an improvement must exceed",
    "data": "the server-side data set the object learns or scores on",
    "device": "where the object's tensors live (CUDA when present)",
    "loss_fn": "the loss of a batch's logits and targets",
    "lr": "the learning rate of the object's own optimiser",
    "method": "which variant of the object's algorithm",
    "patience": "checks in a row without improvement before stopping",
    "perm_lr": "the permutation latents' learning rate",
    "relax": "how permutations are relaxed while learning",
    "schedule": "the learning-rate schedule",
    "seed": "seeds the object's randomness",
    "steps": "at most this many optimisation steps",
    "tau": "the Sinkhorn relaxation's temperature",
}


def _option_objects():
    import fedlmc.baselines as baselines
    import fedlmc.options as options
    from fedlmc.train import TrainConfig

    found = [getattr(options, n) for n in dir(options) if n[:1].isupper()]
    found += [getattr(baselines, n) for n in baselines.__all__]
    return [c for c in found if dataclasses.is_dataclass(c) and isinstance(c, type)] + [TrainConfig]


def test_one_name_one_meaning_across_the_option_objects():
    """A field name two option objects share is one meaning (SHARED says which); `iterations`, `tol`,
    `residual`, `start` each name one thing (the universe's iterations and tolerance, the residual
    group, the universe's start), and `optimizer` is the one spelling."""
    import collections

    users = collections.defaultdict(set)
    for cls in _option_objects():
        for f in dataclasses.fields(cls):
            users[f.name].add(cls.__name__)
    collisions = {n: sorted(c) for n, c in users.items() if len(c) > 1 and n not in SHARED}
    assert collisions == {}, collisions
    assert users["iterations"] == {"Universe"} and users["tol"] == {"Universe"} and users["start"] == {"Universe"}
    assert users["residual"] == {"Matching"}
    spelled = {n for _, _, names in _public_functions() for n in names if "optimiser" in n}
    assert not spelled and not any("optimiser" in n for n in users), spelled


def test_one_name_one_meaning_from_run_config_to_the_options():
    """A run_config key named as an option field fills that field (one meaning, one default), and so does
    a strategy's own key (its doc names the field)."""
    from fedlmc.federated import Settings
    from fedlmc.strategies.registry import all_keys

    by_name: dict[str, list[str]] = {}
    for cls in _option_objects():
        for f in dataclasses.fields(cls):
            by_name.setdefault(f.name, []).append(cls.__name__)
    fills = {
        "iterations": "Universe",
        "residual": "Matching",
        "min_gain": "Matching",
        "ff_scale": "Matching",
        "reduce": "Robust",
        "trim": "Robust",
        "malicious": "Screen",
        "guard": "OnClients",
        **{k: "Scale" for k in ("device", "threads", "workers", "spool", "spool_dir", "ray_address")},
        **{k: "TrainConfig" for k in ("lr", "batch_size", "seed", "proximal_mu")},
        "alpha": "Refinement",  # SHARED: a Dirichlet concentration (the partitioner's; the merge weights')
    }
    for f in dataclasses.fields(Settings):
        if f.name in by_name:
            assert fills.get(f.name) in by_name[f.name], (f.name, by_name[f.name])
    for name, key in all_keys().items():  # a strategy's key named as a field is that field, and says so
        field_name = name.replace("-", "_")
        if field_name in by_name:
            assert any(f"`{c}.{field_name}`" in key.doc for c in by_name[field_name]), (name, key.doc)


def test_plain_averaging_has_one_name():
    """Plain (weighted) averaging is `average` wherever a user picks it: the registry, the fallback, the
    universe's start, the robust reduction, FedDF's student, the LoRA peers, the barrier methods and
    `fedlmc merge`; its class is AverageFedAvg (the old name says so)."""
    import argparse

    import fedlmc.baselines.lora as lb
    import fedlmc.options as options
    from fedlmc.cli import build_parser
    from fedlmc.reproduce import METHODS
    from fedlmc.strategies.registry import REGISTRY

    others = {"mean", "vanilla", "plain", "fedit", "fedavg", "avg"}
    offered = {
        "registry": set(REGISTRY),
        "Universe.start": set(options.UNIVERSE_STARTS),
        "Robust.reduce": set(options.REDUCES),
        "Distill.student": set(options.DISTILL_STUDENTS),
        "LoRA peers": set(lb.METHODS),
        "barrier methods": set(METHODS),
    }
    merge = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["merge"]
    offered["fedlmc merge"] = set(next(a for a in merge._actions if a.dest == "method").choices)
    for where, names in offered.items():
        assert "average" in names and not names & others, (where, sorted(names))
    from fedlmc.strategies import AlignedFedAvg

    with pytest.raises(ValueError, match="'average'"):
        AlignedFedAvg(model=None, fallback="mean")
    with pytest.raises(ImportError, match="AverageFedAvg"):
        from fedlmc.strategies import ReportingFedAvg  # noqa: F401
