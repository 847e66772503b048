"""bench/hf_vit_diagnostics.py: two checks behind the README's HF ViT weight-matching paragraph.

``steps``: one HF ViT initial state trained through Hugging Face's forward and through fedlmc's (the
same trainer and data order) for 1, 10, 100, 400 steps; the relative distance of the results.
``objective``: on HF pair (0, 1) (run ``bench/hf_pairs.py --family vit`` first), weight matching's
objective at its own answer and at learned matching's, and a descent started from the learned one.

    python bench/hf_vit_diagnostics.py steps|objective
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from hf_pairs import hf_model  # noqa: E402

from fedlmc.averaging import interpolate  # noqa: E402
from fedlmc.data import load  # noqa: E402
from fedlmc.hf import Logits, from_hf  # noqa: E402
from fedlmc.matching.learned import learned_matching  # noqa: E402
from fedlmc.matching.weight import Problem, canonical_state, weight_matching  # noqa: E402
from fedlmc.symmetry import apply_transform, canonical_config  # noqa: E402
from fedlmc.train import evaluate, train, train_config_for  # noqa: E402


def steps(splits) -> None:
    for n in (1, 10, 100, 400):
        hf = hf_model("vit", splits, 0)
        ours = from_hf(copy.deepcopy(hf)).train()
        for p in ours.parameters():
            p.requires_grad_(True)
        cfg = train_config_for("vit-tiny", 0, steps=n, epochs=None)
        train(Logits(hf), splits.train, cfg, progress=False)
        train(ours, splits.train, cfg, progress=False)
        sx, sy = ours.state_dict(), from_hf(hf).state_dict()
        dist = sum((sx[k] - sy[k]).pow(2).sum() for k in sx) ** 0.5 / sum(v.pow(2).sum() for v in sy.values()) ** 0.5
        print(f"{n} steps: relative distance {float(dist):.3g}", flush=True)


def objective(splits) -> None:
    a, b = (from_hf(ROOT / "runs" / "cache" / f"hf-vit-s{s}-preset") for s in (0, 1))

    def mid(T) -> float:
        return evaluate(interpolate(a, apply_transform(b, T.to(dtype=torch.float32)), 0.5, form="factored"), splits.test)["loss"]

    T = weight_matching(a, b)
    TL = learned_matching(a, b, splits.train, start=T, steps=300, progress=False)
    A, B = (canonical_state(m, torch.device("cpu"), torch.float64) for m in (a, b))
    P = Problem(A, B, canonical_config(b.config))
    at_learned = P.objective({k: v.double() if v.is_floating_point() else v for k, v in TL.elements.items()})
    TW = weight_matching(a, b, start=TL, starts="paper")
    print(f"weight matching: objective {T.info['objective']}, midpoint {mid(T):.4f}")
    print(f"learned: objective {at_learned:.2f}, midpoint {mid(TL):.4f}")
    print(f"descent from learned: objective {TW.info['objective']}, midpoint {mid(TW):.4f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"steps": steps, "objective": objective}[sys.argv[1]](load("mnist"))
