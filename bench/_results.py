"""What the speed benches write beside their figures: where they ran (device, torch threads, CPU,
torch version), and the JSON file itself."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from fedlmc.train import pick_device


def environment() -> dict:
    """The device a fedlmc path picks here, torch's threads, the machine and processor, torch's version."""
    return {
        "device": str(pick_device()),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "torch": torch.__version__,
    }


def write_results(path: str | Path, res: dict) -> Path:
    """Write ``res`` as indented JSON to ``path`` (its folder made if needed); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")
    return out
