"""Data: where it lives, the loaders, and federated partitions.

Search order for a data directory: the explicit ``data_dir`` (``--data-dir``, run_config
``data-dir``), then ``$FEDLMC_DATA``, and last the data that ships with the package (``fedlmc/data/``:
Tiny Shakespeare, public domain; scikit-learn's digits come with scikit-learn). MNIST and CIFAR-10
do not ship: they are looked for, with one clear error naming every place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from fedlmc.data.base import ArrayData, Data, DataNotFound, Splits, TokenData, split
from fedlmc.data.images import load_cifar10, load_digits, load_mnist, read_idx
from fedlmc.data.partition import partition, partition_indices
from fedlmc.data.text import CharTokenizer, find_shakespeare, load_text

DATASETS = ("digits", "mnist", "cifar10", "shakespeare", "text")
PACKAGED = Path(__file__).resolve().parent  # tinyshakespeare.txt ships here


def search_dirs(data_dir: Union[str, Path, None] = None) -> list[Path]:
    """The directories a loader looks in, in order."""
    dirs: list[Path] = []
    if data_dir:
        dirs.append(Path(data_dir).expanduser())
    if os.environ.get("FEDLMC_DATA"):
        dirs.append(Path(os.environ["FEDLMC_DATA"]).expanduser())
    dirs.append(PACKAGED)
    return list(dict.fromkeys(dirs))


def load(
    name: str,
    data_dir: Union[str, Path, None] = None,
    block_size: int = 64,
    seed: int = 0,
    text_file: Union[str, Path, None] = None,
) -> Splits:
    """Load dataset ``name`` (one of ``DATASETS``) as train/val/test ``Splits``.

    ``text`` reads ``text_file`` (any UTF-8 file). Raises ``DataNotFound`` with every place looked.
    """
    dirs = search_dirs(data_dir)
    if name == "digits":
        return load_digits(seed=seed)
    if name == "mnist":
        return load_mnist(dirs, seed=seed)
    if name == "cifar10":
        return load_cifar10(dirs, seed=seed)
    if name == "shakespeare":
        return load_text(find_shakespeare(dirs), block_size, name="shakespeare")
    if name == "text":
        if text_file is None or not Path(text_file).is_file():
            raise DataNotFound("text", [Path(text_file or "<none given>")], "pass --text FILE with a UTF-8 text file")
        return load_text(Path(text_file), block_size)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


__all__ = [
    "ArrayData",
    "TokenData",
    "Splits",
    "Data",
    "DataNotFound",
    "DATASETS",
    "load",
    "search_dirs",
    "partition",
    "partition_indices",
    "CharTokenizer",
    "read_idx",
    "split",
]
