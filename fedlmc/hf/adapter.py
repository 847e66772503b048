"""``HFAdapter``: a federation's replies under a ``transformers`` model's own keys ↔ fedlmc models, so
the strategies can align them and send back arrays that ``load_state_dict(strict=True)`` takes."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

import torch
import torch.nn as nn

from fedlmc.hf.convert import _transformers, family_of, fedlmc_model, hf_state, is_tied
from fedlmc.hf.families import FAMILIES, StateDict
from fedlmc.symmetry.canonical import to_layernorm

log = logging.getLogger(__name__)
FIT_WARN = 1e-6  # relative head-fit error above which the adapter warns (see fedlmc.hf.head)


def key_mismatch(have: set[str], want: set[str]) -> str:
    """The unexpected and missing keys of a state dict, a few of each ('' when they agree)."""

    def few(ks: set[str]) -> str:
        ks = sorted(ks)
        return ", ".join(ks[:4]) + (f" and {len(ks) - 4} more" if len(ks) > 4 else "")

    return "; ".join(
        ([f"unexpected keys {few(have - want)}"] if have - want else [])
        + ([f"missing keys {few(want - have)}"] if want - have else [])
    )


def recognise(keys: Iterable[str]) -> Optional[str]:
    """The Hugging Face class whose weights these keys look like (None if none)."""
    keys = set(keys)
    return next((f.model_class for f in FAMILIES.values() if f.prefix in keys), None)


class HFAdapter:
    """Built from the client model's ``transformers`` config (or the model itself).

    ``template``: the client's keys and shapes; ``to_fedlmc(state)``: a reply's state dict as a fedlmc
    model (float32); ``to_client(model)``: a fedlmc model of the same family as the client's state dict
    (LayerNorm families converted back to LayerNorm, the head fitted for a tied model or a bias-free
    ``lm_head``: tied keys always get one and the same tensor). ``fit_error`` is the last head fit's
    relative error."""

    def __init__(self, model_or_config: Any) -> None:
        hf_config = getattr(model_or_config, "config", model_or_config)
        self.family = family_of(hf_config)
        self.hf_config = hf_config
        self.config = self.family.config_from_hf(hf_config)
        self.tied = is_tied(hf_config)
        with torch.device("meta"):
            shell = getattr(_transformers(), self.family.model_class)(hf_config)
        self.template = {k: tuple(v.shape) for k, v in shell.state_dict().items()}
        self.fit_error = 0.0
        self._explained = False  # the head fit's warning, explained once

    def describe(self) -> str:
        return f"Hugging Face {self.family.model_class} ({'tied' if self.tied else 'untied'} head)"

    def mismatch(self, keys: Iterable[str]) -> str:
        """The unexpected and missing keys of a client state dict, briefly ('' when they agree)."""
        have, want = set(keys), set(self.template)
        if self.tied:  # a tied model's state dict may list the head's key or not
            have.discard(self.family.embeddings[1])
            want.discard(self.family.embeddings[1])
        return key_mismatch(have, want)

    def to_fedlmc(self, state: StateDict) -> nn.Module:
        return fedlmc_model(self.family, self.config, state, torch.float32)

    def to_client(self, model: nn.Module, keys: Optional[Iterable[str]] = None) -> StateDict:
        """``model`` under the client's keys (``keys``: the client's key set; default the template's)."""
        if model.config.arch in ("gpt2", "vit") and model.config.norm != "layernorm":
            model = to_layernorm(model)
        sd, self.fit_error = hf_state(model, self.tied, self.family.name)
        if self.fit_error > FIT_WARN and not self._explained:
            self._explained = True
            log.warning(
                "%s: after alignment the aggregate's output head is not exactly a form this model can hold "
                "(a tied head must equal the token embedding; a bias-free head cannot carry a bias), so it was "
                "written back by least squares, relative error %.2e. A few per cent is usual and cost no test "
                "loss in fedlmc's measurements; an untied head (tie_word_embeddings=False) is sent exactly. "
                "Later rounds log the error at INFO level (docs/models.md, 'Tied heads').",
                self.describe(),
                self.fit_error,
            )
        elif self.fit_error > FIT_WARN:
            log.info(
                "%s: the aggregate's head fitted to the client's form, relative error %.2e",
                self.describe(),
                self.fit_error,
            )
        keys = set(keys) if keys is not None else set(self.template)
        if self.tied:
            sd[self.family.embeddings[1]] = sd[self.family.embeddings[0]]  # one tensor for both tied keys
        missing = keys - set(sd)
        if missing:
            raise RuntimeError(f"conversion bug: no tensor for client keys {sorted(missing)[:4]}")
        return {k: sd[k].detach().float().cpu().contiguous() for k in sorted(keys)}
