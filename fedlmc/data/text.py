"""Character-level text: Tiny Shakespeare or any plain-text file, split contiguously 90/5/5."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from fedlmc.data.base import DataNotFound, Splits, TokenData, Units


class CharTokenizer:
    """Sorted unique characters of the whole corpus (so every split and client shares one vocabulary)."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]*[A-Za-z]):$")  # a play's speech heading, e.g. "KING RICHARD III:"


def speeches(text: str) -> Units:
    """The text cut at blank lines into speeches (a block whose first line is a heading like
    ``MENENIUS:``, labelled with that character, as LEAF's Shakespeare benchmark does) or paragraphs
    (label ""). Each unit keeps its trailing blank lines, so the units tile the text. Character-level
    tokens, so the character offsets are token offsets."""
    starts = [0] + [m.end() for m in re.finditer(r"\n\s*\n", text)]
    starts = [s for s in starts if s < len(text)]
    ends = starts[1:] + [len(text)]
    labels = []
    for a in starts:
        first = text[a : text.find("\n", a) if "\n" in text[a:] else len(text)].strip()
        m = SPEAKER.match(first)
        labels.append(m.group(1).upper() if m else "")
    return Units(np.asarray(starts), np.asarray(ends), labels)


def load_text(path: Path, block_size: int = 64, name: str | None = None) -> Splits:
    """Contiguous 90/5/5 train/val/test windows of ``block_size`` characters from a UTF-8 text file,
    each split with its speeches or paragraphs (``speeches``) for partitioning."""
    text = Path(path).read_text(encoding="utf-8")
    if len(text) < 20 * (block_size + 1):
        raise ValueError(f"{path} holds {len(text)} characters: too little for block_size {block_size}")
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    n = len(ids)
    a, b = int(0.9 * n), int(0.95 * n)
    units = speeches(text)
    parts = [TokenData(ids[lo:hi], block_size, units.within(lo, hi)) for lo, hi in ((0, a), (a, b), (b, n))]
    return Splits(
        name or Path(path).stem,
        *parts,
        meta={"vocab_size": tok.vocab_size, "chars": "".join(tok.chars), "block_size": block_size, "source": str(path)},
    )


def find_shakespeare(dirs: list[Path]) -> Path:
    cands = [p for d in dirs for p in (d / "tinyshakespeare.txt", d / "shakespeare" / "input.txt", d / "input.txt")]
    for c in cands:
        if c.is_file():
            return c
    raise DataNotFound(
        "Tiny Shakespeare",
        [c.parent for c in cands],
        "put tinyshakespeare.txt (the char-rnn corpus) in <data-dir>, or pass --text FILE",
    )
