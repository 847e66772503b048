"""The model: a tiny Hugging Face GPT-2 pretrained locally on the first half of Tiny Shakespeare (no
hub), with PEFT LoRA adapters on its attention and FF projections (Conv1D: ``fan_in_fan_out``)."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from fedlmc.hf.pretrained import lm_loss, pretrained_base


def get_model(run_config):
    """The pretrained base (the same, cached, on every party) wrapped with a fresh LoRA adapter."""
    base = pretrained_base("gpt2", steps=int(run_config["base-steps"]), progress=False)
    cfg = LoraConfig(
        r=int(run_config["lora-r"]),
        lora_alpha=int(run_config["lora-alpha"]),
        target_modules=[t.strip() for t in str(run_config["lora-targets"]).split(",") if t.strip()],
        fan_in_fan_out=True,
        lora_dropout=0.0,
    )
    torch.manual_seed(int(run_config["seed"]))  # every party's initial adapter is the same
    return get_peft_model(base, cfg)


def train(model, data, steps: int, lr: float, batch_size: int, seed: int) -> float:
    """``steps`` AdamW steps on the adapter only; the last batch's loss."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    gen, done, loss = torch.Generator().manual_seed(seed), 0, torch.tensor(float("nan"))
    model.train()
    while done < steps:
        for x, y in data.batches(batch_size, shuffle=True, generator=gen):
            loss = lm_loss(model, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return float(loss)
