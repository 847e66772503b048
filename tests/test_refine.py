"""Dirichlet learned refinement of a universe."""

from __future__ import annotations

import pytest
import torch
from test_universe import _base, _noisy

from fedlmc.data.base import ArrayData
from fedlmc.merging.universe import universe_merge
from fedlmc.options import Refinement, Universe
from fedlmc.symmetry import apply_transform, random_transform
from fedlmc.train import evaluate


def _data(model, n=256):
    g = torch.Generator().manual_seed(5)
    cfg = model.config
    x = torch.randn(n, cfg.channels, cfg.image_size, cfg.image_size, generator=g)
    with torch.no_grad():
        y = model.float()(x).argmax(-1)  # the base model's own labels: it is the optimum
    model.double()
    return ArrayData(x, y)


def test_refine_keeps_a_planted_universe(record):
    base = _base()
    data = _data(base)
    copies = [
        _noisy(apply_transform(base, random_transform(base, seed=s, groups=["residual", "heads", "ff"])), 1e-3, s)
        for s in range(3)
    ]
    wm, _ = universe_merge(copies, universe=Universe(iterations=2, keep_layernorm=False))
    refined, Ts = universe_merge(
        copies,
        refine=Refinement(data=data, steps=15, alpha=0.1, check_every=0),
        universe=Universe(iterations=2, keep_layernorm=False),
    )
    assert len(Ts) == 3 and len(Ts[1].info["loss"]) == 15
    for T in Ts:
        O = T["residual"]
        record("refined O is orthogonal", float((O.T @ O - torch.eye(O.shape[0], dtype=O.dtype)).abs().max()), 1e-5)
        for k, v in T.elements.items():
            if k.startswith(("heads", "ff")):
                assert sorted(v.tolist()) == list(range(len(v)))
    l_base = evaluate(base.float(), data)["loss"]
    l_ref = evaluate(refined.float(), data)["loss"]
    l_wm = evaluate(wm.float(), data)["loss"]
    record("planted universe, refined loss − base loss", l_ref - l_base, 0.05)
    assert l_ref <= l_wm + 0.05


def test_refine_needs_data():
    base = _base()
    with pytest.raises(ValueError, match="needs data"):
        universe_merge([base, base], refine=Refinement(), universe=Universe(iterations=5, keep_layernorm=False))
