"""Models and presets. ``from_preset(name, **overrides)`` builds a model carrying its ``.config``."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fedlmc.models.gpt2 import GPT2, GPT2Config
from fedlmc.models.layers import RMSNorm, TransformerConfig
from fedlmc.models.llama import Llama, LlamaConfig
from fedlmc.models.neox import NeoX, NeoXConfig
from fedlmc.models.vit import ViT, ViTConfig

# name -> (config class, fields, default dataset). Tiny presets train in minutes on 2 CPU cores.
PRESETS: dict[str, tuple[type, dict[str, Any], str]] = {
    "gpt2-tiny": (GPT2Config, dict(n_layer=4, d_model=128, n_head=4, d_ff=512, block_size=64), "shakespeare"),
    "gpt2-shakespeare": (GPT2Config, dict(n_layer=6, d_model=256, n_head=4, d_ff=1024, block_size=128), "shakespeare"),
    "llama-tiny": (
        LlamaConfig,
        dict(n_layer=4, d_model=128, n_head=4, n_kv_head=2, d_ff=344, block_size=64),
        "shakespeare",
    ),
    "gpt2-small": (
        GPT2Config,
        dict(n_layer=12, d_model=768, n_head=12, d_ff=3072, vocab_size=50257, block_size=1024),
        "shakespeare",
    ),
    # GPT-NeoX (Pythia) shape: parallel attention and FF, a quarter of each head rotary
    "neox-tiny": (NeoXConfig, dict(n_layer=4, d_model=128, n_head=4, d_ff=512, block_size=64), "shakespeare"),
    "vit-tiny": (ViTConfig, dict(n_layer=4, d_model=64, n_head=4, d_ff=128, image_size=28, patch_size=7), "mnist"),
    "vit-cifar": (
        ViTConfig,
        dict(n_layer=6, d_model=256, n_head=8, d_ff=512, image_size=32, patch_size=4, channels=3),
        "cifar10",
    ),
    "vit-digits": (ViTConfig, dict(n_layer=2, d_model=32, n_head=4, d_ff=64, image_size=8, patch_size=2), "digits"),
}
# ReLU twins of the tiny presets (OPT's nonlinearity), where rescaling an FF neuron is a symmetry too
PRESETS["gpt2-tiny-relu"] = (GPT2Config, {**PRESETS["gpt2-tiny"][1], "activation": "relu"}, "shakespeare")
PRESETS["vit-tiny-relu"] = (ViTConfig, {**PRESETS["vit-tiny"][1], "activation": "relu"}, "mnist")

ARCHS: dict[str, tuple[type, type]] = {
    "gpt2": (GPT2Config, GPT2),
    "vit": (ViTConfig, ViT),
    "llama": (LlamaConfig, Llama),
    "neox": (NeoXConfig, NeoX),
}


def register_architecture(arch: str, config_cls: type, model_cls: type) -> None:
    """Make ``from_config`` build ``model_cls`` for configs whose ``arch`` is ``arch`` (a user's own
    Transformer; describe its symmetries with ``fedlmc.symmetry.register_spec`` too)."""
    ARCHS[arch] = (config_cls, model_cls)


def preset_config(name: str, **overrides: Any) -> TransformerConfig:
    """The config of preset ``name`` with ``overrides`` applied (e.g. ``d_model=64``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cls, fields_, _ = PRESETS[name]
    return cls(**{**fields_, **overrides})


def preset_dataset(name: str) -> str:
    """The dataset a preset trains on by default (``mnist``, ``digits``, ``cifar10``, ``shakespeare``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name][2]


def from_config(config: TransformerConfig | dict[str, Any]) -> nn.Module:
    """Build a fresh model from a config object or its ``to_dict()`` form."""
    if isinstance(config, dict):
        arch = config.get("arch")
        if arch not in ARCHS:
            raise ValueError(f"unknown architecture {arch!r} in config; expected one of {list(ARCHS)}")
        config = ARCHS[arch][0].from_dict(config)
    return ARCHS[config.arch][1](config)


def from_preset(name: str, **overrides: Any) -> nn.Module:
    """Build preset ``name`` (see ``PRESETS``); keyword overrides change config fields."""
    return from_config(preset_config(name, **overrides))


__all__ = [
    "GPT2",
    "GPT2Config",
    "Llama",
    "LlamaConfig",
    "NeoX",
    "NeoXConfig",
    "ViT",
    "ViTConfig",
    "RMSNorm",
    "TransformerConfig",
    "PRESETS",
    "from_preset",
    "from_config",
    "preset_config",
    "preset_dataset",
    "register_architecture",
]
