"""flowertune-template: A Flower / FlowerTune app."""

import math

from omegaconf import DictConfig
from peft import LoraConfig, get_peft_model

from fedlmc.hf.pretrained import pretrained_base


def cosine_annealing(
    current_round: int,
    total_round: int,
    lrate_max: float = 0.001,
    lrate_min: float = 0.0,
) -> float:
    """Implement cosine annealing learning rate schedule."""
    cos_inner = math.pi * current_round / total_round
    return lrate_min + 0.5 * (lrate_max - lrate_min) * (1 + math.cos(cos_inner))


def get_model(model_cfg: DictConfig):
    """The model with its LoRA adapter.

    Trimmed: the template loads ``model.name`` from the hub, 4- or 8-bit quantised (bitsandbytes, a GPU);
    here a tiny GPT-2 pretrained locally on the first half of the shipped Tiny Shakespeare (cached), in
    full precision. The LoRA config is the template's (PEFT's default targets: GPT-2's ``c_attn``).
    """
    model = pretrained_base("gpt2", steps=int(model_cfg.base_steps), progress=False)
    peft_config = LoraConfig(
        r=model_cfg.lora.peft_lora_r,
        lora_alpha=model_cfg.lora.peft_lora_alpha,
        lora_dropout=0.075,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_config)
