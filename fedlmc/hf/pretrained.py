"""A "pretrained" Hugging Face base for LoRA fine-tuning, pretrained locally on the shipped Tiny
Shakespeare (no hub is reachable): a tiny GPT-2 or Llama-style causal LM trained on the first part of
the training text, while the LoRA federations fine-tune on the rest, partitioned among clients.

Every party that calls ``pretrained_base`` with the same arguments gets the same weights: the training
is seeded and the result is cached as safetensors (``$FEDLMC_CACHE``, default ``~/.cache/fedlmc``),
written atomically, so concurrent clients of one machine share one copy.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F

from fedlmc import provenance
from fedlmc.data import TokenData, load, partition, split

FAMILIES = ("gpt2", "llama")
PRETRAIN_FRACTION = 0.5  # the first half of the training text pretrains the base; the rest is fine-tuned


def tiny_causal_lm(family: str, vocab_size: int = 65, block_size: int = 64, seed: int = 0):
    """A tiny ``GPT2LMHeadModel`` (d 64, 2 layers, 4 heads) or ``LlamaForCausalLM`` (d 64, 2 layers,
    4 heads, FF 172), freshly initialised with ``seed``."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = GPT2Config(
            vocab_size=vocab_size,
            n_positions=block_size,
            n_embd=64,
            n_layer=2,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(cfg)
    if family == "llama":
        cfg = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=block_size,
            bos_token_id=0,
            eos_token_id=0,
        )
        return LlamaForCausalLM(cfg)
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-character cross-entropy of a Hugging Face causal LM (``y`` is ``x`` shifted by one)."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train_lm(
    model,
    data: TokenData,
    steps: int,
    *,
    lr: float,
    batch_size: int,
    seed: int,
    params=None,
    one_cycle: bool = False,
    on_step=None,
    optimizer_state: Optional[dict] = None,
) -> float:
    """``steps`` AdamW steps (no weight decay) of next-character loss on shuffled windows of ``data``,
    on ``params`` (default: all of the model's), with a one-cycle schedule if asked; ``on_step(step,
    loss)`` after each. ``optimizer_state``: a dict holding the AdamW state under ``"adamw"`` from an
    earlier call (loaded if there, updated after): a client whose optimiser lives on across rounds.
    Returns the last batch's loss."""
    opt = torch.optim.AdamW(model.parameters() if params is None else params, lr=lr, weight_decay=0.0)
    if optimizer_state is not None:
        if "adamw" in optimizer_state:
            opt.load_state_dict(optimizer_state["adamw"])
        on_step = _saving(opt, optimizer_state, steps, on_step)
    sched = (
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05) if one_cycle else None
    )
    gen, done, last = torch.Generator().manual_seed(seed), 0, float("nan")
    model.train()
    while done < steps:
        for x, y in data.batches(batch_size, shuffle=True, generator=gen):
            loss = lm_loss(model, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            done, last = done + 1, float(loss.detach())
            if on_step is not None:
                on_step(done, last)
            if done == steps:
                return last
    return last


def _saving(opt, holder: dict, steps: int, on_step):
    """``on_step`` that also stores ``opt``'s state in ``holder["adamw"]`` after the last step."""

    def step(done: int, loss: float) -> None:
        if done == steps:
            holder["adamw"] = copy.deepcopy(opt.state_dict())
        if on_step is not None:
            on_step(done, loss)

    return step


def pretrain_and_finetune_text(data_dir: Union[str, Path, None] = None) -> tuple[TokenData, TokenData, TokenData]:
    """Tiny Shakespeare's training text cut in two (with its speeches: the fine-tuning part can be
    partitioned by speaker), and the test split."""
    splits = load("shakespeare", data_dir)
    head, tail = split(splits.train, PRETRAIN_FRACTION)
    return head, tail, splits.test


def finetune_partitions(num_partitions: int, scheme: str = "speaker", seed: int = 0, data_dir=None) -> list[TokenData]:
    """The fine-tuning text dealt out to ``num_partitions`` clients (``iid``, ``speaker``...)."""
    return partition(pretrain_and_finetune_text(data_dir)[1], num_partitions, scheme, seed=seed)


def cache_dir() -> Path:
    return Path(os.environ.get("FEDLMC_CACHE", Path.home() / ".cache" / "fedlmc")).expanduser()


def pretrained_base(
    family: str = "gpt2",
    steps: int = 1500,
    seed: int = 0,
    lr: float = 3e-3,
    batch_size: int = 32,
    data_dir=None,
    cache: Optional[Path] = None,
    progress: bool = True,
):
    """The tiny ``family`` model pretrained for ``steps`` on the first half of Tiny Shakespeare's
    training text (AdamW, cosine schedule), from the cache when it is there."""
    from safetensors.torch import load_file, save_file

    model = tiny_causal_lm(family, seed=seed)
    code = provenance.code_hash(provenance.TRAINING_CODE + ("fedlmc/hf",))[:10]  # what trained it
    path = (cache or cache_dir()) / f"base-{family}-{steps}-{seed}-{lr}-{batch_size}-{code}.safetensors"
    if path.is_file():
        provenance.reused(path)
        model.load_state_dict(load_file(str(path)), strict=False)  # a tied head is stored once
        return model.eval()
    text, _, _ = pretrain_and_finetune_text(data_dir)
    t0 = time.perf_counter()

    def report(done: int, loss: float) -> None:
        if progress and (done % 250 == 0 or done == steps):
            print(f"pretraining the {family} base: step {done}/{steps} loss {loss:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip

    train_lm(model, text, steps, lr=lr, batch_size=batch_size, seed=seed, one_cycle=True, on_step=report)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp))
    os.replace(tmp, path)
    return model.eval()


@torch.no_grad()
def test_loss(model, data: TokenData, batches: int = 8, batch_size: int = 64) -> float:
    """Mean next-character loss on the first ``batches`` batches of ``data`` (in order)."""
    model.eval()
    losses = [float(lm_loss(model, x, y)) for _, (x, y) in zip(range(batches), data.batches(batch_size))]
    return sum(losses) / len(losses)
