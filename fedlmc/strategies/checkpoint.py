"""Crash-safe server state: after every round the global model and all strategy state are written to
``<out-dir>/state`` (safetensors + JSON, never pickle), atomically: a new directory is written beside
the old one and swapped in by renames, so a crash at any moment leaves one complete state behind.

Saved: the round number, the global arrays and their config, the strategy's per-round history, the
per-client alignment state (``HeteroWidthFedAvg``'s transform of every node into the universe), the
metrics document, and the server's RNG states (torch, Python).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from flwr.app import ArrayRecord
from safetensors.torch import load_file, save_file

from fedlmc.symmetry import Transform, WidthMap

GLOBAL, TRANSFORMS, STATE = "global.safetensors", "transforms.safetensors", "state.json"


@dataclass
class ServerState:
    round: int
    arrays: ArrayRecord
    global_config: Optional[dict[str, Any]]
    history: list[dict[str, Any]]
    metrics: dict[str, Any]
    transforms: dict[int, Transform] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # the rest of the strategy's ``state()`` (JSON)


def save_state(path: Path, server_round: int, arrays: ArrayRecord, strategy, metrics: dict[str, Any]) -> Path:
    """Write the state after ``server_round`` to ``path`` (a directory), atomically."""
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in arrays.to_torch_state_dict().items()}, str(tmp / GLOBAL))
    tensors, infos = {}, {}
    kept = strategy.state()
    for node, T in kept["transforms"].items():
        for name, el in T.elements.items():
            tensors[f"{node}/{name}"] = el.detach().cpu().contiguous()
        infos[str(node)] = T.width_map.to_dict() if T.width_map is not None else None
    if tensors:
        save_file(tensors, str(tmp / TRANSFORMS))
    save_file({"torch_rng": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    extra = {k: v for k, v in kept.items() if k not in ("global_config", "history", "transforms")}
    doc = {
        "round": server_round,
        "global_config": kept["global_config"],
        "history": kept["history"],
        "transform_info": infos,
        "metrics": metrics,
        "python_random": _py_state(),
        "strategy": extra,
    }
    (tmp / STATE).write_text(json.dumps(doc, default=float))
    for f in tmp.iterdir():  # make the files durable before the swap
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def _py_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def load_state(path: Path) -> Optional[ServerState]:
    """The last complete state under ``path`` (or the previous one, if a crash hit mid-swap); None if none."""
    path = Path(path)
    for cand in (path, path.with_name(path.name + ".old")):
        if (cand / STATE).is_file() and (cand / GLOBAL).is_file():
            break
    else:
        return None
    doc = json.loads((cand / STATE).read_text())
    arrays = ArrayRecord(torch_state_dict=load_file(str(cand / GLOBAL)))
    transforms: dict[int, Transform] = {}
    if (cand / TRANSFORMS).is_file():
        for key, t in load_file(str(cand / TRANSFORMS)).items():
            node, name = key.split("/", 1)
            wm = doc["transform_info"].get(node)
            transforms.setdefault(int(node), Transform({}, {}, WidthMap.from_dict(wm) if wm else None))
            transforms[int(node)].elements[name] = t
    if (cand / "rng.safetensors").is_file():
        torch.set_rng_state(load_file(str(cand / "rng.safetensors"))["torch_rng"])
    if doc.get("python_random"):
        v, internal, gauss = doc["python_random"]
        random.setstate((v, tuple(internal), gauss))
    return ServerState(
        doc["round"],
        arrays,
        doc.get("global_config"),
        doc.get("history", []),
        doc.get("metrics", {}),
        transforms,
        doc.get("strategy") or {},
    )
