"""What the barrier benches share: the command-line options for which models to use, and those models
(a preset at another width and training budget, trained once per seed and cached)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch

from fedlmc.commands import trained
from fedlmc.models import preset_config


def width_arch(preset: str, width: Optional[int]) -> Optional[dict]:
    """The preset's architecture at residual width ``width`` (d_ff scaled with it; heads keep their count)."""
    if not width:
        return None
    base = preset_config(preset)
    return {"d_model": width, "d_ff": base.d_ff * width // base.d_model}


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train-steps", type=int, help="training steps per model (default: the preset's budget)")
    p.add_argument("--width", type=int, help="d_model (d_ff scaled with it, as simulations/width_study.py)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--cache", default="runs/cache")
    p.add_argument("--out", default="results")


def trained_models(args: argparse.Namespace, seeds, splits) -> tuple[dict, dict]:
    """``{seed: model}`` for ``args.preset`` at ``args.width`` trained ``args.train_steps`` (cached), and
    the budget overrides used."""
    over = {"steps": args.train_steps} if args.train_steps else {}
    arch = width_arch(args.preset, args.width)
    return {
        s: trained(args.preset, s, splits, Path(args.cache), progress=False, model_overrides=arch, **over)
        for s in seeds
    }, over


def models_record(args: argparse.Namespace, over: dict) -> dict:
    """What a barrier bench's JSON says about its models: preset, width and training budget."""
    return {"preset": args.preset, "width": args.width, "budget": over}


def results_path(args: argparse.Namespace, stem: str) -> Path:
    """``{out}/{stem}_{preset}[_w{width}].json``: one results file per preset and width."""
    tag = f"_w{args.width}" if args.width else ""
    return Path(args.out) / f"{stem}_{args.preset}{tag}.json"
