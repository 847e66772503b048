"""Hugging Face models in and out of fedlmc: ``from_hf`` and ``to_hf`` (exact conversions), and
``HFAdapter``, which lets the strategies take replies under a ``transformers`` model's own keys.

Supported: ``GPT2LMHeadModel``, ``ViTForImageClassification``, ``LlamaForCausalLM``, ``OPTForCausalLM``
and ``GPTNeoXForCausalLM`` (tested against ``transformers`` 5.24). fedlmc's own models hold the same
functions (fedlmc GPT-2 gains an explicit head bias; Llama's tied head becomes an untied copy). Going
back, what Hugging Face cannot hold — a head bias (GPT-2's ``lm_head`` has none) or two different
embedding matrices for a tied model — is fitted by least squares (``head.fit_head``); the fit's relative
error is returned, and it is zero for any model that came from Hugging Face and was acted on by
symmetries only.
"""

from fedlmc.hf.adapter import HFAdapter, recognise
from fedlmc.hf.convert import Logits, config_of, family_of, from_hf, hf_model_for, hf_state, is_tied, load_hf, to_hf

__all__ = [
    "from_hf",
    "to_hf",
    "hf_state",
    "hf_model_for",
    "load_hf",
    "config_of",
    "family_of",
    "is_tied",
    "Logits",
    "HFAdapter",
    "recognise",
]
