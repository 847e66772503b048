"""The spec is the only source of structure: GPT-2 and ViT with the same mathematics but other
parameter and module names (registered with ``register_architecture`` + ``register_spec``) go through
canonicalisation, weight matching, learned matching, a mixed-width universe merge and one
``AlignedFedAvg`` round, with the same results as under fedlmc's own names."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from conftest import inputs_for, perturbed
from flwr.app import ArrayRecord
from test_exact_learned import _data
from test_strategies import _reply

from fedlmc.matching import learned_matching, weight_matching
from fedlmc.merging.universe import universe_merge
from fedlmc.models import GPT2, GPT2Config, ViT, ViTConfig, register_architecture
from fedlmc.options import Learning, Universe
from fedlmc.strategies import AlignedFedAvg
from fedlmc.strategies.records import model_from_arrays
from fedlmc.symmetry import apply_transform, canonicalize, register_spec, spec_for

# every module / parameter name component of ours → the other architecture's
NAMES = {
    "blocks": "layers",
    "attn": "mixer",
    "q": "wq",
    "k": "wk",
    "v": "wv",
    "o": "wo",
    "mlp": "ffn",
    "fc1": "up",
    "fc2": "down",
    "ln1": "pre_mixer_norm",
    "ln2": "pre_ffn_norm",
    "ln_f": "final_norm",
    "head": "readout",
    "tok_emb": "embed",
    "pos_emb": "positions",
    "patch_emb": "patchify",
    "cls_token": "cls",
}


def rename(name: str) -> str:
    return ".".join(NAMES.get(part, part) for part in name.split("."))


def _rename_tree(model: nn.Module) -> None:
    """Move every renamed child module / parameter to its new name; the inherited forward code still
    finds it under the old one through a read-only property (so the maths is untouched)."""
    for module in list(model.modules()):
        moved = {old: new for old, new in NAMES.items() if old in module._modules or old in module._parameters}
        if not moved:
            continue
        for old, new in moved.items():
            store = module._modules if old in module._modules else module._parameters
            store[new] = store.pop(old)
        props = {
            old: property(lambda self, new=new: self._modules[new] if new in self._modules else self._parameters[new])
            for old, new in moved.items()
        }
        module.__class__ = type(f"Renamed{type(module).__name__}", (type(module),), props)


@dataclass
class OtherGPT2Config(GPT2Config):
    arch = "other-gpt2"


@dataclass
class OtherViTConfig(ViTConfig):
    arch = "other-vit"


class OtherGPT2(GPT2):
    def __init__(self, config):
        super().__init__(config)
        _rename_tree(self)


class OtherViT(ViT):
    def __init__(self, config):
        super().__init__(config)
        _rename_tree(self)


register_architecture("other-gpt2", OtherGPT2Config, OtherGPT2)
register_architecture("other-vit", OtherViTConfig, OtherViT)
register_spec("other-gpt2", lambda cfg: spec_for(GPT2Config(**_fields(cfg))).renamed(rename, "other-gpt2"))
register_spec("other-vit", lambda cfg: spec_for(ViTConfig(**_fields(cfg))).renamed(rename, "other-vit"))
OTHER = {"gpt2": (OtherGPT2Config, OtherGPT2), "vit": (OtherViTConfig, OtherViT)}
SHAPE = {"gpt2": dict(vocab_size=20, block_size=16), "vit": dict(image_size=12, patch_size=4)}


def _fields(cfg) -> dict:
    return {k: v for k, v in cfg.to_dict().items() if k != "arch"}


def make_pair(arch: str, seed: int, **shape):
    """The same random model under both namings (ours, other), float64."""
    torch.manual_seed(seed)
    ours_cls, ours_model = (GPT2Config, GPT2) if arch == "gpt2" else (ViTConfig, ViT)
    cfg = ours_cls(**{"n_layer": 2, "d_model": 32, "n_head": 4, "d_ff": 64, **SHAPE[arch], **shape})
    ours = perturbed(ours_model(cfg), seed, 0.2)
    other = OTHER[arch][1](OTHER[arch][0](**_fields(cfg))).double().eval()
    other.load_state_dict({rename(k): v for k, v in ours.state_dict().items()})
    return ours, other


def same(ours: torch.Tensor | dict, other, what: str, tol: float = 1e-6) -> None:
    if isinstance(ours, dict):
        assert {rename(k) for k in ours} == set(other), what
        for k, v in ours.items():
            same(v, other[rename(k)], f"{what}: {k}", tol)
        return
    ours, other = ours.detach(), other.detach()
    err = float((ours.double() - other.double()).abs().max()) if ours.numel() else 0.0
    assert err <= tol * max(1.0, float(ours.double().abs().max())), f"{what}: {err:.3e}"


def same_transform(T1, T2, what: str) -> None:
    assert set(T1.elements) == set(T2.elements), what
    for k in T1.elements:
        same(T1[k], T2[k], f"{what} {k}")


@pytest.mark.parametrize("arch", ["gpt2", "vit"])
def test_other_names_go_through_every_path(arch):
    A, A2 = make_pair(arch, 0)
    B, B2 = make_pair(arch, 1)
    assert not set(A.state_dict()) & set(A2.state_dict())  # no parameter name in common
    x = inputs_for(A)
    same(A(x), A2(x), "forward")
    same(canonicalize(A).state_dict(), canonicalize(A2).state_dict(), "canonical form")
    T, T2 = weight_matching(A, B), weight_matching(A2, B2)
    same_transform(T, T2, "weight matching")
    same(apply_transform(B, T)(x), apply_transform(B2, T2)(x), "aligned B")
    L = learned_matching(A, B, _data(A), T, Learning(steps=5), progress=False)
    L2 = learned_matching(A2, B2, _data(A), T2, Learning(steps=5), progress=False)  # the same batches
    same_transform(L, L2, "learned matching")
    # a universe of mixed widths: two full models and a narrow one
    C, C2 = make_pair(arch, 2, d_model=16, n_head=2, d_ff=40, d_head=8)
    U, Ts = universe_merge([A, B, C], universe=Universe(iterations=2, keep_layernorm=False))
    U2, Ts2 = universe_merge([A2, B2, C2], universe=Universe(iterations=2, keep_layernorm=False))
    same(U.state_dict(), U2.state_dict(), "mixed-width universe")
    for i, (t1, t2) in enumerate(zip(Ts, Ts2)):
        same_transform(t1, t2, f"universe transform {i}")
        assert t1.width_map.shape == t2.width_map.shape and t2.width_map.client.arch == f"other-{arch}"


@pytest.mark.parametrize("arch", ["gpt2", "vit"])
def test_other_names_in_an_aligned_fedavg_round(arch):
    (A, A2), (B, B2), (C, C2) = (make_pair(arch, s) for s in range(3))
    results = []
    for models in ([A, B, C], [A2, B2, C2]):
        models = [m.float() for m in models]
        strategy = AlignedFedAvg(model=models[0].config.to_dict())
        strategy._previous = ArrayRecord(torch_state_dict=models[0].state_dict())
        arrays, _ = strategy.aggregate_train(1, [_reply(m, 10 * (i + 1), node=i + 1) for i, m in enumerate(models)])
        assert strategy.history[-1]["excluded"] == []
        results.append(model_from_arrays(arrays, strategy.global_config).state_dict())
        assert json.loads(json.dumps(strategy.global_config))["arch"] == models[0].config.arch
    same(results[0], results[1], "AlignedFedAvg round", tol=1e-5)
