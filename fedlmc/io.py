"""Checkpoints: safetensors weights + a JSON config (and free-form metadata). Never pickle."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from fedlmc.models import from_config

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def save(model: nn.Module, path: Union[str, Path], meta: Optional[dict[str, Any]] = None) -> Path:
    """Write ``path/model.safetensors`` and ``path/config.json`` (config + ``meta``); atomic per file."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    tmp = path / (WEIGHTS + ".tmp")
    save_file(sd, str(tmp))
    os.replace(tmp, path / WEIGHTS)
    doc = {"config": model.config.to_dict(), "meta": meta or getattr(model, "meta", {})}
    tmp = path / (CONFIG + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, path / CONFIG)
    return path


def read_meta(path: Union[str, Path]) -> dict[str, Any]:
    """The metadata stored beside a checkpoint."""
    return json.loads((Path(path) / CONFIG).read_text()).get("meta", {})


def load(path: Union[str, Path], device: Union[str, torch.device, None] = None) -> nn.Module:
    """Load a checkpoint written by ``save``; the model carries ``.config`` and ``.meta``."""
    path = Path(path)
    if not (path / WEIGHTS).is_file() or not (path / CONFIG).is_file():
        raise FileNotFoundError(f"{path} is not a fedlmc checkpoint (expected {WEIGHTS} and {CONFIG} in it)")
    doc = json.loads((path / CONFIG).read_text())
    model = from_config(doc["config"])
    sd = load_file(str(path / WEIGHTS))
    dtype = next(iter(sd.values())).dtype
    model.to(dtype=dtype).load_state_dict(sd)
    model.meta = doc.get("meta", {})
    return model.to(device) if device is not None else model
