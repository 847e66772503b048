"""Image datasets: MNIST (idx files), scikit-learn digits (embedded), CIFAR-10 (python or binary batches).

Images are standardised with the training split's per-channel mean/std.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fedlmc.data.base import ArrayData, DataNotFound, Splits


def read_idx(path: Path) -> np.ndarray:
    """Read an idx file (``.gz`` or raw): magic, dims, then unsigned bytes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[:4], "big")
    if magic >> 8 != 0x08:  # 0x08 = unsigned byte data
        raise ValueError(f"{path} is not an idx ubyte file (magic {magic:#x})")
    ndim = magic & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {data.size} bytes")
    return data.reshape(dims)


def _find(dirs: list[Path], stem: str) -> Optional[Path]:
    for d in dirs:
        for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
            if (d / name).is_file():
                return d / name
    return None


def _split(x: np.ndarray, y: np.ndarray, n_test: int, val_fraction: float, seed: int):
    """Shuffle once with ``seed``; the last ``n_test`` are test, ``val_fraction`` of the rest val."""
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    n_rest = len(y) - n_test
    n_val = int(round(n_rest * val_fraction))
    return (
        (x[: n_rest - n_val], y[: n_rest - n_val]),
        (x[n_rest - n_val : n_rest], y[n_rest - n_val : n_rest]),
        (x[n_rest:], y[n_rest:]),
    )


def _to_splits(name: str, train, val, test, meta: dict) -> Splits:
    """uint8/float numpy (N,C,H,W) → standardised float tensors."""
    xs = [torch.as_tensor(np.array(a[0]), dtype=torch.float32) for a in (train, val, test)]  # a writable copy
    mean = xs[0].mean(dim=(0, 2, 3), keepdim=True)
    std = xs[0].std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    parts = [
        ArrayData((x - mean) / std, torch.as_tensor(a[1], dtype=torch.long)) for x, a in zip(xs, (train, val, test))
    ]
    C, H = xs[0].shape[1], xs[0].shape[2]
    return Splits(name, *parts, meta={"channels": C, "image_size": H, "num_classes": 10, **meta})


def load_mnist(dirs: list[Path], val_fraction: float = 0.1, seed: int = 0) -> Splits:
    """MNIST from idx files in ``<dir>/mnist`` or ``<dir>``. With the training files: 60k train (minus val)
    and the 10k test set; with only the 10k test set (as shipped in shared/data): 8k train (minus val) / 2k test."""
    cands = [p for d in dirs for p in (d / "mnist", d)]
    ti, tl = _find(cands, "t10k-images-idx3-ubyte"), _find(cands, "t10k-labels-idx1-ubyte")
    ri, rl = _find(cands, "train-images-idx3-ubyte"), _find(cands, "train-labels-idx1-ubyte")
    if ti is None or tl is None:
        raise DataNotFound(
            "MNIST",
            cands,
            "put t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz "
            "(and optionally the train-* files) in <data-dir>/mnist/",
        )
    tx, ty = read_idx(ti)[:, None], read_idx(tl)
    if ri is not None and rl is not None:
        (x, y), val, _ = _split(read_idx(ri)[:, None], read_idx(rl), 0, val_fraction, seed)
        return _to_splits("mnist", (x, y), val, (tx, ty), {"source": str(ri.parent)})
    train, val, test = _split(tx, ty, 2000, val_fraction, seed)
    return _to_splits("mnist", train, val, test, {"source": str(ti.parent), "note": "10k test set split 8k/2k"})


def load_digits(val_fraction: float = 0.1, seed: int = 0) -> Splits:
    """scikit-learn's 8x8 digits (1,797 images, shipped inside scikit-learn): 80/10/10."""
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    x = d.images.astype(np.float32)[:, None]
    train, val, test = _split(x, d.target, int(round(0.1 * len(x))), val_fraction / 0.9, seed)
    return _to_splits("digits", train, val, test, {"source": "sklearn.datasets.load_digits"})


def _cifar_python(path: Path) -> tuple[np.ndarray, np.ndarray]:
    # The python batches are pickles by format; they are the user's own data files, read with
    # encoding="bytes" and never a model payload. Prefer the binary batches when both exist.
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    return np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32), np.asarray(d[b"labels"])


def _cifar_binary(path: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(path, dtype=np.uint8).reshape(-1, 1 + 3 * 32 * 32)
    return raw[:, 1:].reshape(-1, 3, 32, 32), raw[:, 0].astype(np.int64)


def load_cifar10(dirs: list[Path], val_fraction: float = 0.1, seed: int = 0) -> Splits:
    """CIFAR-10 from ``cifar-10-batches-bin`` (preferred, no pickle) or ``cifar-10-batches-py``."""
    cands = [p for d in dirs for p in (d / "cifar-10-batches-bin", d / "cifar-10-batches-py", d / "cifar10", d)]
    for c in cands:
        if (c / "data_batch_1.bin").is_file() and (c / "test_batch.bin").is_file():
            tr = [
                _cifar_binary(c / f"data_batch_{i}.bin") for i in range(1, 6) if (c / f"data_batch_{i}.bin").is_file()
            ]
            te = _cifar_binary(c / "test_batch.bin")
            break
        if (c / "data_batch_1").is_file() and (c / "test_batch").is_file():
            tr = [_cifar_python(c / f"data_batch_{i}") for i in range(1, 6) if (c / f"data_batch_{i}").is_file()]
            te = _cifar_python(c / "test_batch")
            break
    else:
        raise DataNotFound("CIFAR-10", cands, "unpack cifar-10-binary.tar.gz or cifar-10-python.tar.gz into <data-dir>")
    (x, y), val, _ = _split(
        np.concatenate([a for a, _ in tr]), np.concatenate([b for _, b in tr]), 0, val_fraction, seed
    )
    return _to_splits("cifar10", (x, y), val, te, {"source": str(c)})
