"""The paths that pick CUDA when it is present, run on the GPU (``make gpu-check`` runs them there) or,
without one, on a CUDA device emulated on the CPU (``fake_cuda``: every torch call checked for tensors
of both devices, as CUDA checks them). Each result is checked against the CPU's: the transforms are
exact symmetries in float64 on the CPU, objectives and losses agree within float32 noise, and the
models come back usable."""

from __future__ import annotations

import pytest
import torch
from conftest import inputs_for
from fake_cuda import fake_cuda
from test_matching import SHAPES, make

from fedlmc.data.base import TokenData
from fedlmc.matching import learned_matching, weight_matching
from fedlmc.merging.barrier import interpolation_curve
from fedlmc.merging.universe import universe_merge
from fedlmc.models import from_preset
from fedlmc.options import Learning, Universe
from fedlmc.symmetry import apply_transform, canonicalize
from fedlmc.train import TrainConfig, evaluate, pick_device, train


@pytest.fixture(autouse=True)
def cuda():
    """The GPU when there is one, else the emulated device."""
    if torch.cuda.is_available():
        yield "cuda"
    else:
        with fake_cuda():
            yield "emulated"


def _tokens(vocab: int, n: int = 4096, block: int = 16, seed: int = 3) -> TokenData:
    g = torch.Generator().manual_seed(seed)
    return TokenData(torch.randint(0, vocab, (n,), generator=g), block_size=block)


def _gap(a, b, x) -> float:
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


def _distance(A, B_aligned) -> float:
    """Squared distance between A's canonical form and an aligned model's (float64)."""
    sa, sb = canonicalize(A).state_dict(), B_aligned.state_dict()
    return sum(float((sa[k].double() - sb[k].double()).pow(2).sum()) for k in sa)


def test_cuda_is_the_default_device():
    assert pick_device().type == "cuda"


def test_cuda_weight_matching_equals_the_cpus_and_is_exact(record):
    A, B = make("gpt2", 0), make("gpt2", 1)  # float64
    cb = canonicalize(B)
    on = {dev: weight_matching(A, B, device=dev) for dev in ("cpu", "cuda")}
    d = {dev: _distance(A, apply_transform(cb, T)) for dev, T in on.items()}
    record("cuda: weight matching's distance vs the CPU's (relative)", abs(d["cuda"] - d["cpu"]) / d["cpu"], 1e-4)
    record("cuda: weight-matched B vs B (float64)", _gap(B, apply_transform(B, on["cuda"]), inputs_for(A)), 1e-10)


def test_cuda_learned_matching_is_an_exact_symmetry(record):
    A, B = make("gpt2", 0), make("gpt2", 1)
    init = weight_matching(A, B, device="cuda")
    data = _tokens(SHAPES["gpt2"][1]["vocab_size"])
    T = learned_matching(A, B, data, init, Learning(steps=8, lr=0.05), progress=False, device="cuda")
    assert float((T["residual"].cpu() - init["residual"].cpu()).abs().max()) > 1e-4  # it learned something
    record("cuda: learned-matched B vs B (float64)", _gap(B, apply_transform(B, T), inputs_for(A)), 1e-10)


def test_cuda_training_runs_on_the_gpu_and_lowers_the_loss():
    kw = SHAPES["gpt2"][1]
    torch.manual_seed(0)
    model = from_preset("gpt2-tiny", **kw)
    data = TokenData(torch.arange(4096) % kw["vocab_size"], block_size=16)  # a learnable stream
    before = evaluate(model, data)["loss"]
    train(model, data, TrainConfig(steps=60, lr=3e-3, batch_size=32), progress=False)
    assert next(model.parameters()).is_cuda
    assert evaluate(model, data)["loss"] < before / 2


def test_cuda_evaluation_of_an_interpolation_equals_the_cpus():
    kw = SHAPES["gpt2"][1]
    A, B = (make("gpt2", s).float() for s in (0, 1))
    data = _tokens(kw["vocab_size"], n=2048)
    cpu = interpolation_curve(A, B, data, lambdas=(0.0, 0.5, 1.0))
    gpu = interpolation_curve(A, B, data, lambdas=(0.0, 0.5, 1.0), device="cuda")
    assert max(abs(x - y) for x, y in zip(cpu.loss, gpu.loss)) < 1e-4 * max(cpu.loss)
    assert next(A.parameters()).device.type == "cpu"  # the endpoints stay where they were


def test_cuda_universe_merge_equals_the_cpus():
    models = [make("gpt2", s) for s in range(3)]
    data = _tokens(SHAPES["gpt2"][1]["vocab_size"], n=2048)
    out = {
        dev: universe_merge(models, device=dev, universe=Universe(iterations=3, keep_layernorm=False))
        for dev in ("cpu", "cuda")
    }
    for dev, (merged, transforms) in out.items():
        assert next(merged.parameters()).device.type == "cpu", dev
        assert len(transforms) == 3
    loss = {dev: evaluate(merged.float(), data, device="cpu")["loss"] for dev, (merged, _) in out.items()}
    assert abs(loss["cuda"] - loss["cpu"]) < 1e-3 * loss["cpu"], loss


def test_cuda_weight_matching_multiplies_at_full_precision_whatever_the_caller_allows(monkeypatch):
    """A caller that allows TF32 (common in GPU training code) gets weight matching's products at full
    float32 precision all the same (its objective subtracts nearly equal sums), and its setting back."""
    import fedlmc.matching.weight as weight_module

    seen = []
    descent = weight_module.coordinate_descent

    def spy(*args, **kwargs):
        seen.append(torch.get_float32_matmul_precision())
        return descent(*args, **kwargs)

    monkeypatch.setattr(weight_module, "coordinate_descent", spy)
    was = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        weight_matching(make("gpt2", 0), make("gpt2", 1), device="cuda")
        assert seen == ["highest"] and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(was)


def test_cuda_squared_norms_are_accumulated_in_float64():
    """``sq_norm`` on the device sums in float64, as on the CPU (the objective's norms)."""
    from fedlmc.matching.problem import sq_norm

    t = torch.randn(50_000, 64, generator=torch.Generator().manual_seed(0)) * 3 + 1
    exact = float(t.double().pow(2).sum())
    on = sq_norm(t.to("cuda"))
    assert on.dtype == torch.float64 and abs(float(on) - exact) / exact < 1e-12


def test_cuda_pair_curves_of_models_trained_on_the_device():
    """The GPU check's paper step in miniature: two models trained on the device (early stopping), then
    averaging, weight-matching and learned curves evaluated there; alignment lowers the barrier."""
    from fedlmc.data import load
    from fedlmc.reproduce import pair_curves
    from fedlmc.train import train_preset

    splits = load("shakespeare", block_size=32, seed=0)
    shape = dict(n_layer=2, d_model=32, d_ff=64)
    models = [
        train_preset("gpt2-tiny", splits, s, False, shape, steps=30, eval_every=10, keep_best=True)[0] for s in (0, 1)
    ]
    assert all(next(m.parameters()).is_cuda and "best" in m.meta for m in models)
    out = pair_curves(*models, splits, ["average", "wm-orth-factored", "learned"], learned_steps=5, progress=False)
    assert out["wm-orth-factored"]["barrier"] < out["average"]["barrier"]
    assert out["learned"]["barrier"] < out["average"]["barrier"]


def test_cuda_server_aggregates_planted_replies_with_the_aligned_strategy(record):
    """A ServerApp on a GPU machine: ``AlignedFedAvg`` aligns 3 planted replies there and returns
    Flower arrays (on the CPU) of the planted model (the strategy test, run on the device)."""
    pytest.importorskip("flwr")
    from test_strategies import test_planted_replies_aggregate_to_the_model

    test_planted_replies_aggregate_to_the_model(record)
