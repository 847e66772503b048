"""Loaders (real files where shipped, crafted files for user directories) and partitions."""

from __future__ import annotations

import gzip
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlmc.data import DataNotFound, TokenData, load, partition, partition_indices, read_idx, search_dirs

SHARED = Path(os.environ.get("FEDLMC_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
needs_shared = pytest.mark.skipif(not (SHARED / "mnist").is_dir(), reason="no MNIST test set in $FEDLMC_DATA")


def write_idx(path: Path, arr: np.ndarray) -> None:
    head = (0x0800 | arr.ndim).to_bytes(4, "big") + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(head + arr.astype(np.uint8).tobytes())


@needs_shared
def test_mnist_test_set_is_split_8k_2k():
    s = load("mnist")
    assert len(s.train) + len(s.val) == 8000 and len(s.test) == 2000
    assert s.train.x.shape[1:] == (1, 28, 28) and s.meta["num_classes"] == 10
    assert set(s.test.y.tolist()) == set(range(10))
    assert abs(float(s.train.x.mean())) < 1e-3  # standardised on train


def test_full_mnist_from_a_user_directory(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "mnist").mkdir()
    for split, n in (("train", 300), ("t10k", 50)):
        write_idx(tmp_path / "mnist" / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(tmp_path / "mnist" / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, n))
    s = load("mnist", data_dir=tmp_path)
    assert len(s.train) + len(s.val) == 300 and len(s.test) == 50
    assert read_idx(tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz").shape == (50, 28, 28)


def test_digits_is_embedded():
    s = load("digits")
    assert len(s.train) + len(s.val) + len(s.test) == 1797
    assert s.train.x.shape[1:] == (1, 8, 8)


@pytest.mark.parametrize("fmt", ["bin", "py"])
def test_cifar10_from_a_user_directory(tmp_path, fmt):
    rng = np.random.default_rng(1)
    d = tmp_path / f"cifar-10-batches-{fmt}"
    d.mkdir()
    for name, n in [(f"data_batch_{i}", 20) for i in range(1, 6)] + [("test_batch", 10)]:
        x, y = rng.integers(0, 256, (n, 3072)).astype(np.uint8), rng.integers(0, 10, n)
        if fmt == "bin":
            np.concatenate([y[:, None].astype(np.uint8), x], 1).tofile(d / f"{name}.bin")
        else:
            with open(d / name, "wb") as f:
                pickle.dump({b"data": x, b"labels": y.tolist()}, f)
    s = load("cifar10", data_dir=tmp_path)
    assert len(s.train) + len(s.val) == 100 and len(s.test) == 10
    assert s.train.x.shape[1:] == (3, 32, 32) and s.meta["channels"] == 3


def test_missing_data_names_every_place_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLMC_DATA", str(tmp_path / "env"))
    with pytest.raises(DataNotFound) as e:
        load("cifar10", data_dir=tmp_path / "mine")
    msg = str(e.value)
    assert str(tmp_path / "mine") in msg and str(tmp_path / "env") in msg and "--data-dir" in msg
    assert search_dirs(tmp_path / "mine")[:2] == [tmp_path / "mine", tmp_path / "env"]


def test_any_text_file_contiguous_90_5_5(tmp_path):
    text = "".join(chr(97 + (i * 7) % 26) for i in range(5000))
    (tmp_path / "t.txt").write_text(text)
    s = load("text", text_file=tmp_path / "t.txt", block_size=16)
    n = len(text)
    assert len(s.train.tokens) == int(0.9 * n) and len(s.val.tokens) + len(s.test.tokens) == n - int(0.9 * n)
    assert s.meta["vocab_size"] == 26
    joined = torch.cat([s.train.tokens, s.val.tokens, s.test.tokens])
    assert "".join(s.meta["chars"][i] for i in joined[:30]) == text[:30]  # contiguous, in order


@needs_shared
def test_tinyshakespeare():
    s = load("shakespeare", block_size=64)
    assert s.meta["vocab_size"] == 65
    total = len(s.train.tokens) + len(s.val.tokens) + len(s.test.tokens)
    assert total == 1115394
    x, y = next(s.test.batches(4))
    assert x.shape == (4, 64) and torch.equal(x[:, 1:], y[:, :-1])


def test_tinyshakespeare_ships_with_the_package(monkeypatch, tmp_path):
    """With no data folder anywhere (no ../shared, an empty working directory), the packaged copy is
    found, and it is the published corpus byte for byte."""
    import hashlib

    import fedlmc.data as data_mod

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDLMC_DATA", raising=False)
    monkeypatch.setattr(data_mod, "search_dirs", lambda data_dir=None: [tmp_path, data_mod.PACKAGED])
    s = data_mod.load("shakespeare", block_size=64)
    assert s.meta["vocab_size"] == 65 and "fedlmc/data/tinyshakespeare.txt" in str(s.meta.get("source", ""))
    digest = hashlib.sha256((data_mod.PACKAGED / "tinyshakespeare.txt").read_bytes()).hexdigest()
    assert digest == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def test_token_batches_cover_the_stream_in_order():
    t = TokenData(torch.arange(101), 10)
    xs = torch.cat([x for x, _ in t.batches(3)])
    assert len(t) == 10 and torch.equal(xs.reshape(-1), torch.arange(100))
    g = torch.Generator().manual_seed(0)
    x, y = next(t.batches(4, shuffle=True, generator=g))
    assert torch.equal(y, x + 1)


def test_partitions_are_deterministic_disjoint_and_skewed():
    labels = np.repeat(np.arange(10), 100)
    a = partition_indices(labels, 4, "dirichlet", alpha=0.1, seed=3)
    b = partition_indices(labels, 4, "dirichlet", alpha=0.1, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    allidx = np.concatenate(a)
    assert len(allidx) == len(set(allidx.tolist())) == 1000
    # α = 0.1 is strongly non-IID: some client's majority class holds most of its data
    top = max(np.bincount(labels[p], minlength=10).max() / len(p) for p in a)
    assert top > 0.4
    iid = partition_indices(labels, 4, "iid", seed=3)
    assert [len(p) for p in iid] == [250] * 4
    assert max(np.bincount(labels[p], minlength=10).max() / len(p) for p in iid) < 0.2
    with pytest.raises(ValueError, match="scheme"):
        partition_indices(labels, 2, "nope")


def test_text_partitions_are_contiguous_shards():
    t = TokenData(torch.arange(1000), 8)
    parts = partition(t, 3, "contiguous")
    assert torch.equal(torch.cat([p.tokens for p in parts]), t.tokens)
