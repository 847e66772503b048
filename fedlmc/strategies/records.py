"""Between Flower records and fedlmc models: a reply's weights + its model config → a model."""

from __future__ import annotations

import json
from typing import Any, Optional

import torch
import torch.nn as nn
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedlmc.models import from_config

MODEL_KEY = "model"  # reply RecordDict key: a ConfigRecord {"config": <json of TransformerConfig.to_dict()>, ...}
MODEL_CONFIG_KEY = "model-config"  # key in the train/evaluate ConfigRecord: the config of the arrays sent


def state_arrays(model: nn.Module) -> ArrayRecord:
    """A model's weights as an ArrayRecord (float32, CPU)."""
    return ArrayRecord(torch_state_dict={k: v.detach().cpu().float() for k, v in model.state_dict().items()})


def config_record(model: nn.Module) -> ConfigRecord:
    """The ConfigRecord a client attaches to its reply so the server knows architecture and width."""
    cfg = model.config
    return ConfigRecord({"config": json.dumps(cfg.to_dict()), "d-model": int(cfg.d_model), "arch": cfg.arch})


def model_from_arrays(arrays: ArrayRecord, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> nn.Module:
    """A fedlmc model of ``config`` holding ``arrays`` (strict: missing or extra keys are an error)."""
    model = from_config(config).to(dtype)
    model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
    return model.eval()


def reply_config(content: RecordDict, default: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The model config a reply declares (its ``model`` ConfigRecord), else ``default``."""
    rec = content.get(MODEL_KEY) if hasattr(content, "get") else None
    if rec is not None and "config" in rec:
        return json.loads(str(rec["config"]))
    if default is None:
        raise ValueError("reply carries no model config and the strategy was given none (model=...)")
    return default
