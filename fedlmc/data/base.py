"""Dataset containers shared by images and text: both expose ``len`` and ``batches(...)``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch


class DataNotFound(FileNotFoundError):
    """A dataset is not where we looked; the message names every place looked and how to provide it."""

    CLI = "then pass --data-dir DIR or set FEDLMC_DATA=DIR."
    FEDERATION = (
        "then set the run_config key data-dir to that directory, as an absolute path (the "
        "SuperLink resolves relative ones from its own working directory): "
        "flwr run . -c \"data-dir='/abs/path'\""
    )

    def __init__(self, what: str, looked: list, how: str, provide: str = CLI) -> None:
        places = "\n".join(f"  - {p}" for p in dict.fromkeys(str(p) for p in looked))
        self.what, self.looked, self.how = what, list(looked), how
        super().__init__(f"{what} not found. Looked in:\n{places}\nTo provide it: {how}; {provide}")

    def in_federation(self, flower_home: Path) -> "DataNotFound":
        """The same error told to someone running a Flower federation: the run_config key to set, and
        only the places that mean something to them (not the app's unpacked copy under Flower's home)."""
        looked = [p for p in self.looked if not str(Path(p).resolve()).startswith(str(flower_home.resolve()))]
        return DataNotFound(self.what, looked, self.how, self.FEDERATION)

    def __str__(self) -> str:
        return self.args[0]


@dataclass
class ArrayData:
    """Supervised examples ``x[i] -> y[i]`` held in memory (images: float ``(N,C,H,W)``, labels long)."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)

    @property
    def labels(self) -> torch.Tensor:
        return self.y

    def subset(self, idx: Union[torch.Tensor, list[int]]) -> "ArrayData":
        idx = torch.as_tensor(idx, dtype=torch.long)
        return ArrayData(self.x[idx], self.y[idx])

    def batches(
        self, batch_size: int, shuffle: bool = False, generator: Optional[torch.Generator] = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(self), generator=generator) if shuffle else torch.arange(len(self))
        for i in range(0, len(self), batch_size):
            j = order[i : i + batch_size]
            yield self.x[j], self.y[j]


@dataclass
class Units:
    """The text's natural pieces (a play's speeches, else paragraphs): token ranges ``[starts[i], ends[i])``
    and each one's label (the speaking character; "" when there is none). Partitions deal these out."""

    starts: np.ndarray
    ends: np.ndarray
    labels: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def within(self, a: int, b: int) -> "Units":
        """The units lying inside tokens ``[a, b)``, shifted so that ``a`` is 0."""
        keep = (self.starts >= a) & (self.ends <= b)
        return Units(self.starts[keep] - a, self.ends[keep] - a, [l for l, k in zip(self.labels, keep) if k])


@dataclass
class TokenData:
    """A token stream cut into windows of ``block_size`` (inputs) and the same shifted by one (targets).

    One epoch is ``len(self)`` windows: non-overlapping and in order when not shuffled (evaluation);
    at random offsets when shuffled (training), so every position is a possible window start.
    ``units``: the stream's speeches or paragraphs, which partitions other than contiguous deal out.
    """

    tokens: torch.Tensor
    block_size: int
    units: Optional[Units] = None

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def batches(
        self, batch_size: int, shuffle: bool = False, generator: Optional[torch.Generator] = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        T, n = self.block_size, len(self)
        if n == 0:
            return
        ar = torch.arange(T + 1)
        if shuffle:
            high = len(self.tokens) - T
            for _ in range(max(1, n // batch_size)):
                starts = torch.randint(0, high, (batch_size,), generator=generator)
                w = self.tokens[starts[:, None] + ar]
                yield w[:, :-1], w[:, 1:]
        else:
            starts = torch.arange(n) * T
            for i in range(0, n, batch_size):
                w = self.tokens[starts[i : i + batch_size, None] + ar]
                yield w[:, :-1], w[:, 1:]


Data = Union[ArrayData, TokenData]


def split(data: Data, fraction: float) -> tuple[Data, Data]:
    """The first ``fraction`` of a data set and the rest, disjoint (tokens of a stream, examples of
    arrays; in order, so the same call always gives the same parts)."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    if isinstance(data, TokenData):
        cut = int(len(data.tokens) * fraction)
        # each part keeps the speeches lying wholly inside it (for partitioning by speaker)
        head = data.units.within(0, cut) if data.units is not None else None
        tail = data.units.within(cut, len(data.tokens)) if data.units is not None else None
        return TokenData(data.tokens[:cut], data.block_size, head), TokenData(data.tokens[cut:], data.block_size, tail)
    if isinstance(data, ArrayData):
        cut = int(len(data) * fraction)
        return data.subset(list(range(cut))), data.subset(list(range(cut, len(data))))
    raise TypeError(f"cannot split {type(data).__name__}")


@dataclass
class Splits:
    """train / val / test of one dataset plus what a model needs to know about it (``meta``)."""

    name: str
    train: Data
    val: Data
    test: Data
    meta: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        return f"{self.name}: train {len(self.train)}, val {len(self.val)}, test {len(self.test)}"
