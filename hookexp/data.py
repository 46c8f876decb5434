"""Data that needs no download: scikit-learn's ``digits`` (1,797 8x8 images shipped inside the
package) and seeded synthetic images. Both live in memory as tensors; a :class:`TensorSet` hands the
DataLoader whole batches through ``__getitems__`` so that loading costs one index op per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class TensorSet(Dataset):
    """Inputs and labels in memory; batched indexing instead of per-sample collation."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(idx)
        return self.x[index], self.y[index]


def seed_worker(worker_id: int) -> None:
    """Seed python's and numpy's generators in a DataLoader worker from torch's per-worker seed."""
    import random

    import numpy as np

    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def _whole_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch


@dataclass
class DataSplits:
    train: TensorSet
    val: TensorSet

    def loaders(self, batch_size: int, seed: int, eval_batch_size: int = 512, num_workers: int = 0,
                rank: int = 0, world_size: int = 1) -> tuple[DataLoader, DataLoader]:
        """A seeded shuffling loader for training and an ordered one for validation.

        The shuffling order comes from a generator seeded with ``seed``; worker processes (if any)
        get torch seeds derived from it by torch, and python/numpy seeds by :func:`seed_worker`.
        """
        gen = torch.Generator().manual_seed(seed)
        workers = {"num_workers": num_workers, "worker_init_fn": seed_worker,
                   "persistent_workers": num_workers > 0}
        sampler = None
        if world_size > 1:  # each rank its own shard of every epoch; the epoch is set by the trainer
            sampler = DistributedSampler(self.train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                         drop_last=True)
        train = DataLoader(self.train, batch_size=batch_size, shuffle=sampler is None, sampler=sampler, generator=gen,
                           collate_fn=_whole_batch, **workers)
        val = DataLoader(self.val, batch_size=eval_batch_size, shuffle=False, collate_fn=_whole_batch, **workers)
        return train, val


def _split(x: torch.Tensor, y: torch.Tensor, val_fraction: float, split_seed: int) -> DataSplits:
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    n_val = round(len(y) * val_fraction)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    return DataSplits(TensorSet(x[train_idx], y[train_idx]), TensorSet(x[val_idx], y[val_idx]))


def digits(val_fraction: float = 0.2, split_seed: int = 0) -> DataSplits:
    """scikit-learn's digits: 1,797 grey 8x8 images of 10 classes, scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    return _split(x, y, val_fraction, split_seed)


def synthetic(n: int = 2048, channels: int = 3, image_size: int = 8, num_classes: int = 5,
              val_fraction: float = 0.2, split_seed: int = 0) -> DataSplits:
    """Gaussian images labelled by a fixed random linear teacher: learnable, seeded, any size."""
    gen = torch.Generator().manual_seed(split_seed)
    x = torch.randn(n, channels, image_size, image_size, generator=gen)
    teacher = torch.randn(channels * image_size * image_size, num_classes, generator=gen)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    return _split(x, y, val_fraction, split_seed)


@dataclass
class Splits:  # (temporary: replaced by the datamodels branch)
    train: Any
    val: Any
    info: dict = field(default_factory=dict)
    collate_fn: Any = None


def as_splits(obj: Any, val_fraction: float | None = None, seed: int = 0, key: str = "data.dataset") -> Splits:
    if isinstance(obj, Splits):
        return obj
    if isinstance(obj, DataSplits):
        x = obj.train.x
        info = {"in_channels": x.shape[1], "image_size": x.shape[-1], "num_classes": int(obj.train.y.max()) + 1}
        return Splits(obj.train, obj.val, info, _whole_batch)
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        return Splits(obj[0], obj[1])
    from hookexp.errors import ConfigError
    raise ConfigError(f"returned {type(obj).__name__}", key=key)
