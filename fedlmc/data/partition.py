"""Federated partitions: flwr-datasets partitioners over an in-memory ``datasets.Dataset`` (images),
contiguous shards (text). Deterministic in the seed."""
from __future__ import annotations

import numpy as np
import torch

from .base import Data, TokenData


def partition_indices(labels: np.ndarray, num_partitions: int, scheme: str = "iid", alpha: float = 0.5,
                      seed: int = 0, min_partition_size: int = 2) -> list[np.ndarray]:
    """Example indices of each partition: ``iid`` (shuffled equal shards) or ``dirichlet`` (by label, α)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    if num_partitions < 1 or num_partitions > len(labels):
        raise ValueError(f"cannot cut {len(labels)} examples into {num_partitions} partitions")
    ds = Dataset.from_dict({"label": np.asarray(labels), "index": np.arange(len(labels))})
    if scheme == "iid":
        part = IidPartitioner(num_partitions)
        ds = ds.shuffle(seed=seed)  # IidPartitioner shards contiguously
    elif scheme == "dirichlet":
        part = DirichletPartitioner(num_partitions, partition_by="label", alpha=alpha, seed=seed,
                                    min_partition_size=min_partition_size, self_balancing=False)
    else:
        raise ValueError(f"unknown partition scheme {scheme!r}; use 'iid' or 'dirichlet'")
    part.dataset = ds
    return [np.asarray(part.load_partition(i)["index"]) for i in range(num_partitions)]


def partition(data: Data, num_partitions: int, scheme: str = "iid", alpha: float = 0.5, seed: int = 0) -> list[Data]:
    """Split a training set among clients. Text is cut into contiguous shards whatever the scheme."""
    if isinstance(data, TokenData):
        bounds = np.linspace(0, len(data.tokens), num_partitions + 1).astype(int)
        return [TokenData(data.tokens[a:b], data.block_size) for a, b in zip(bounds[:-1], bounds[1:])]
    idx = partition_indices(data.y.numpy(), num_partitions, scheme, alpha, seed)
    return [data.subset(torch.as_tensor(i)) for i in idx]
