"""The canonical form: LayerNorm rewritten as parameter-free RMSNorm, so the residual stream admits
any orthogonal map; and the way back to an ordinary LayerNorm model.

``LN(x) = g * RMSNorm(C x) + b`` with the centring matrix ``C = I - 11^T/d``. Folding C into every
residual writer keeps the stream centred (so ``C x = x``), and folding ``g``/``b`` into the readers
(``W diag(g)``, bias ``+ W b``) leaves a parameter-free RMSNorm with the same eps. Readers are then
projected onto 1^⊥ as well (their input is centred, so this changes nothing). Written against the
symmetry spec's writer/reader roles, so any architecture with a spec gets it.

``apply_transform`` lives here because it needs the canonical form: the residual group acts on it,
so a LayerNorm model is canonicalised (exactly) before a residual map is applied.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from fedlmc.symmetry.spec import StateDict, spec_for
from fedlmc.symmetry.transform import Transform, apply_along, apply_to_state, rebuild


def canonicalize(model: nn.Module, out: Optional[StateDict] = None) -> nn.Module:
    """A parameter-free-RMSNorm model computing exactly the same function (a new model).

    LayerNorm models: centring folded into writers, gain and bias folded into readers. RMSNorm models
    with a bias: the bias folded into readers. Already canonical models are returned as a copy.

    ``out``: the state of an earlier canonical model of the same shape that nothing uses any more (a
    loop over replies); the new model's large tensors are written into its tensors instead of fresh
    memory, which would cost a page fault for every 4 KB of the model on top of the pass that fills it.
    """
    cfg = model.config
    spec = spec_for(cfg)
    src = {k: v.detach() for k, v in model.state_dict().items()}
    ref = next(model.parameters())
    spare = dict(out or {})

    def fresh(k: str, like: torch.Tensor) -> torch.Tensor:
        """Where the canonical tensor ``k`` goes: ``out``'s when it fits (taken once), else new memory."""
        t = spare.pop(k, None)
        if t is None or t.shape != like.shape or t.dtype != ref.dtype or t.device != like.device:
            return torch.empty(like.shape, dtype=ref.dtype, device=like.device)
        return t

    sd: StateDict = dict(src)  # every fold below makes a new tensor; the untouched ones are copied at the end
    layernorm = cfg.norm == "layernorm"
    for norm in spec.norms:
        gain = sd.pop(f"{norm}.weight", None)
        shift = sd.pop(f"{norm}.bias", None)
        for m in spec.readers():
            if m.norm != norm:
                continue
            W = sd[m.param]
            if shift is not None:
                # bias += W @ shift, contracting W's residual axis
                sd[m.bias] = sd[m.bias] + apply_along(W, m.axis, shift[None, :]).squeeze(m.axis)
            if gain is not None:
                shape = [1] * W.dim()
                shape[m.axis] = -1
                sd[m.param] = torch.mul(W, gain.view(shape), out=fresh(m.param, W))
    if layernorm:
        # Writers: centring keeps the stream in 1^⊥. Readers: their input (RMSNorm of a centred vector) is
        # centred too, so their 1-component is dead; removing it makes the all-ones direction null in
        # every residual tensor, which is what lets matching treat it separately (keep_layernorm).
        for m in spec.writers() + spec.readers():
            t = sd[m.param]
            mean = t.mean(dim=m.axis, keepdim=True)  # C t along the axis, without a d×d product
            # a fold's fresh tensor: in place
            sd[m.param] = torch.sub(t, mean, out=fresh(m.param, t)) if t is src.get(m.param) else t.sub_(mean)
    sd = {k: fresh(k, v).copy_(v) if v is src.get(k) else v.to(ref.dtype) for k, v in sd.items()}
    return rebuild(model, sd, canonical_config(cfg), own=True)


def canonical(model: nn.Module, out: Optional[StateDict] = None) -> nn.Module:
    """The model in canonical (RMSNorm) form: canonicalised if it has LayerNorms (``out``: see
    ``canonicalize``), else itself."""
    return canonicalize(model, out) if not is_canonical(model.config) else model


def is_canonical(cfg) -> bool:
    """Whether a config is in canonical form: RMSNorm without a gain (a bias is a residual member)."""
    return cfg.norm == "rmsnorm" and not cfg.norm_gain


def layernorm_native(cfg) -> bool:
    """Whether the architecture is a LayerNorm one (GPT-2, ViT), whose canonical form can go back to
    LayerNorm; an RMSNorm architecture (Llama) has no centring to keep."""
    return type(cfg)().norm == "layernorm"


def canonical_config(cfg):
    """The config of a model's canonical form (parameter-free RMSNorm)."""
    return cfg.replace(norm="rmsnorm", norm_bias=False, norm_gain=False)


def residual_offcentre(model: nn.Module) -> float:
    """Largest relative size of a writer's component along the all-ones direction (0 when centred)."""
    spec = spec_for(model)
    sd = model.state_dict()
    worst = 0.0
    for m in spec.writers():
        t = sd[m.param].detach()
        along = t.sum(dim=m.axis) / t.shape[m.axis] ** 0.5
        worst = max(worst, float(along.norm() / t.norm().clamp_min(1e-30)))
    return worst


def recentre(model: nn.Module) -> nn.Module:
    """A canonical model with every writer projected onto 1⊥: the nearest model whose stream is centred
    (not function-preserving unless it already was; a coordinate-wise median of centred models is not
    centred, and this is how such an aggregate goes back to LayerNorm)."""
    sd = dict(model.state_dict())
    for m in spec_for(model.config).writers():
        t = sd[m.param].detach()
        sd[m.param] = t - t.mean(dim=m.axis, keepdim=True)
    return rebuild(model, sd)


def to_layernorm(model: nn.Module, tol: float = 1e-6) -> nn.Module:
    """Convert a canonical model whose residual stream is centred back to an ordinary LayerNorm model.

    On centred inputs LayerNorm with unit gain and zero bias *is* RMSNorm with the same eps, so the
    result is exact. Raises ``ValueError`` if the writers are not centred (e.g. the residual map did not
    fix the all-ones direction: use ``fix_ones``/``keep_layernorm``).
    """
    cfg = model.config
    if cfg.norm == "layernorm":
        return rebuild(model, model.state_dict())
    if cfg.norm_bias or cfg.norm_gain:
        model = canonicalize(model)
    off = residual_offcentre(model)
    if off > tol:
        raise ValueError(
            f"residual stream is not centred (off-centre {off:.2e} > {tol:.0e}); "
            "only transforms with O·1 = 1 keep a model convertible to LayerNorm"
        )
    sd = dict(model.state_dict())
    ref = next(model.parameters())
    for norm in spec_for(cfg).norms:
        sd[f"{norm}.weight"] = torch.ones(cfg.d_model, dtype=ref.dtype, device=ref.device)
        sd[f"{norm}.bias"] = torch.zeros(cfg.d_model, dtype=ref.dtype, device=ref.device)
    return rebuild(model, sd, cfg.replace(norm="layernorm", norm_bias=False))


def apply_transform(model: nn.Module, transform: Transform) -> nn.Module:
    """The model acted on by ``transform`` (a new model; the input is not modified).

    Permutations and gauges act on any model; the residual orthogonal group acts on the canonical
    (RMSNorm) form, so a LayerNorm model is canonicalised first (exactly). A rectangular residual
    element (``d_new x d``, orthonormal columns) returns a model of width ``d_new`` computing the same
    function.
    """
    if transform.get("residual") is not None and not is_canonical(model.config):
        model = canonicalize(model)
    sd, cfg = apply_to_state({k: v.detach() for k, v in model.state_dict().items()}, model.config, transform)
    return rebuild(model, sd, cfg)
