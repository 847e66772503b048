"""The output head in a form Hugging Face can hold.

fedlmc's canonical form folds the final norm's gain and bias into the head (``logits = H n + h₀``,
with ``n`` the normalised state). Hugging Face's GPT-2 and Llama heads have no bias, and a tied model
has one matrix for embedding and head. Given the fedlmc model's head, this writes the same map as
``lm_head`` + final-norm gain ``g`` and bias ``b``:

* untied: ``lm_head = H diag(w)`` stays exact; ``b`` solves ``H b ≈ h₀`` (exact when h₀ is in H's range,
  as for any model converted from Hugging Face and acted on by symmetries);
* tied: ``lm_head = E`` (the embedding); ``g`` fits each column, ``E diag(g) ≈ H diag(w)``, and ``b``
  solves ``E b ≈ h₀``. Exact for a tied model acted on by a residual *permutation* (or none); after an
  orthogonal alignment the merged head is only approximately ``E`` times a diagonal.

The relative error ``max(‖Δ head‖/‖head‖, ‖Δ bias‖/‖bias‖)`` is returned so callers can report it.
"""

from __future__ import annotations

from typing import Optional

import torch

from fedlmc.models.layers import TransformerConfig

StateDict = dict[str, torch.Tensor]


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    n = float(ref.norm())
    return float(diff.norm()) / n if n > 0 else float(diff.norm())


def fit_head(sd: StateDict, cfg: TransformerConfig, tied: bool, embedding: Optional[str]) -> tuple[StateDict, float]:
    """``sd`` with ``head.bias`` removed and the head/final norm refitted as described above."""
    sd = dict(sd)
    H = sd["head.weight"].double()
    w = sd.get("ln_f.weight")
    H_eff = H * w.double() if w is not None else H  # H diag(w)
    h0 = H @ sd["ln_f.bias"].double() if "ln_f.bias" in sd else torch.zeros(H.shape[0], dtype=H.dtype)
    if "head.bias" in sd:
        h0 = h0 + sd["head.bias"].double()
    keep_bias = cfg.arch == "vit"  # ViT's classifier has a bias: nothing to fit
    if keep_bias and not tied:
        return sd, 0.0
    errors = []
    dt = sd["head.weight"].dtype
    rcond = 1e-10 if dt == torch.float64 else 1e-6  # below the source's rounding, a direction is null
    if tied:
        if embedding is None:
            raise ValueError(f"{cfg.arch} has no input embedding to tie the head to")
        # softmax ignores a constant added to every logit, so the fit is on vocabulary-centred columns
        E = sd[embedding].double()
        Ec, Hc = E - E.mean(0), H_eff - H_eff.mean(0)
        g = (Ec * Hc).sum(0) / (Ec * Ec).sum(0).clamp_min(1e-300)
        errors.append(_rel(Ec * g - Hc, Hc))
        head, gain = E, g
        h0 = h0 - h0.mean()
        fit_to = Ec
    else:
        head, gain = H, (w.double() if w is not None else torch.ones(H.shape[1], dtype=H.dtype))
        fit_to = head
    if cfg.norm == "layernorm":  # the final norm's bias b carries the head bias: head · b ≈ h₀
        ones_free = not tied and _ones_free(head, gain, 1e-9 if dt == torch.float64 else 1e-4)
        if ones_free:  # centred up to the source's rounding: make it exact so 1 is a clean null direction
            head = fit_to = head - head.mean(1, keepdim=True)
        b = torch.linalg.lstsq(fit_to, h0[:, None], rcond=rcond, driver="gelsd").solution[:, 0]  # min-norm
        r = h0 - fit_to @ b
        if ones_free and r.abs().max() > 1e-12 * h0.abs().max():
            head, b = _through_ones(head, b, r)
            r = h0 - head @ b
        errors.append(_rel(r, h0) if h0.abs().max() > 0 else 0.0)
        sd["ln_f.bias"] = b.to(dt)
    elif h0.abs().max() > 0:
        raise ValueError(f"a {cfg.arch} model with a head bias has no Hugging Face form (RMSNorm has no bias)")
    sd["head.weight"] = head.to(dt)
    sd["ln_f.weight"] = gain.to(dt)
    sd.pop("head.bias", None)
    return sd, max(errors, default=0.0)


def _ones_free(head: torch.Tensor, gain: torch.Tensor, tol: float) -> bool:
    """A head that ignores the all-ones direction (a canonical head, centred) behind a unit gain."""
    return (
        bool((gain - 1).abs().max() < 1e-12)
        and float(head.sum(1).norm()) <= tol * float(head.norm()) * head.shape[1] ** 0.5
    )


def _through_ones(head: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry the residual ``r`` of the bias fit exactly: LayerNorm's normalised state is centred, so a
    head ``head + (r/d) 1ᵀ`` reads it unchanged, and the bias ``b + t·1`` then adds
    ``(r/d)·(1ᵀb + t d) = r`` for ``t = 1 − 1ᵀb/d`` (``head·1 = 0``)."""
    d = head.shape[1]
    t = 1.0 - float(b.sum()) / d
    return head + r[:, None] / d, b + t
