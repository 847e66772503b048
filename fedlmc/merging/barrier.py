"""Interpolation curves and loss barriers (the paper's protocol: λ = 0, 0.1, ..., 1 on the test split)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from fedlmc.data import Data
from fedlmc.merging.averaging import interpolate as interpolate_models
from fedlmc.train import evaluate

LAMBDAS = tuple(round(0.1 * i, 10) for i in range(11))


@dataclass
class Curve:
    """Loss and accuracy of the interpolated model at each λ (λ = 1 is model A, λ = 0 is model B)."""

    lambdas: list[float]
    loss: list[float]
    acc: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


def interpolation_curve(
    model_a: nn.Module,
    model_b: nn.Module,
    data: Data,
    lambdas: Sequence[float] = LAMBDAS,
    interpolate: Optional[Callable[[nn.Module, nn.Module, float], nn.Module]] = None,
    batch_size: int = 256,
    max_batches: Optional[int] = None,
    device: Union[str, torch.device, None] = None,
) -> Curve:
    """Evaluate the interpolated model at every λ. ``interpolate`` defaults to ``fedlmc.merging.averaging.interpolate``
    (plain weight averaging for two LayerNorm models); pass e.g. ``partial(interpolate, form="circuit")``.
    ``device``: where each interpolated model is evaluated (it is moved there); default, where it was built."""
    interpolate = interpolate or interpolate_models
    losses, accs = [], []
    for lam in lambdas:
        model = interpolate(model_a, model_b, float(lam))
        if device is not None:
            model = model.to(device)
        ev = evaluate(model, data, batch_size, max_batches=max_batches)
        losses.append(ev["loss"])
        accs.append(ev["acc"])
    return Curve([float(l) for l in lambdas], losses, accs)


def barrier(curve: Curve) -> float:
    """``max_λ L(λ) − (λ·L_A + (1−λ)·L_B)`` with L_A = L(λ=1), L_B = L(λ=0)."""
    lam = torch.tensor(curve.lambdas)
    loss = torch.tensor(curve.loss)
    la, lb = loss[lam.argmax()], loss[lam.argmin()]
    return float((loss - (lam * la + (1 - lam) * lb)).max())


def plot_curves(curves: dict[str, Curve], path: Union[str, Path], title: str = "") -> Path:
    """Loss (and accuracy, when meaningful) against λ for several labelled curves, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = len(curves) > 3
    rows = (len(curves) + 1) // 2
    height = 4 + 0.22 * rows if many else 4
    fig, axes = plt.subplots(1, 2, figsize=(11, height))
    for label, c in curves.items():
        axes[0].plot(c.lambdas, c.loss, marker="o", ms=3, label=f"{label} (barrier {barrier(c):.3f})")
        axes[1].plot(c.lambdas, c.acc, marker="o", ms=3)
    axes[0].set(xlabel="λ  (0 = model B, 1 = model A)", ylabel="test loss", title=title or "interpolation")
    axes[1].set(xlabel="λ", ylabel="test accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
    if many:  # one legend under both panels, so it never hides the curves
        fig.legend(loc="lower center", ncol=2, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, (0.22 * rows + 0.15) / height, 1, 1))
    else:
        axes[0].legend(fontsize=8)
        fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
