"""Optimal-transport fusion (Imfeld et al., ICLR 2024): planted copies, the transport solver, and the
registered strategy."""

from __future__ import annotations

import pytest
import torch
from test_flower_contract import task_identity  # noqa: F401  (the fixture)

from fedlmc.baselines import OTFusion
from fedlmc.baselines.ot_fusion import ground_cost, ot_align, ot_fusion, transport
from fedlmc.models import from_preset

SMALL = {
    "vit-tiny": dict(n_layer=2, d_model=16, n_head=4, d_ff=32, image_size=8, patch_size=4),
    "gpt2-tiny": dict(n_layer=2, d_model=16, n_head=4, d_ff=32, vocab_size=11, block_size=8),
}


def _inputs(preset: str, g: torch.Generator) -> torch.Tensor:
    if preset == "vit-tiny":
        return torch.randn(5, 1, 8, 8, generator=g, dtype=torch.float64)
    return torch.randint(0, 11, (5, 8), generator=g)


def planted_copy(model, g: torch.Generator):
    """``model`` with its residual coordinates, its heads, the units inside each head (Q with K, V with
    O) and its FF neurons permuted at random: the same function."""
    cfg = model.config
    d, H, dh = cfg.d_model, cfg.n_head, cfg.d_head
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    r = torch.randperm(d, generator=g)

    def heads(order):
        return torch.cat([h * dh + torch.randperm(dh, generator=g) for h in order])

    out = {}
    for k, v in sd.items():
        if k in ("pos_emb", "tok_emb.weight", "cls_token") or k.startswith(("ln_f", "head.weight")) or ".ln" in k:
            v = v[..., r]
        elif k.startswith("patch_emb"):
            v = v[r]
        out[k] = v
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        order = torch.randperm(H, generator=g)  # a head keeps its QK and OV circuits together
        qk, vo, ff = heads(order), heads(order), torch.randperm(cfg.d_ff, generator=g)
        for name, rows in (("q", qk), ("k", qk), ("v", vo)):
            out[p + f"attn.{name}.weight"] = sd[p + f"attn.{name}.weight"][rows][:, r]
            out[p + f"attn.{name}.bias"] = sd[p + f"attn.{name}.bias"][rows]
        out[p + "attn.o.weight"] = sd[p + "attn.o.weight"][r][:, vo]
        out[p + "attn.o.bias"] = sd[p + "attn.o.bias"][r]
        out[p + "mlp.fc1.weight"] = sd[p + "mlp.fc1.weight"][ff][:, r]
        out[p + "mlp.fc1.bias"] = sd[p + "mlp.fc1.bias"][ff]
        out[p + "mlp.fc2.weight"] = sd[p + "mlp.fc2.weight"][r][:, ff]
        out[p + "mlp.fc2.bias"] = sd[p + "mlp.fc2.bias"][r]
    copy = from_preset(model_preset(model), **SMALL[model_preset(model)]).double()
    copy.load_state_dict(out)
    return copy


def model_preset(model) -> str:
    return "vit-tiny" if hasattr(model.config, "patch_size") else "gpt2-tiny"


@pytest.mark.parametrize("preset", sorted(SMALL))
def test_exact_transport_maps_a_planted_copy_back(preset):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    model = from_preset(preset, **SMALL[preset]).double().eval()
    copy = planted_copy(model, g).eval()
    x = _inputs(preset, g)
    assert torch.allclose(copy(x), model(x), atol=1e-10)  # the planted copy is the same function
    aligned, maps = ot_align(copy, model, OTFusion(reg=0.0))
    for k, v in model.state_dict().items():
        assert torch.allclose(aligned[k], v.double(), atol=1e-12), k
    for key, T in maps.items():  # every map a permutation (a 0/1 matrix with one 1 per row and column)
        assert torch.equal(T.round(), T) and torch.equal(T.sum(0), torch.ones(T.shape[1], dtype=T.dtype)), key
    fused = ot_fusion([model, copy], [1.0, 1.0], OTFusion(reg=0.0))
    assert torch.allclose(fused(x), model(x), atol=1e-9)


class Inputs:
    """A few server-side inputs, as fedlmc's data sets hand them out."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def batches(self, batch_size: int, shuffle: bool = False, generator=None):
        for i in range(0, len(self.x), batch_size):
            yield self.x[i : i + batch_size], None


@pytest.mark.parametrize("preset", sorted(SMALL))
def test_activation_costs_map_a_planted_copy_back_and_need_data(preset):
    """The activation-based variant: a planted copy's units have the model's activations, permuted, so
    exact transport on activation costs is the planted permutation again (every parameter back)."""
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(5)
    model = from_preset(preset, **SMALL[preset]).double().eval()
    copy = planted_copy(model, g).eval()
    data = Inputs(torch.cat([_inputs(preset, g) for _ in range(8)]))
    options = OTFusion(reg=0.0, cost="activations", data=data, samples=256)
    aligned, maps = ot_align(copy, model, options)
    for k, v in model.state_dict().items():
        assert torch.allclose(aligned[k], v.double(), atol=1e-12), k
    assert all(torch.equal(T.round(), T) for T in maps.values())
    soft = ot_fusion([model, copy], [1.0, 1.0], OTFusion(reg=0.06, cost="activations", data=data, samples=256))
    assert torch.isfinite(soft(data.x[:3])).all()
    with pytest.raises(ValueError, match="needs data"):
        ot_align(copy, model, OTFusion(cost="activations"))
    with pytest.raises(ValueError, match="OT fusion cost"):
        OTFusion(cost="gradients")


def test_sinkhorn_plans_have_the_marginals_and_sharpen_to_the_assignment():
    g = torch.Generator().manual_seed(3)
    cost = ground_cost(
        torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randn(12, 5, generator=g, dtype=torch.float64)
    )
    soft = transport(cost, reg=0.06)
    assert torch.allclose(soft.sum(1), torch.full((12,), 1 / 12, dtype=soft.dtype), atol=1e-8)
    assert torch.allclose(soft.sum(0), torch.full((12,), 1 / 12, dtype=soft.dtype), atol=1e-8)
    assert float((soft > 1e-3).sum()) > 12  # soft: mass spread over more than one partner per unit
    exact = transport(cost, reg=0.0)
    sharp = transport(cost, reg=1e-3, iterations=20000)
    assert torch.allclose(sharp, exact, atol=1e-3)
    assert float((exact * cost).sum()) <= float((soft * cost).sum()) + 1e-12  # the exact plan costs least


def test_soft_fusion_is_between_the_models_and_the_options_are_checked():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    model = from_preset("vit-tiny", **SMALL["vit-tiny"]).double().eval()
    copy = planted_copy(model, g).eval()
    fused = ot_fusion([model, copy], [3.0, 1.0], OTFusion(reg=0.06))
    x = _inputs("vit-tiny", g)
    assert torch.isfinite(fused(x)).all()
    with pytest.raises(ValueError, match="residual policy"):
        OTFusion(residual_policy="max")
    for other in ("llama-tiny", "neox-tiny"):  # rotary positions, no position table: refused up front
        with pytest.raises(ValueError, match="GPT-2 and ViT"):
            ot_align(from_preset(other, n_layer=1, d_model=16, n_head=2, d_ff=32, vocab_size=11, block_size=8), model)


@pytest.mark.usefixtures("task_identity")
def test_the_registered_strategy_fuses_the_replies_beside_the_others(tmp_path):
    import json

    from test_flower_contract import Grid

    from fedlmc.federated import Settings
    from server.app import write_json
    from server.comparison import run_comparison

    run = {"preset": "vit-digits", "out-dir": str(tmp_path), "eval-batches": 2, "guard": False}
    s = Settings.from_run_config({**run, "strategy": "average,permuted,ot-fusion"})
    doc = run_comparison(Grid(nodes=3, step=0.3), s, write_json)
    records = json.loads((tmp_path / "metrics.json").read_text())["comparison"]
    assert records["ot-fusion"]["kept"] == "ot-fusion" and records["ot-fusion"]["align_seconds"] > 0
    assert set(doc["strategies"]) == {"average", "permuted", "ot-fusion"}
