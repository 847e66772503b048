"""Local training and evaluation: AdamW, cosine schedule with linear warmup, seeded init and data order."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedlmc.data import Data, Splits, TokenData
from fedlmc.models import from_preset


def pick_device(device: Optional[str] = None) -> torch.device:
    """``device`` if given, else CUDA when present, else CPU."""
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def loss_and_correct(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and the number of correct argmax predictions (sequence or class logits).
    Floating-point ``y`` of the logits' shape are soft targets (a distribution per prediction, as a
    teacher's in distillation): the cross-entropy to them, and agreement with their argmax."""
    logits = logits.reshape(-1, logits.shape[-1])
    if y.is_floating_point():
        y = y.reshape(-1, logits.shape[-1])
        return F.cross_entropy(logits, y), (logits.argmax(-1) == y.argmax(-1)).sum()
    y = y.reshape(-1)
    return F.cross_entropy(logits, y), (logits.argmax(-1) == y).sum()


LOGITS_BUDGET = 1 << 26  # 64M floats: 256 MB of logits per evaluation batch


def _vocab_size(model: nn.Module) -> Optional[int]:
    for m in (model, getattr(model, "hf", None)):
        v = getattr(getattr(m, "config", None), "vocab_size", None)
        if isinstance(v, int):
            return v
    return None


@torch.no_grad()
def _logits(
    model: nn.Module, data: Data, batch_size: int, device: Optional[str], max_batches: Optional[int]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each batch's logits and targets, in eval mode (the model's mode restored after). For text the
    batch is capped so that one batch's logits stay under ``LOGITS_BUDGET`` numbers."""
    dev = pick_device(device) if device is not None else next(model.parameters()).device
    vocab = _vocab_size(model)
    if isinstance(data, TokenData) and vocab:
        batch_size = max(1, min(batch_size, LOGITS_BUDGET // (data.block_size * vocab)))
    was = model.training
    model.eval()
    try:
        for i, (x, y) in enumerate(data.batches(batch_size)):
            if max_batches is not None and i >= max_batches:
                break
            x, y = x.to(dev), y.to(dev)
            if x.is_floating_point():
                x = x.to(next(model.parameters()).dtype)
            yield model(x), y
    finally:
        model.train(was)


@torch.no_grad()
def evaluate(
    model: nn.Module, data: Data, batch_size: int = 256, device: Optional[str] = None, max_batches: Optional[int] = None
) -> dict[str, float]:
    """Mean loss and accuracy over ``data`` (next-token accuracy for text), in eval mode. For text the
    batch is capped so that one batch's logits stay under ``LOGITS_BUDGET`` numbers (256 windows of 1024
    tokens over GPT-2's 50257-token vocabulary would be 52 GB)."""
    total, correct, n = 0.0, 0, 0
    for logits, y in _logits(model, data, batch_size, device, max_batches):
        loss, c = loss_and_correct(logits, y)
        k = y.numel()
        total += float(loss) * k
        correct += int(c)
        n += k
    if n == 0:
        raise ValueError("evaluate() got an empty data set")
    return {"loss": total / n, "acc": correct / n}


@torch.no_grad()
def predictions(
    model: nn.Module, data: Data, batch_size: int = 256, device: Optional[str] = None, max_batches: Optional[int] = None
) -> torch.Tensor:
    """The model's top-1 prediction for every example (every token, for text) of ``data``'s first
    ``max_batches`` batches, flattened, on the CPU (labels are not read)."""
    out = [logits.argmax(-1).reshape(-1).cpu() for logits, _ in _logits(model, data, batch_size, device, max_batches)]
    if not out:
        raise ValueError("predictions() got an empty data set")
    return torch.cat(out)


@dataclass
class TrainConfig:
    """How to train. Give ``steps`` or ``epochs`` (an epoch is one pass over ``len(data)`` examples)."""

    steps: Optional[int] = None
    epochs: Optional[float] = None
    lr: float = 1e-3
    weight_decay: float = 0.01
    batch_size: int = 64
    warmup: float = 0.05  # fraction of steps
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 0  # steps; 0 = only at the end
    keep_best: bool = False  # with val and eval_every: end with the weights of the best validation loss
    device: Optional[str] = None
    proximal_mu: float = 0.0  # FedProx: adds mu / 2 · ‖w − w_start‖² to the loss (0: nothing is added)
    # "adamw" (AdamW, warmup and cosine decay, gradient clipping) or "sgd": plain SGD at a constant ``lr``,
    # no momentum, weight decay or clipping (the local solver of FedAvg's and SCAFFOLD's papers)
    optimizer: str = "adamw"

    def total_steps(self, data: Data) -> int:
        per_epoch = max(
            1,
            math.ceil(len(data) / self.batch_size) if not isinstance(data, TokenData) else len(data) // self.batch_size,
        )
        if self.steps:
            return int(self.steps)
        if self.epochs:
            return max(1, int(round(self.epochs * per_epoch)))
        raise ValueError("TrainConfig needs steps or epochs")


# Budgets that train the presets usefully on 2 CPU cores (overridable from the CLI).
TRAIN_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2-tiny": dict(steps=4000, lr=2e-3, batch_size=64),
    "gpt2-shakespeare": dict(steps=5000, lr=1e-3, batch_size=64),
    "gpt2-small": dict(steps=1000, lr=3e-4, batch_size=16),
    "llama-tiny": dict(steps=4000, lr=2e-3, batch_size=64),
    "vit-tiny": dict(epochs=15, lr=2e-3, batch_size=64),
    "vit-cifar": dict(epochs=50, lr=1e-3, batch_size=128),
    "vit-digits": dict(epochs=30, lr=3e-3, batch_size=32),
}


def cosine_lr(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def _progress(enabled: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
        transient=False,
    )


def proximal_term(model: nn.Module, anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's proximal term, ``mu / 2 · ‖w − w_start‖²`` over every parameter."""
    return 0.5 * mu * sum((p - a).pow(2).sum() for p, a in zip(model.parameters(), anchor))


OPTIMIZERS = ("adamw", "sgd")


def local_optimizer(model: nn.Module, cfg: TrainConfig, total: int, warmup: int):
    """``cfg.optimizer`` over ``model``'s parameters and its schedule (None: a constant learning rate)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr), None
    if cfg.optimizer != "adamw":
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_lr(s, total, warmup))


def train(
    model: nn.Module,
    data: Data,
    cfg: TrainConfig,
    val: Optional[Data] = None,
    progress: bool = True,
    desc: str = "train",
    on_eval: Optional[Callable[[int, dict], None]] = None,
) -> dict[str, Any]:
    """Train ``model`` in place on ``data``; returns a history (losses, evaluations, seconds)."""
    if cfg.keep_best and (val is None or not cfg.eval_every):
        raise ValueError("keep_best keeps the best of the evaluations: give val and eval_every")
    dev = pick_device(cfg.device)
    model.to(dev).train()
    total = cfg.total_steps(data)
    warmup = max(1, int(cfg.warmup * total))
    opt, sched = local_optimizer(model, cfg, total, warmup)
    clip = cfg.grad_clip if cfg.optimizer == "adamw" else 0.0
    gen = torch.Generator().manual_seed(cfg.seed)
    anchor = [p.detach().clone() for p in model.parameters()] if cfg.proximal_mu > 0 else None
    hist: dict[str, Any] = {"train_loss": [], "evals": [], "steps": total}
    t0, step, running = time.time(), 0, None
    best: Optional[tuple[dict, dict]] = None  # keep_best: the best evaluation and its weights
    with _progress(progress) as bar:
        task = bar.add_task(desc, total=total, info="")
        while step < total:
            for x, y in data.batches(cfg.batch_size, shuffle=True, generator=gen):
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                loss, _ = loss_and_correct(model(x), y)
                if anchor is not None:
                    loss = loss + proximal_term(model, anchor, cfg.proximal_mu)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                if sched is not None:
                    sched.step()
                step += 1
                # the running loss stays on the device: reading it every step would wait for the GPU
                lv = loss.detach()
                running = lv if running is None else 0.95 * running + 0.05 * lv
                if step % 50 == 0 or step == total:
                    hist["train_loss"].append((step, float(lv)))
                    bar.update(task, completed=step, info=f"loss {float(running):.3f}")
                if val is not None and cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                    ev = {"step": step, **evaluate(model, val)}
                    hist["evals"].append(ev)
                    best = _keep(model, ev, best) if cfg.keep_best else best
                    if on_eval:
                        on_eval(step, ev)
                if step >= total:
                    break
    if val is not None:
        ev = {"step": step, **evaluate(model, val)}
        hist["evals"].append(ev)
        if on_eval:
            on_eval(step, ev)
        if cfg.keep_best and best is not None and best[0]["loss"] < ev["loss"]:  # early stopping
            model.load_state_dict(best[1])
        if cfg.keep_best:
            hist["best"] = min(hist["evals"], key=lambda e: e["loss"])
    hist["seconds"] = time.time() - t0
    model.eval()
    return hist


def _keep(model: nn.Module, ev: dict, best: Optional[tuple[dict, dict]]) -> Optional[tuple[dict, dict]]:
    """``best`` updated with ``ev`` (an evaluation of ``model`` now) if its loss is lower: the weights copied."""
    if best is None or ev["loss"] < best[0]["loss"]:
        return ev, {k: v.detach().clone() for k, v in model.state_dict().items()}
    return best


def train_config_for(preset: str, seed: int = 0, **overrides: Any) -> TrainConfig:
    """The preset's default budget (``TRAIN_DEFAULTS``) with ``overrides`` (None values ignored)."""
    base = dict(TRAIN_DEFAULTS.get(preset, dict(epochs=5)))
    over = {k: v for k, v in overrides.items() if v is not None}
    if "steps" in over:
        base.pop("epochs", None)
    if "epochs" in over:
        base.pop("steps", None)
    return TrainConfig(seed=seed, **{**base, **over})


def model_for_data(preset: str, splits: Splits, seed: int, **overrides: Any) -> nn.Module:
    """Preset ``preset`` initialised from ``seed``, shaped to the data (vocabulary, channels, image size)."""
    fit: dict[str, Any] = {}
    if "vocab_size" in splits.meta:
        fit["vocab_size"] = splits.meta["vocab_size"]
    if "channels" in splits.meta:
        fit.update(
            channels=splits.meta["channels"],
            image_size=splits.meta["image_size"],
            num_classes=splits.meta["num_classes"],
        )
    torch.manual_seed(seed)
    model = from_preset(preset, **{**fit, **overrides})
    model.meta = {
        "preset": preset,
        "dataset": splits.name,
        "seed": seed,
        **{k: v for k, v in splits.meta.items() if k in ("chars", "block_size", "source")},
    }
    return model


def train_preset(
    preset: str,
    splits: Splits,
    seed: int = 0,
    progress: bool = True,
    model_overrides: Optional[dict[str, Any]] = None,
    **overrides: Any,
) -> tuple[nn.Module, dict]:
    """Initialise preset ``preset`` from ``seed`` and train it on ``splits.train``; evaluate on test.

    ``model_overrides`` change the architecture (e.g. ``{"d_model": 64}``), ``overrides`` the budget."""
    model = model_for_data(preset, splits, seed, **(model_overrides or {}))
    cfg = train_config_for(preset, seed, **overrides)
    hist = train(model, splits.train, cfg, val=splits.val, progress=progress, desc=f"{preset} seed {seed}")
    hist["test"] = evaluate(model, splits.test)
    hist["train_config"] = asdict(cfg)
    model.meta.update(test=hist["test"], seconds=hist["seconds"], steps=hist["steps"])
    if "best" in hist:  # keep_best: the validation evaluation whose weights were kept
        model.meta["best"] = hist["best"]
    return model, hist
