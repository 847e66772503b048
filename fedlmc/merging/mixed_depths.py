"""One merge of clients of different depths: each shallow model placed among the deepest model's
layers (``depths.match_layers``), padded there with identity blocks, aligned to a universe of the full
depth by weight matching, and averaged block by block over the clients that hold a real block there.

Clients may differ in width too: the depth-padded models then join one shape as ``universe_merge``'s do
(zero-padded units, masked out of the averages; a rectangular residual map each). The universe starts
as the deepest client (the widest, then the heaviest, if several). Each iteration aligns every
padded client to it (``weight_matching``, identity blocks included: they are zero, so they do not pull
the residual map) and re-averages: a parameter of block ``l`` is the weighted mean over the clients
whose block ``l`` is real (``padding="skip"``, the default), or over every client, identity padding
counted as zeros (``padding="zeros"``, the naive recipe, kept for comparison). Parameters outside the
blocks (embeddings, final norm, head) are averaged over all. Each client gets back a model of its own
depth and width: the universe mapped back by its transform's inverse (``universe.project``), without the blocks
that were padding for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn

from fedlmc.matching import weight_matching
from fedlmc.merging.averaging import aligned_state, unit_weighted, weighted_state
from fedlmc.merging.depths import LayerMatch, match_layers, pad_to_depth, remove_blocks
from fedlmc.merging.universe import members, project
from fedlmc.options import Matching, one_of
from fedlmc.symmetry import Transform, canonicalize, rebuild

PADDINGS = ("skip", "zeros")


@dataclass
class DepthMerge:
    """A mixed-depth merge: the universe (the deepest depth), each client's transform into it (of its
    padded self), each client's block positions in it, and the layer matches that placed them."""

    universe: nn.Module
    transforms: list[Transform]
    positions: list[list[int]]
    matches: list[Optional[LayerMatch]]

    def client_model(self, i: int) -> nn.Module:
        """Client ``i``'s own-depth model from the universe (its blocks, mapped back by its transform)."""
        full = project(self.universe, self.transforms[i])
        depth = self.universe.config.n_layer
        return remove_blocks(full, [b for b in range(depth) if b not in set(self.positions[i])])


def _block_of(key: str) -> Optional[int]:
    return int(key.split(".")[1]) if key.startswith("blocks.") else None


def block_average(
    states: Sequence[dict],
    weights: Sequence[float],
    holders: Sequence[Sequence[int]],
    padding: str = "skip",
    masks: Optional[Sequence[Optional[dict]]] = None,
    config=None,
) -> dict:
    """The weighted average of same-shape states, each block ``l`` over the models holding a real block
    there (``holders[m]``: model m's real blocks; ``padding="zeros"``: over every model). ``masks`` and
    ``config`` (models of several widths, padded: ``universe.Members``) average each head, FF neuron and
    residual direction over the models that hold it too (``averaging.unit_weighted``)."""
    one_of(padding, PADDINGS, "padding")
    held = [set(h) for h in holders]
    masked = masks is not None and any(m is not None for m in masks)
    out: dict = {}
    patterns: dict[tuple, list[str]] = {}  # which models count, and the keys they count for
    for key in states[0]:
        b = _block_of(key)
        who = tuple(w > 0 and (b is None or padding == "zeros" or b in h) for w, h in zip(weights, held))
        if not any(who):  # a block no model holds (cannot happen: the deepest model holds every block)
            raise ValueError(f"no model holds block {b}")
        patterns.setdefault(who, []).append(key)
    for who, keys in patterns.items():
        idx = [i for i, x in enumerate(who) if x]
        sub = [{k: states[i][k] for k in keys} for i in idx]
        total = sum(float(weights[i]) for i in idx)
        ws = [float(weights[i]) / total for i in idx]
        if masked:
            part = unit_weighted(sub, ws, [masks[i] for i in idx], config)
        else:
            part = weighted_state(sub, ws)
        out.update({k: part[k] for k in keys})
    return {k: out[k] for k in states[0]}


def depth_merge(
    models: Sequence[nn.Module],
    weights: Optional[Sequence[float]] = None,
    *,
    matching: Optional[Matching] = None,
    iterations: int = 3,
    padding: str = "skip",
    data: Optional[torch.Tensor] = None,
    positions: Optional[Sequence[Optional[Sequence[int]]]] = None,
) -> DepthMerge:
    """Merge ``models`` of different depths (and widths) into a model of the deepest depth (and the
    widest shape).

    Parameters
    ----------
    models : sequence of nn.Module
        fedlmc models of one architecture; depths and widths may differ (as ``universe_merge``'s).
    weights : sequence of float, optional
        One per model (e.g. example counts); default equal.
    matching : Matching, optional
        Weight matching's options for the alignments.
    iterations : int, default 3
        Universe iterations (align every model, re-average).
    padding : {"skip", "zeros"}, default "skip"
        Average each block over the models that hold it, or count identity padding as zeros.
    data : Tensor, optional
        Inputs every model takes: the layers are then matched on activations, not weights.
    positions : sequence, optional
        Each model's block positions in the deepest depth (None: found by ``match_layers``); e.g. the
        first blocks, ``range(depth)``, for prefix-depth placement.
    """
    one_of(padding, PADDINGS, "padding")
    if not models:
        raise ValueError("depth_merge needs at least one model")
    n = len(models)
    w = [1.0] * n if weights is None else [float(x) for x in weights]
    if len(w) != n or any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"weights must be {n} non-negative numbers with a positive sum, got {weights}")
    canon = [canonicalize(m) for m in models]
    depth = max(c.config.n_layer for c in canon)
    # the anchor: the widest of the deepest models, the heaviest of those
    anchor = max(
        (i for i in range(n) if canon[i].config.n_layer == depth),
        key=lambda i: (canon[i].config.d_model, canon[i].config.d_ff, canon[i].config.n_head, w[i]),
    )
    places, matches = [], []
    for i, c in enumerate(canon):
        given = positions[i] if positions is not None else None
        if given is not None:
            places.append(list(given))
            matches.append(None)
        elif c.config.n_layer == depth:
            places.append(list(range(depth)))
            matches.append(None)
        else:
            found = match_layers(c, canon[anchor], data=data, matching=matching)
            places.append(found.positions)
            matches.append(found)
    deep = [pad_to_depth(c, p, depth) if c.config.n_layer < depth else c for c, p in zip(canon, places)]
    mem = members(deep, w, None, keep_layernorm=False)  # several widths: padded to one shape, and masked
    padded = [mem.padded[i] for i in range(n)]
    universe = padded[anchor]
    transforms = [Transform() for _ in padded]
    for _ in range(max(1, iterations)):
        transforms = [
            Transform() if (i == anchor and universe is padded[anchor]) else weight_matching(universe, p, matching)
            for i, p in enumerate(padded)
        ]
        states = [aligned_state(p, T) for p, T in zip(padded, transforms)]
        masks = [mem.aligned_masks(i, T) for i, T in enumerate(transforms)] if mem.hetero else None
        average = block_average(states, mem.weights, places, padding, masks, padded[anchor].config)
        universe = rebuild(padded[anchor], average)
    return DepthMerge(universe.eval(), mem.client_transforms(transforms), places, matches)
