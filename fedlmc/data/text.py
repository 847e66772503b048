"""Character-level text: Tiny Shakespeare or any plain-text file, split contiguously 90/5/5."""
from __future__ import annotations

from pathlib import Path

import torch

from .base import DataNotFound, Splits, TokenData


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


def load_text(path: Path, block_size: int = 64, name: str | None = None) -> Splits:
    """Contiguous 90/5/5 train/val/test windows of ``block_size`` characters from a UTF-8 text file."""
    text = Path(path).read_text(encoding="utf-8")
    if len(text) < 20 * (block_size + 1):
        raise ValueError(f"{path} holds {len(text)} characters: too little for block_size {block_size}")
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    n = len(ids)
    a, b = int(0.9 * n), int(0.95 * n)
    parts = [TokenData(ids[s], block_size) for s in (slice(0, a), slice(a, b), slice(b, n))]
    return Splits(name or Path(path).stem, *parts, meta={"vocab_size": tok.vocab_size, "chars": "".join(tok.chars),
                                                        "block_size": block_size, "source": str(path)})


def find_shakespeare(dirs: list[Path]) -> Path:
    cands = [p for d in dirs for p in (d / "tinyshakespeare.txt", d / "shakespeare" / "input.txt", d / "input.txt")]
    for c in cands:
        if c.is_file():
            return c
    raise DataNotFound("Tiny Shakespeare", [c.parent for c in cands],
                       "put tinyshakespeare.txt (the char-rnn corpus) in <data-dir>, or pass --text FILE")
