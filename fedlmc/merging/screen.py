"""Screening replies modulo symmetries: which replies are outliers once aligned.

Two replies trained from different starts, or with their neurons in another order, are far apart in raw
coordinates whatever they compute, so a distance-based defence (Krum, a distance to the median) cannot
tell a poisoned reply from an honest one there. After alignment to the universe the replies share one
coordinate system and distances between them mean something. ``screen`` scores each aligned reply and
names the ones to exclude (``fedlmc.options.Screen`` says how); ``AlignedFedAvg(screen=...)`` then
merges again without them, with the round's ``reduce``.

``krum_scores`` and ``multikrum_selection`` are Krum's score and Multi-Krum's selection on any list of
state dicts: on aligned replies here, and on raw replies for Flower's ``Krum`` / ``MultiKrum`` baselines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from fedlmc.merging.averaging import robust_state
from fedlmc.options import PREDICTION_SCREENS, Screen

StateDict = dict[str, torch.Tensor]


@dataclass
class Screening:
    """What ``screen`` found: each reply's score (higher: more of an outlier), the replies to exclude
    (index → the reason, for the log), and the method."""

    method: str
    scores: list[float]
    excluded: dict[int, str] = field(default_factory=dict)
    values: Optional[list[float]] = None  # the statistic the scores were computed from (distance, loss, ...)


def squared_distances(states: Sequence[StateDict]) -> torch.Tensor:
    """(M, M) squared Euclidean distances between flattened state dicts (float64, one tensor at a time)."""
    M = len(states)
    D = torch.zeros(M, M, dtype=torch.float64)
    for name in states[0]:
        X = torch.stack([s[name].detach().reshape(-1).to(torch.float64) for s in states])
        G = X @ X.T
        n = G.diagonal()
        D += (n[:, None] + n[None, :] - 2 * G).clamp_min(0)
    D.fill_diagonal_(0)
    return D


def median_distances(states: Sequence[StateDict]) -> torch.Tensor:
    """(M,) each state dict's Euclidean distance to the coordinate-wise median of all of them
    (``averaging.robust_state``)."""
    med = robust_state(states, "median")
    d2 = torch.zeros(len(states), dtype=torch.float64)
    for name, m in med.items():
        m = m.detach().to(torch.float64)
        for i, s in enumerate(states):
            d2[i] += float(((s[name].detach().to(torch.float64) - m) ** 2).sum())
    return d2.sqrt()


def agreement(predictions: Sequence[torch.Tensor]) -> torch.Tensor:
    """(M,) each reply's mean agreement with the others: the fraction of held-out inputs on which its
    top-1 prediction equals another reply's, averaged over the others (``train.predictions``)."""
    P = torch.stack([p.reshape(-1) for p in predictions])
    M = P.shape[0]
    if M < 2:
        return torch.ones(M, dtype=torch.float64)
    same = torch.stack([(P == P[i]).to(torch.float64).mean(dim=1) for i in range(M)])  # (M, M), diagonal 1
    return (same.sum(dim=1) - 1) / (M - 1)


def mutual_information(a: torch.Tensor, b: torch.Tensor, shuffles: int = 2) -> float:
    """Normalised mutual information of two label sequences, adjusted for chance: ``(I − I₀) / (√(H(a)
    H(b)) − I₀)``, clipped to [0, 1] (0 when either is constant), with I₀ the mutual information of a
    with ``shuffles`` seeded shuffles of b. How much knowing one reply's predictions tells about the
    other's, whatever the classes are called. The plug-in estimate of I alone is biased upwards by about
    (classes²) / (2 · inputs); with many classes (a token vocabulary) it would be near H itself, which
    the chance term removes. Counts only the label pairs that occur, so a 50k-token vocabulary is fine."""
    a, b = a.reshape(-1).long(), b.reshape(-1).long()
    n = len(a)
    if n == 0:
        return 0.0

    def entropy(counts: torch.Tensor) -> torch.Tensor:
        p = counts.to(torch.float64) / n
        return -(p * p.log()).sum()

    def joint(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return entropy(torch.unique(torch.stack([x, y]), dim=1, return_counts=True)[1])

    ha, hb = entropy(torch.unique(a, return_counts=True)[1]), entropy(torch.unique(b, return_counts=True)[1])
    if float(ha) <= 1e-12 or float(hb) <= 1e-12:
        return 0.0
    mi = ha + hb - joint(a, b)
    g = torch.Generator().manual_seed(0)
    chance = sum(ha + hb - joint(a, b[torch.randperm(n, generator=g)]) for _ in range(shuffles)) / max(shuffles, 1)
    top = (ha * hb).sqrt()
    if float(top - chance) <= 1e-12:
        return 0.0
    return float(((mi - chance) / (top - chance)).clamp(0.0, 1.0))


def information(predictions: Sequence[torch.Tensor]) -> torch.Tensor:
    """(M,) each reply's mean chance-adjusted normalised mutual information with the others' top-1
    predictions (``mutual_information``). Replies trained on different classes disagree on labels, but an honest
    reply still sorts the inputs as the others do (it may call a 3 a 5, but it calls every 3 a 5);
    one that learned nothing about the inputs' classes tells nothing about the others' predictions."""
    M = len(predictions)
    if M < 2:
        return torch.ones(M, dtype=torch.float64)
    I = torch.eye(M, dtype=torch.float64)
    for i in range(M):
        for j in range(i + 1, M):
            I[i, j] = I[j, i] = mutual_information(predictions[i], predictions[j])
    return (I.sum(dim=1) - 1) / (M - 1)


def krum_scores(D: torch.Tensor, malicious: int) -> torch.Tensor:
    """Krum's score of each reply: the sum of its squared distances to its M − f − 2 nearest others."""
    M = D.shape[0]
    k = M - malicious - 2
    if k < 1:
        raise ValueError(f"Krum needs more than f + 2 replies: {M} replies, f = {malicious}")
    others = D + torch.diag(torch.full((M,), float("inf"), dtype=D.dtype))
    return others.sort(dim=1).values[:, :k].sum(dim=1)


def multikrum_selection(D: torch.Tensor, malicious: int, select: int) -> list[int]:
    """Multi-Krum's choice: the ``select`` replies with the lowest Krum scores (Krum: ``select=1``)."""
    scores = krum_scores(D, malicious)
    return sorted(int(i) for i in scores.argsort()[:select])


def robust_outliers(values: torch.Tensor, threshold: float) -> tuple[torch.Tensor, list[int]]:
    """Robust z-scores, (v − median v) / max(1.4826 MAD, 0.1 |median v|), and the indices above
    ``threshold``, highest first: at most (M − 1) // 2 of them, so a majority is always kept."""
    values = values.to(torch.float64)
    centre = values.median()
    spread = torch.maximum(1.4826 * (values - centre).abs().median(), 0.1 * centre.abs()).clamp_min(1e-12)
    z = (values - centre) / spread
    flagged = [i for i in z.argsort(descending=True).tolist() if z[i] > threshold][: (len(values) - 1) // 2]
    return z, flagged


def screen(
    states: Sequence[StateDict],
    options: Screen,
    losses: Optional[Sequence[float]] = None,
    predictions: Optional[Sequence[torch.Tensor]] = None,
) -> Screening:
    """Score aligned replies (state dicts in one coordinate system) and name the outliers to exclude.

    "distance": each reply's distance to the coordinate-wise median; a reply is excluded when its robust
    z-score, (d − median d) / max(1.4826 MAD, 0.1 median d), exceeds ``options.threshold``. At most
    (M − 1) // 2 replies are excluded (the farthest), so a majority is always kept. "loss": the same
    robust z-score on ``losses``, each reply's loss on held-out data; "agreement": on each reply's
    agreement with the others' ``predictions`` on held-out inputs, a low agreement being the outlier;
    "information": on each reply's chance-adjusted mutual information with the others' ``predictions``
    (``information``), a low one being the outlier (none of these three reads ``states``). "krum":
    the ``options.malicious`` replies with the highest Krum scores.
    """
    M = len(next(x for x in (losses, predictions, states) if x is not None))
    if options.method == "krum":
        if M - options.malicious - 2 < 1:  # too few replies for Krum's score: exclude nothing
            return Screening("krum", [0.0] * M)
        scores = krum_scores(squared_distances(states), options.malicious)
        worst = scores.argsort(descending=True)[: options.malicious].tolist()
        out = Screening("krum", scores.tolist())
        for i in worst:
            out.excluded[i] = f"Krum score {scores[i]:.4g} among the {options.malicious} highest of {M} aligned replies"
        return out
    if options.method == "loss":
        if losses is None:
            raise ValueError("the loss screen needs each reply's held-out loss (losses=...)")
        values, what = torch.tensor([float(x) for x in losses], dtype=torch.float64), "held-out loss"
    elif options.method in PREDICTION_SCREENS:
        if predictions is None:
            raise ValueError(f"the {options.method} screen needs each reply's held-out predictions (predictions=...)")
        values = (agreement if options.method == "agreement" else information)(predictions)
        z, flagged = robust_outliers(-values, options.threshold)  # the outlier agrees (informs) least
        out = Screening(options.method, z.tolist(), values=values.tolist())
        what = (
            "agrees with the others' predictions on {v:.1%} of held-out inputs"
            if options.method == "agreement"
            else "shares {v:.3f} normalised mutual information with the others' predictions"
        )
        for i in flagged:
            out.excluded[i] = (
                what.format(v=float(values[i])) + f", {z[i]:.1f} robust deviations below the others' (median "
                f"{float(values.median()):.3g}; threshold {options.threshold:g})"
            )
        return out
    else:
        values, what = median_distances(states), "aligned distance to the median"
    z, flagged = robust_outliers(values, options.threshold)
    centre = values.median()
    out = Screening(options.method, z.tolist(), values=values.tolist())
    for i in flagged:
        out.excluded[i] = (
            f"{what} {values[i]:.4g} is {z[i]:.1f} robust deviations above the others' "
            f"(median {centre:.4g}; threshold {options.threshold:g})"
        )
    return out
