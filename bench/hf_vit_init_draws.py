"""bench/hf_vit_init_draws.py: is HF ViT's weaker weight matching on seeds 0-2 the Hugging Face
initialisation or the draws? Fresh seeds 3-6, all six pairs each, fedlmc's forward and trainer
throughout (the preset's budget); the initial weights come from fedlmc (``model_for_data``) or from
Hugging Face (an untrained ``ViTForImageClassification``, converted exactly with ``from_hf``).
Writes results/bench_hf_vit_init_draws.json (vanilla and weight-matching barriers per pair).

    python bench/hf_vit_init_draws.py [--seeds 3 4 5 6]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from hf_pairs import hf_model  # noqa: E402

from fedlmc import io  # noqa: E402
from fedlmc.data import load  # noqa: E402
from fedlmc.hf import from_hf  # noqa: E402
from fedlmc.reproduce import pair_curves  # noqa: E402
from fedlmc.train import model_for_data, train, train_config_for  # noqa: E402


def trained(init: str, splits, seed: int, cache: Path):
    path = cache / f"fvit-{init}init-s{seed}"
    try:
        return io.load(path).eval()
    except FileNotFoundError:
        pass
    m = model_for_data("vit-tiny", splits, seed) if init == "fedlmc" else from_hf(hf_model("vit", splits, seed))
    m.train()
    for p in m.parameters():
        p.requires_grad_(True)
    train(m, splits.train, train_config_for("vit-tiny", seed), val=splits.val, progress=False)
    io.save(m, path)
    return m.eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[3, 4, 5, 6])
    p.add_argument("--cache", default=str(ROOT / "runs" / "cache"))
    args = p.parse_args()
    torch.set_num_threads(1)
    splits = load("mnist")
    out: dict[str, dict] = {}
    for init in ("fedlmc", "hf"):
        ms = {s: trained(init, splits, s, Path(args.cache)) for s in args.seeds}
        ratios = []
        for i, j in itertools.combinations(args.seeds, 2):
            c = pair_curves(ms[i], ms[j], splits, ["vanilla", "wm-orth-factored"], progress=False)
            b = {k: v["barrier"] for k, v in c.items()}
            ratios.append(b["wm-orth-factored"] / b["vanilla"])
            out[f"{init} {i}-{j}"] = {**b, "ratio": ratios[-1]}
            print(init, i, j, b, f"ratio {ratios[-1]:.3f}", flush=True)
        out[f"{init} summary"] = {"mean": statistics.mean(ratios), "median": statistics.median(ratios)}
    (ROOT / "results" / "bench_hf_vit_init_draws.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
