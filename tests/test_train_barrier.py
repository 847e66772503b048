"""Checkpoints, seeded training, evaluation, barriers and the CLI, on tiny budgets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fedlmc
from fedlmc.cli import build_parser, main
from fedlmc.data import load
from fedlmc.data.base import ArrayData
from fedlmc.merging.averaging import interpolate
from fedlmc.merging.barrier import Curve, barrier, interpolation_curve, plot_curves
from fedlmc.models import PRESETS, from_preset, preset_config
from fedlmc.train import TrainConfig, evaluate, model_for_data, train


@pytest.fixture(scope="module")
def digits():
    return load("digits")


def test_presets_build_and_run():
    for name in PRESETS:
        cfg = preset_config(name)
        if cfg.d_model > 256:
            continue  # the gpt2-small shape is exercised by the benchmarks
        m = from_preset(name).eval()
        x = (
            torch.randint(0, cfg.vocab_size, (2, 8))
            if hasattr(cfg, "vocab_size")
            else torch.randn(2, cfg.channels, cfg.image_size, cfg.image_size)
        )
        out = m(x)
        assert out.shape == ((2, 8, cfg.vocab_size) if hasattr(cfg, "vocab_size") else (2, cfg.num_classes))
    assert preset_config("gpt2-small").d_ff == 3072 and preset_config("vit-cifar").patch_size == 4
    with pytest.raises(ValueError, match="unknown preset"):
        from_preset("nope")


def test_checkpoint_roundtrip_is_safetensors(tmp_path):
    m = from_preset("vit-digits").eval()
    m.meta = {"dataset": "digits"}
    fedlmc.save(m, tmp_path / "ck")
    raw = (tmp_path / "ck" / "model.safetensors").read_bytes()
    assert raw[8:9] == b"{"  # safetensors: 8-byte header length, then JSON header — not a pickle
    back = fedlmc.load(tmp_path / "ck")
    x = torch.randn(3, 1, 8, 8)
    assert torch.equal(m(x), back(x)) and back.meta == {"dataset": "digits"}
    with pytest.raises(FileNotFoundError, match="not a fedlmc checkpoint"):
        fedlmc.load(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_training_is_seeded_and_learns(digits):
    def run(seed, epochs):
        m = model_for_data("vit-digits", digits, seed)
        before = evaluate(m, digits.val)["loss"]
        train(m, digits.train, TrainConfig(epochs=epochs, lr=3e-3, batch_size=32, seed=seed), progress=False)
        return m, before, evaluate(m, digits.val)

    _, before, after = run(0, 10)
    assert after["loss"] < before - 0.5 and after["acc"] > 0.5
    # the same seed gives the same weights, another seed other weights (one epoch shows it)
    a, b, c = run(0, 1)[0], run(0, 1)[0], run(1, 1)[0]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.head.weight, c.head.weight)


def test_keep_best_ends_with_the_weights_of_the_best_validation_loss(digits):
    """Early stopping: a model that overfits 40 examples ends with the weights of its best validation
    evaluation (whose loss it reproduces), not its last; without ``keep_best`` it keeps the last."""
    few = ArrayData(digits.train.x[:40], digits.train.y[:40])

    def run(keep_best):
        m = model_for_data("vit-digits", digits, 0)
        cfg = TrainConfig(steps=200, lr=3e-3, batch_size=20, eval_every=20, keep_best=keep_best)
        return m, train(m, few, cfg, val=digits.val, progress=False)

    m, hist = run(True)
    losses = [e["loss"] for e in hist["evals"]]
    assert hist["best"]["loss"] == min(losses) and hist["best"]["step"] < hist["evals"][-1]["step"]
    assert losses[-1] > min(losses) + 0.1  # it did overfit: the last weights are not the best
    assert abs(evaluate(m, digits.val)["loss"] - min(losses)) < 1e-5
    with pytest.raises(ValueError, match="give val and eval_every"):
        train(m, few, TrainConfig(steps=1, keep_best=True), progress=False)
    plain, plain_hist = run(False)
    assert "best" not in plain_hist
    assert abs(evaluate(plain, digits.val)["loss"] - plain_hist["evals"][-1]["loss"]) < 1e-5


def test_barrier_definition():
    c = Curve([0.0, 0.5, 1.0], [1.0, 3.0, 2.0], [0, 0, 0])
    assert barrier(c) == pytest.approx(3.0 - 1.5)
    flat = Curve([0.0, 0.5, 1.0], [1.0, 1.5, 2.0], [0, 0, 0])
    assert barrier(flat) == pytest.approx(0.0)


def test_interpolation_curve_endpoints(digits, tmp_path):
    torch.manual_seed(0)
    a, b = from_preset("vit-digits").eval(), from_preset("vit-digits").eval()
    curve = interpolation_curve(a, b, digits.test, lambdas=[0.0, 0.5, 1.0])
    assert curve.loss[0] == pytest.approx(evaluate(b, digits.test)["loss"])
    assert curve.loss[-1] == pytest.approx(evaluate(a, digits.test)["loss"])
    assert barrier(interpolation_curve(a, a, digits.test, lambdas=[0, 0.3, 1])) == pytest.approx(0.0, abs=1e-6)
    png = plot_curves({"average": curve}, tmp_path / "c.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="differ in shape"):
        interpolate(a, from_preset("vit-digits", d_ff=32), 0.5)


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices
    assert {"train", "barrier", "demo"} <= set(subs)
    for name in subs:
        with pytest.raises(SystemExit) as e:
            parser.parse_args([name, "--help"])
        assert e.value.code == 0
        assert "usage" in capsys.readouterr().out


def test_cli_train_then_barrier(tmp_path, capsys):
    for seed in (0, 1):
        assert (
            main(
                [
                    "train",
                    "--preset",
                    "vit-digits",
                    "--seed",
                    str(seed),
                    "--epochs",
                    "1",
                    "--quiet",
                    "--out",
                    str(tmp_path / f"m{seed}"),
                ]
            )
            == 0
        )
    capsys.readouterr()
    assert (
        main(
            [
                "barrier",
                str(tmp_path / "m0"),
                str(tmp_path / "m1"),
                "--out",
                str(tmp_path / "b.json"),
                "--plot",
                str(tmp_path / "b.png"),
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "b.json").read_text())
    assert len(res["curve"]["loss"]) == 11 and res["barrier"] == pytest.approx(barrier(Curve(**res["curve"])))
    assert (tmp_path / "b.png").is_file()


def test_cli_missing_data_is_one_clear_error(tmp_path, capsys):
    code = main(["train", "--preset", "vit-cifar", "--out", str(tmp_path / "x"), "--data-dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "CIFAR-10 not found" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_merge_universe_refine_and_mixed_widths(tmp_path, capsys):
    from fedlmc import io
    from fedlmc.models import from_preset

    for seed in (0, 1, 2):
        assert (
            main(
                [
                    "train",
                    "--preset",
                    "vit-digits",
                    "--seed",
                    str(seed),
                    "--epochs",
                    "1",
                    "--quiet",
                    "--out",
                    str(tmp_path / f"m{seed}"),
                ]
            )
            == 0
        )
    capsys.readouterr()
    assert (
        main(
            [
                "merge",
                *(str(tmp_path / f"m{s}") for s in range(3)),
                "--method",
                "refined",
                "--steps",
                "5",
                "--iterations",
                "2",
                "--quiet",
                "--out",
                str(tmp_path / "merged"),
                "--plot",
                str(tmp_path / "s.png"),
                "--simplex-n",
                "2",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["method"] == "refined" and len(res["endpoint_loss"]) == 3 and (tmp_path / "s.png").is_file()
    merged = io.load(tmp_path / "merged")
    assert merged.meta["excess"] == pytest.approx(res["excess"])
    # a narrower model (half the residual width, fewer FF neurons) joins the universe
    torch.manual_seed(0)
    narrow = from_preset("vit-digits", d_model=16, d_ff=32, d_head=8)
    io.save(narrow, tmp_path / "narrow", {"dataset": "digits"})
    assert (
        main(["merge", str(tmp_path / "m0"), str(tmp_path / "narrow"), "--quiet", "--out", str(tmp_path / "mixed")])
        == 0
    )
    mixed = io.load(tmp_path / "mixed")
    assert mixed.config.d_model == 32 and mixed.config.d_ff == 64
    # three models are needed for the simplex plot: a clear error otherwise
    assert (
        main(
            [
                "merge",
                str(tmp_path / "m0"),
                str(tmp_path / "m1"),
                "--quiet",
                "--out",
                str(tmp_path / "x"),
                "--plot",
                str(tmp_path / "x.png"),
            ]
        )
        == 2
    )


def test_evaluation_batches_of_a_large_vocabulary_are_capped(monkeypatch):
    """A GPT-2-sized vocabulary would make 256-window logits tens of GB: the batch shrinks to the budget."""
    import torch.nn as nn

    from fedlmc import train as train_mod
    from fedlmc.data.base import TokenData

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"vocab_size": 1000})()
            self.w = nn.Parameter(torch.zeros(1))
            self.seen = []

        def forward(self, x):
            self.seen.append(x.shape[0])
            return torch.zeros(*x.shape, 1000) + self.w

    monkeypatch.setattr(train_mod, "LOGITS_BUDGET", 16 * 8 * 1000)  # 16 windows of 8 tokens
    m = Big()
    out = train_mod.evaluate(m, TokenData(torch.randint(0, 1000, (8 * 100 + 1,)), 8))
    assert max(m.seen) == 16 and sum(m.seen) == 100 and abs(out["loss"] - float(torch.log(torch.tensor(1000.0)))) < 1e-4


def test_a_cache_name_changes_with_every_training_field_and_the_training_code(tmp_path, monkeypatch):
    """The model cache's key covers every training field (each changed alone gives a new name), the
    architecture's overrides and the training code: a changed model, data or training module (or torch)
    makes a new entry, so no result reuses a model other code trained. A reused entry is named in the
    next results file's record."""
    import dataclasses
    import shutil

    from fedlmc import provenance
    from fedlmc.commands import cache_name
    from fedlmc.train import TrainConfig

    class Splits:
        name, meta = "shakespeare", {"source": "tinyshakespeare.txt"}

    cfg = TrainConfig(steps=10, lr=2e-3)
    base = cache_name("gpt2-tiny", 0, Splits, cfg)
    assert base == cache_name("gpt2-tiny", 0, Splits, TrainConfig(steps=10, lr=2e-3))  # stable
    changed = {"keep_best": True, "optimizer": "sgd", "lr": 1e-3, "steps": 11, "batch_size": 7, "seed": 5}
    assert set(changed) <= {f.name for f in dataclasses.fields(TrainConfig)}
    names = {k: cache_name("gpt2-tiny", 0, Splits, dataclasses.replace(cfg, **{k: v})) for k, v in changed.items()}
    assert base not in names.values() and len(set(names.values())) == len(changed)
    assert cache_name("gpt2-tiny", 0, Splits, cfg, {"d_model": 64}) != base
    # the training code: a copy of the package with one byte of train.py changed hashes differently
    root = Path(provenance.__file__).resolve().parents[1]
    copy = tmp_path / "fedlmc"
    shutil.copytree(root / "fedlmc", copy, ignore=shutil.ignore_patterns("__pycache__", "*.txt"))
    fake = copy / "provenance.py"
    monkeypatch.setattr(provenance, "__file__", str(fake))
    same = provenance.code_hash()
    assert same == provenance.code_hash() and cache_name("gpt2-tiny", 0, Splits, cfg) == base
    (copy / "train.py").write_text((copy / "train.py").read_text() + "\n# changed\n")
    assert provenance.code_hash() != same and cache_name("gpt2-tiny", 0, Splits, cfg) != base
    (copy / "train.py").write_text((root / "fedlmc" / "train.py").read_text())
    (copy / "models" / "gpt2.py").write_text((copy / "models" / "gpt2.py").read_text() + "\n")
    assert provenance.code_hash() != same
    monkeypatch.setattr(provenance, "_REUSED", [])
    provenance.reused(tmp_path / "entry")
    assert provenance.record()["reused"] == [str(tmp_path / "entry")]
