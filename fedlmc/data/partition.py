"""Federated partitions: flwr-datasets partitioners over an in-memory ``datasets.Dataset``, of images
by label, of text by speech (the speaking character is the label). Deterministic in the seed."""

from __future__ import annotations

import numpy as np
import torch

from fedlmc.data.base import Data, TokenData, Units

SCHEMES = ("iid", "dirichlet", "speaker", "contiguous")
# The version of each scheme's meaning, part of the client cache's key so that clients trained under an
# old meaning are not reused: 2, text partitions deal out speeches (before: every scheme cut text into
# contiguous shards); 3, ``speaker`` groups speakers at random (before: the frequent ones shared a client)
PARTITIONS_VERSION = {"iid": 2, "dirichlet": 2, "contiguous": 2, "speaker": 3}


def partition_indices(
    labels: np.ndarray,
    num_partitions: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    min_partition_size: int = 2,
) -> list[np.ndarray]:
    """Example indices of each partition: ``iid`` (shuffled equal shards), ``dirichlet`` (each label's
    examples split by Dirichlet(α) proportions) or ``speaker`` (every label on one partition, labels
    grouped at random: LEAF's natural split by role, grouped into ``num_partitions`` organisations)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, GroupedNaturalIdPartitioner, IidPartitioner

    if num_partitions < 1 or num_partitions > len(labels):
        raise ValueError(f"cannot cut {len(labels)} examples into {num_partitions} partitions")
    ds = Dataset.from_dict({"label": np.asarray(labels), "index": np.arange(len(labels))})
    if scheme == "iid":
        part = IidPartitioner(num_partitions)
        ds = ds.shuffle(seed=seed)  # IidPartitioner shards contiguously
    elif scheme == "dirichlet":
        part = DirichletPartitioner(
            num_partitions,
            partition_by="label",
            alpha=alpha,
            seed=seed,
            min_partition_size=min_partition_size,
            self_balancing=False,
        )
    elif scheme == "speaker":
        n_ids = len(set(np.asarray(labels).tolist()))
        if n_ids < num_partitions:
            raise ValueError(f"{n_ids} distinct labels cannot make {num_partitions} partitions by speaker")
        # ids are grouped in order of first appearance, and in shuffled rows the frequent speakers come
        # first (one client got ~70 % of the text): order the rows by a random rank of their speaker
        uniq, inverse = np.unique(np.asarray(labels), return_inverse=True)
        rank = np.random.default_rng(seed).permutation(len(uniq))[inverse]
        part = GroupedNaturalIdPartitioner("label", group_size=n_ids // num_partitions, mode="allow-bigger")
        ds = ds.select(np.argsort(rank, kind="stable")).flatten_indices()  # ``unique`` reads the table
    else:
        raise ValueError(f"unknown partition scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    part.dataset = ds
    return [np.sort(np.asarray(part.load_partition(i)["index"])) for i in range(num_partitions)]


def partition_text(
    data: TokenData, num_partitions: int, scheme: str = "iid", alpha: float = 0.5, seed: int = 0
) -> list[TokenData]:
    """Split a token stream: ``contiguous`` shards, or its speeches dealt out by ``partition_indices``
    (each client's stream is its speeches in the text's order)."""
    if scheme == "contiguous":
        bounds = np.linspace(0, len(data.tokens), num_partitions + 1).astype(int)
        return [TokenData(data.tokens[a:b], data.block_size) for a, b in zip(bounds[:-1], bounds[1:])]
    u = data.units
    if u is None or len(u) < num_partitions:
        raise ValueError(
            f"partition scheme {scheme!r} deals out the text's speeches or paragraphs, and this "
            "token stream has too few; use partitioner 'contiguous'"
        )
    if scheme in ("dirichlet", "speaker") and not any(u.labels):
        raise ValueError(
            f"partition scheme {scheme!r} needs speaker labels (a play's 'NAME:' headings); "
            "this text has none: use 'iid' or 'contiguous'"
        )
    out = []
    for idx in partition_indices(np.asarray(u.labels), num_partitions, scheme, alpha, seed):
        pieces = [data.tokens[u.starts[i] : u.ends[i]] for i in idx]
        lens = np.cumsum([0] + [len(p) for p in pieces])
        sub = Units(lens[:-1], lens[1:], [u.labels[i] for i in idx])
        out.append(TokenData(torch.cat(pieces) if pieces else data.tokens[:0], data.block_size, sub))
    return out


def partition(data: Data, num_partitions: int, scheme: str = "iid", alpha: float = 0.5, seed: int = 0) -> list[Data]:
    """Split a training set among clients (``SCHEMES``; images by label, text by speech)."""
    if isinstance(data, TokenData):
        return partition_text(data, num_partitions, scheme, alpha, seed)
    if scheme not in ("iid", "dirichlet"):
        raise ValueError(f"partition scheme {scheme!r} is for text; images take 'iid' or 'dirichlet'")
    idx = partition_indices(data.y.numpy(), num_partitions, scheme, alpha, seed)
    return [data.subset(torch.as_tensor(i)) for i in idx]
