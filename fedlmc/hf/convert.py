"""Exact conversions between Hugging Face models and fedlmc models (see ``fedlmc.hf``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from fedlmc.hf.families import FAMILIES, HF_TYPES, StateDict
from fedlmc.hf.head import fit_head
from fedlmc.models import from_config
from fedlmc.models.layers import TransformerConfig


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - the dependency is declared
        raise ImportError("fedlmc.hf needs the `transformers` package: pip install 'fedlmc[hf]'") from e
    return transformers


def family_of(hf_config: Any):
    """The fedlmc family of a ``transformers`` config (clear error for others)."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in HF_TYPES:
        raise ValueError(
            f"Hugging Face model_type {kind!r} is not supported; fedlmc converts "
            f"{', '.join(f.model_class for f in FAMILIES.values())} (or describe your own model: "
            "fedlmc.symmetry.register_spec)"
        )
    return FAMILIES[HF_TYPES[kind]]


def is_tied(hf_config: Any) -> bool:
    """Whether a Hugging Face model of this config ties its output head to its input embedding."""
    fam = family_of(hf_config)
    return bool(fam.embeddings) and bool(getattr(hf_config, "tie_word_embeddings", False))


def load_hf(model_or_dir: Union[nn.Module, str, Path]) -> nn.Module:
    """A ``transformers`` model, or one loaded from a local ``save_pretrained`` directory (no hub)."""
    if isinstance(model_or_dir, nn.Module):
        return model_or_dir
    tf = _transformers()
    path = Path(model_or_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a save_pretrained directory (fedlmc never downloads models)")
    config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    cls = getattr(tf, family_of(config).model_class)
    return cls.from_pretrained(path, local_files_only=True)


def from_hf(model_or_dir: Union[nn.Module, str, Path]) -> nn.Module:
    """A fedlmc model computing the same function as a ``transformers`` GPT-2, ViT or Llama-style model
    (or a local ``save_pretrained`` directory), in the source's dtype."""
    hf = load_hf(model_or_dir)
    fam = family_of(hf.config)
    model = fedlmc_model(fam, fam.config_from_hf(hf.config), {k: v.detach() for k, v in hf.state_dict().items()})
    model.meta = {**getattr(model, "meta", {}), "hf_family": fam.name}  # to_hf writes this family back
    return model


def fedlmc_model(fam, cfg: TransformerConfig, hf_sd: StateDict, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The fedlmc model of config ``cfg`` holding a Hugging Face state dict of family ``fam`` (in
    ``dtype``, default the state's own), built without a random initialisation."""
    sd = fam.state_from_hf(hf_sd, cfg)
    with torch.device("meta"):
        model = from_config(cfg)
    model.load_state_dict({k: v.to(dtype) if dtype else v for k, v in sd.items()}, assign=True)
    return model.eval()


def hf_state(model: nn.Module, tied: bool = False, family: Optional[str] = None) -> tuple[StateDict, float]:
    """A fedlmc model's weights under Hugging Face's keys (``family``: the Hugging Face family to write,
    default the one of the model's architecture; ``"opt"`` for a GPT-2-architecture model), and the head
    fit's relative error (see ``head.fit_head``; 0 when the head needed no fitting). LayerNorm families
    need the LayerNorm form."""
    cfg = model.config
    if cfg.arch in ("gpt2", "vit", "neox") and cfg.norm != "layernorm":
        raise ValueError(
            "Hugging Face GPT-2, ViT, OPT and GPT-NeoX hold LayerNorm models: "
            "convert with fedlmc.symmetry.to_layernorm first"
        )
    fam = _family(cfg, family)
    sd, error = fit_head(
        {k: v.detach() for k, v in model.state_dict().items()},
        cfg,
        tied,
        embedding="tok_emb.weight" if fam.embeddings else None,
    )
    return fam.state_to_hf(sd, cfg), error


def _family(cfg: TransformerConfig, family: Optional[str]):
    """The Hugging Face family to write a config as: ``family`` when given (one holding the config's
    architecture), else its architecture's."""
    if family is None and cfg.arch not in FAMILIES:
        raise ValueError(f"no Hugging Face class for fedlmc architecture {cfg.arch!r}")
    if family is not None and family not in FAMILIES:
        raise ValueError(f"no Hugging Face family {family!r}; known: {', '.join(FAMILIES)}")
    fam = FAMILIES[family or cfg.arch]
    if fam.arch != cfg.arch:
        raise ValueError(f"Hugging Face family {fam.name!r} holds fedlmc's {fam.arch!r} models, not {cfg.arch!r}")
    return fam


def to_hf(model: nn.Module, tied: Optional[bool] = None, family: Optional[str] = None):
    """The ``transformers`` model (``GPT2LMHeadModel``, ``ViTForImageClassification``, ``LlamaForCausalLM``, ...)
    of a fedlmc model of one of those families. ``tied``: tie the head to the embedding (default: when
    they are equal, as for a tied model that came from ``from_hf``); a tied head that differs from the
    embedding is fitted (``head.fit_head``), and the fit's error is stored as ``model.fedlmc_fit_error``.
    ``family``: another Hugging Face family of the same architecture (``"opt"``: ``OPTForCausalLM``;
    default the one ``from_hf`` read the model from, kept in ``model.meta``, else the architecture's)."""
    cfg = model.config
    family = family or getattr(model, "meta", {}).get("hf_family")
    fam = _family(cfg, family)
    sd = model.state_dict()
    if tied is None:
        tied = (
            bool(fam.embeddings)
            and torch.equal(sd["head.weight"], sd["tok_emb.weight"])
            and ("head.bias" not in sd or not sd["head.bias"].any())
        )
    hf_sd, error = hf_state(model, tied, family)
    tf = _transformers()
    ref = next(model.parameters())
    hf = getattr(tf, fam.model_class)(fam.config_to_hf(cfg, tied)).to(ref.dtype)
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    if unexpected or [k for k in missing if not (tied and k == "lm_head.weight")]:
        raise RuntimeError(f"conversion bug: missing {missing}, unexpected {unexpected}")
    hf.fedlmc_fit_error = error
    return hf.eval()


def hf_model_for(
    cfg: TransformerConfig, seed: Optional[int] = None, tied: Optional[bool] = None, family: Optional[str] = None
) -> nn.Module:
    """A fresh ``transformers`` model of a fedlmc config's shape, with Hugging Face's own initialisation
    (seeded when ``seed`` is given). ``tied`` defaults to the family's usual choice (GPT-2 and OPT tie
    their head). ``family``: another Hugging Face family of the same architecture, as in ``to_hf``
    (``"opt"``: ``OPTForCausalLM`` for a GPT-2 config)."""
    fam = _family(cfg, family)
    tied = (cfg.arch == "gpt2") if tied is None else tied
    if seed is not None:
        torch.manual_seed(seed)
    return getattr(_transformers(), fam.model_class)(fam.config_to_hf(cfg, tied))


class Logits(nn.Module):
    """A ``transformers`` model as fedlmc's trainer and evaluator see models: inputs → logits (token ids
    go in as ``input_ids``, images as ``pixel_values``)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.hf(pixel_values=x) if x.is_floating_point() else self.hf(input_ids=x)
        return out.logits


def config_of(model: Any) -> TransformerConfig:
    """The fedlmc config of a fedlmc model, a ``transformers`` model or a ``transformers`` config."""
    cfg = getattr(model, "config", model)
    if isinstance(cfg, TransformerConfig):
        return cfg
    return family_of(cfg).config_from_hf(cfg)
