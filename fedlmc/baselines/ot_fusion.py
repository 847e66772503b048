"""Optimal-transport fusion of Transformers (Imfeld et al., "Transformer Fusion with Optimal Transport",
ICLR 2024), weight-based, written from the paper for fedlmc's GPT-2 and ViT models.

A model is aligned to an anchor one layer at a time, in the order the signal flows. Each linear layer's
input side is first carried by the map of the units feeding it; then the cost between its output units
(the rows of the two weight matrices, each scaled to unit norm, Euclidean distances divided by their
maximum) defines a transport problem with uniform mass on both sides, solved by Sinkhorn with
regularisation ``reg`` (soft maps) or exactly (``reg = 0``: a permutation). The map ``T`` (model's
units × anchor's units, scaled so that each anchor unit receives a convex combination) carries the
layer's rows and bias: ``W' = Tᵀ W T_in``. The residual stream has no layer of its own: at each sum its
map becomes the mean of the skip's and the block output's maps (the paper's "average" policy); LayerNorm
gains and biases, the class token and the head's input side follow it. Q, K and V get maps of their own
over all their output units; the attention output's input side follows V's. Aligned models are then
averaged with the replies' weights.

Between equal numbers of units, exact transport with uniform mass is a permutation, so with ``reg = 0``
a planted copy (residual coordinates, heads and FF neurons permuted) is mapped back exactly.

``cost="activations"`` (the paper's activation-based variant) replaces each layer's weight rows by its
output units' activations on the same inputs (``OTFusion.data``, at most ``samples`` positions, each
unit's vector scaled to unit norm as the rows are): the model's own activations against the anchor's,
so no input-side map enters the cost. The embedding tables keep their weight-based costs.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from fedlmc.options import Guard, one_of
from fedlmc.strategies.fedavg import AverageBase
from fedlmc.strategies.keys import Key, non_negative
from fedlmc.strategies.registry import Build, register

Maps = dict[str, torch.Tensor]

RESIDUAL_POLICIES = ("average", "transported", "residual")  # OTFusion.residual_policy: how maps meet at a residual sum
OT_COSTS = ("weights", "activations")  # OTFusion.cost


@dataclass(frozen=True)
class OTFusion:
    """Optimal-transport fusion of Transformers (Imfeld et al., ICLR 2024), weight-based: every model is
    aligned layer by layer to an anchor (the reply of largest weight) with transport maps between units,
    then averaged.

    Parameters
    ----------
    reg : float, default 0.06
        Sinkhorn's entropic regularisation of each transport problem (costs are scaled to at most 1):
        soft maps. 0: exact optimal transport, which between equal numbers of units with uniform mass is
        a permutation (hard maps).
    residual_policy : {"average", "transported", "residual"}, default "average"
        At a residual sum the stream's map becomes the mean of the skip's map and the block output's
        ("average", the paper's), the block output's ("transported") or the skip's ("residual").
    sinkhorn_iterations : int, default 2000
        At most this many Sinkhorn iterations per map (it stops once the marginals match to 1e-9).
    cost : {"weights", "activations"}, default "weights"
        What the transport costs compare: each layer's weight rows, or its output units' activations on
        ``data`` (the paper's activation-based fusion).
    data : data set or None, default None
        Server-side inputs for ``cost="activations"`` (their labels are not used).
    samples : int, default 1024
        Positions (tokens; images × (patches + 1)) whose activations make each cost.
    """

    reg: float = 0.06
    residual_policy: str = "average"
    sinkhorn_iterations: int = 2000
    cost: str = "weights"
    data: Any = None
    samples: int = 1024

    def __post_init__(self) -> None:
        one_of(self.residual_policy, RESIDUAL_POLICIES, "residual policy")
        one_of(self.cost, OT_COSTS, "OT fusion cost")
        if self.reg < 0 or self.sinkhorn_iterations < 1:
            raise ValueError(
                f"OTFusion needs reg >= 0 and sinkhorn_iterations >= 1, got {self.reg} and {self.sinkhorn_iterations}"
            )


def ground_cost(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Distances between the rows of ``x`` and of ``y`` (each scaled to unit norm), divided by their
    largest: every cost lies in [0, 1]."""
    a = x / (x.norm(dim=1, keepdim=True) + 1e-12)
    b = y / (y.norm(dim=1, keepdim=True) + 1e-12)
    c = torch.cdist(a, b)
    top = c.max()
    return c / top if top > 0 else c


def transport(cost: torch.Tensor, reg: float, iterations: int = 2000) -> torch.Tensor:
    """The transport plan between uniform masses on the rows and the columns of ``cost``: exact
    (``reg = 0``, equal sizes: a permutation / n) or entropic, by log-domain Sinkhorn iterations."""
    n0, n1 = cost.shape
    if reg == 0:
        from scipy.optimize import linear_sum_assignment  # here: a ClientApp imports strategies, not solvers

        if n0 != n1:
            raise ValueError(f"exact transport here is between equal numbers of units, got {n0} and {n1}")
        rows, cols = linear_sum_assignment(cost.detach().cpu().numpy())
        plan = torch.zeros_like(cost)
        plan[torch.as_tensor(rows), torch.as_tensor(cols)] = 1.0 / n0
        return plan
    K = -cost / reg
    log_mu = torch.full((n0,), -torch.log(torch.tensor(float(n0))), dtype=cost.dtype)
    log_nu = torch.full((n1,), -torch.log(torch.tensor(float(n1))), dtype=cost.dtype)
    f, g = torch.zeros_like(log_mu), torch.zeros_like(log_nu)
    for i in range(iterations):
        f = log_mu - torch.logsumexp(K + g[None, :], dim=1)
        g = log_nu - torch.logsumexp(K + f[:, None], dim=0)
        if i % 10 == 9:
            rows = torch.logsumexp(K + f[:, None] + g[None, :], dim=1).exp()
            if float((rows - log_mu.exp()).abs().max()) < 1e-9:
                break
    return (K + f[:, None] + g[None, :]).exp()


def unit_map(cost: torch.Tensor, options: OTFusion) -> torch.Tensor:
    """The transport plan scaled by the number of units: each anchor unit's column sums to one."""
    return transport(cost, options.reg, options.sinkhorn_iterations) * cost.shape[0]


def _linear(w, b, anchor_w, t_in, options, last=False, acts=None):
    """A linear layer (rows: output units) carried to the anchor: input side by ``t_in``, output side
    by a new map (none for the last layer). Returns the weight, the bias and the map. ``acts``: the
    layer's output activations, the model's and the anchor's (units × positions), as the cost."""
    w = w if t_in is None else w @ t_in
    if last:
        return w, b, None
    T = unit_map(ground_cost(*acts) if acts is not None else ground_cost(w, anchor_w), options)
    return T.T @ w, (T.T @ b if b is not None else None), T


LINEARS = ("patch_emb", "attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc1", "mlp.fc2")


@torch.no_grad()
def activations(model: nn.Module, data, samples: int = 1024, batch_size: int = 64) -> dict[str, torch.Tensor]:
    """Every aligned linear layer's outputs on ``data``'s first ``samples`` positions (tokens, or
    patches and the class token), as ``units × positions`` float64 matrices, keyed by module name."""
    model = model.eval()
    found: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.endswith(LINEARS):

            def keep(_m, _i, out, name=name):
                found.setdefault(name, []).append(out.detach().reshape(-1, out.shape[-1]).double())

            hooks.append(mod.register_forward_hook(keep))
    try:
        seen = 0
        dev = next(model.parameters()).device
        for x, _ in data.batches(batch_size):
            model(x.to(dev))
            seen += x.shape[0] * (x.shape[1] if not x.is_floating_point() else 1)
            if seen >= samples:
                break
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v)[:samples].T.cpu() for k, v in found.items()}


def _columns(e, anchor_e, options):
    """An embedding table whose columns are the residual units: its map and its aligned table."""
    T = unit_map(ground_cost(e.T, anchor_e.T), options)
    return e @ T, T


def _meet(skip: torch.Tensor, block: torch.Tensor, policy: str) -> torch.Tensor:
    """The residual stream's map after a sum of the skip (map ``skip``) and a block output (``block``)."""
    return {"average": 0.5 * (skip + block), "transported": block, "residual": skip}[policy]


def _embeddings(sd: dict, anchor: dict, out: dict, options: OTFusion, acts=None) -> torch.Tensor:
    """Align the embeddings (GPT-2: token and position tables; ViT: patch projection, positions, class
    token) into ``out``; returns the residual stream's map."""
    out["pos_emb"], t_pos = _columns(sd["pos_emb"], anchor["pos_emb"], options)
    if "tok_emb.weight" in sd:
        out["tok_emb.weight"], t_in = _columns(sd["tok_emb.weight"], anchor["tok_emb.weight"], options)
    else:
        w, b, t_in = _linear(
            sd["patch_emb.weight"],
            sd["patch_emb.bias"],
            anchor["patch_emb.weight"],
            None,
            options,
            acts=_of(acts, "patch_emb"),
        )
        out["patch_emb.weight"], out["patch_emb.bias"] = w, b
    t_res = _meet(t_pos, t_in, options.residual_policy)
    if "cls_token" in sd:
        out["cls_token"] = sd["cls_token"] @ t_res
    return t_res


def _norm(sd, out, name, t_res):
    for part in ("weight", "bias"):
        key = f"{name}.{part}"
        if key in sd:
            out[key] = sd[key] @ t_res


def _of(acts, key: str):
    """The model's and the anchor's activations of layer ``key`` (None: weight-based costs)."""
    return None if acts is None else (acts[0][key], acts[1][key])


def _block(sd: dict, anchor: dict, out: dict, i: int, t_res: torch.Tensor, options: OTFusion, maps: Maps, acts=None):
    """Align block ``i`` into ``out``; returns the residual stream's map after it."""
    p = f"blocks.{i}."
    _norm(sd, out, p + "ln1", t_res)
    for name in ("q", "k", "v"):
        key = p + f"attn.{name}"
        out[key + ".weight"], out[key + ".bias"], maps[key] = _linear(
            sd[key + ".weight"], sd.get(key + ".bias"), anchor[key + ".weight"], t_res, options, acts=_of(acts, key)
        )
    key = p + "attn.o"
    out[key + ".weight"], out[key + ".bias"], maps[key] = _linear(
        sd[key + ".weight"],
        sd.get(key + ".bias"),
        anchor[key + ".weight"],
        maps[p + "attn.v"],
        options,
        acts=_of(acts, key),
    )
    t_res = _meet(t_res, maps[key], options.residual_policy)
    _norm(sd, out, p + "ln2", t_res)
    t_in = t_res
    for name in ("fc1", "fc2"):
        key = p + f"mlp.{name}"
        out[key + ".weight"], out[key + ".bias"], maps[key] = _linear(
            sd[key + ".weight"], sd.get(key + ".bias"), anchor[key + ".weight"], t_in, options, acts=_of(acts, key)
        )
        t_in = maps[key]
    return _meet(t_res, t_in, options.residual_policy)


def ot_align(
    model: nn.Module, anchor: nn.Module, options: Optional[OTFusion] = None, anchor_acts: Optional[dict] = None
) -> tuple[dict, Maps]:
    """``model``'s weights carried onto ``anchor``'s units (float64) and the maps used (key → map).
    ``anchor_acts``: the anchor's ``activations`` when the cost is activation-based (else computed)."""
    options = options or OTFusion()
    if getattr(model.config, "arch", None) not in ("gpt2", "vit"):  # learned positions, LayerNorm, GELU FFs
        raise ValueError("OT fusion is written for fedlmc's GPT-2 and ViT models (LayerNorm, GELU FFs)")
    acts = None
    if options.cost == "activations":
        if options.data is None:
            raise ValueError('OTFusion(cost="activations") needs data: OTFusion(data=...) (server-side inputs)')
        anchor_acts = anchor_acts if anchor_acts is not None else activations(anchor, options.data, options.samples)
        acts = (activations(model, options.data, options.samples), anchor_acts)
    sd = {k: v.detach().double() for k, v in model.state_dict().items()}
    ref = {k: v.detach().double() for k, v in anchor.state_dict().items()}
    out: dict = {}
    maps: Maps = {"residual.embedding": _embeddings(sd, ref, out, options, acts)}
    t_res = maps["residual.embedding"]
    for i in range(model.config.n_layer):
        t_res = maps[f"residual.{i}"] = _block(sd, ref, out, i, t_res, options, maps, acts)
    _norm(sd, out, "ln_f", t_res)
    out["head.weight"], out["head.bias"], _ = _linear(
        sd["head.weight"], sd.get("head.bias"), None, t_res, options, True
    )
    missing = set(sd) - set(out)
    if missing:
        raise ValueError(f"OT fusion left parameters unaligned: {sorted(missing)}")
    return out, maps


def ot_fusion(models: Sequence[nn.Module], weights: Sequence[float], options: Optional[OTFusion] = None) -> nn.Module:
    """The weighted average of ``models`` once each is carried onto the anchor's units (``ot_align``)."""
    options = options or OTFusion()
    if len(models) != len(weights) or not models:
        raise ValueError("ot_fusion needs one weight per model, and at least one model")
    a = max(range(len(models)), key=lambda i: (weights[i], -i))  # the anchor: the heaviest reply
    anchor = models[a]
    total = float(sum(weights))
    acc = {k: v.detach().double() * (weights[a] / total) for k, v in anchor.state_dict().items()}
    anchor_acts = activations(anchor, options.data, options.samples) if options.cost == "activations" else None
    for i, (m, w) in enumerate(zip(models, weights)):
        if i != a:
            aligned, _ = ot_align(m, anchor, options, anchor_acts)
            for k in acc:
                acc[k] = acc[k] + aligned[k] * (w / total)
    fused = copy.deepcopy(anchor)
    ref = anchor.state_dict()
    fused.load_state_dict({k: v.to(ref[k].dtype) for k, v in acc.items()})
    return fused


# ---- the strategy --------------------------------------------------------------------------------


class OTFusionFedAvg(AverageBase):
    """Each round's replies fused by optimal transport (``fedlmc.baselines.ot_fusion``: Imfeld et al., ICLR 2024,
    weight-based): every reply carried onto an anchor reply's units by soft transport maps, layer by
    layer, then averaged with the replies' weights. fedlmc's GPT-2 and ViT models.

    Parameters
    ----------
    fusion : OTFusion, optional
        The maps' regularisation (0: exact, permutations), the residual policy and the anchor.
    guard : Guard, optional
        The do-no-harm comparison with the plain average, as ``AlignedFedAvg``'s (None: none).
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters (no ``robust``: the transported replies
        are averaged).
    """

    needs_architecture = True

    def __init__(self, *, fusion: Optional[OTFusion] = None, guard: Optional[Guard] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fusion = fusion if fusion is not None else OTFusion()
        self.guard = guard

    def combine(self, server_round, replies, models, weights):
        t0 = time.time()
        fused = ot_fusion(models, weights, self.fusion)
        fields: dict[str, Any] = {"kept": "ot-fusion", "align_seconds": time.time() - t0}
        plain = super().combine(server_round, replies, models, weights)[0]  # FedAvg's mean: the guard's rival
        if self.guard is not None:
            losses = {"ot-fusion": self.guard_loss(self.guard, fused), "average": self.guard_loss(self.guard, plain)}
            kept, verdict = self.guard_verdict({"ot-fusion": fused, "average": plain}, losses, "server")
            fields.update(verdict, kept=kept)
            if kept == "average":
                fused = plain
        return fused, fields, plain


OT_REG = Key(
    "ot-reg",
    OTFusion.reg,
    "Sinkhorn's entropic regularisation of each transport map (costs scaled to at "
    "most 1; the paper's best weight-based value); 0: exact maps, permutations (`OTFusion.reg`)",
    check=non_negative,
)
OT_COST = Key(
    "ot-cost",
    OTFusion.cost,
    "transport costs from the layers' weight rows, or `activations`: their output "
    "units' activations on the server's refinement half (`OTFusion.cost`)",
    choices=OT_COSTS,
)


@register(
    "ot-fusion",
    summary="optimal-transport fusion (Imfeld et al., ICLR 2024), replies carried onto an "
    "anchor by soft transport maps layer by layer, then averaged; guarded by the plain average",
    server_data=True,
    example="OTFusionFedAvg(model=model)",
    keys=(OT_REG, OT_COST),
)
def _ot_fusion(b: Build):
    cost = b.key("ot-cost")
    data = b.halves()[0] if cost == "activations" else None  # the half the refinement learns on
    fusion = OTFusion(reg=b.key("ot-reg"), cost=cost, data=data)
    return OTFusionFedAvg(**b.common(), fusion=fusion, guard=b.guard())
