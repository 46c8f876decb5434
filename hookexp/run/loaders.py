"""Data loading: the ``data`` config -> training and validation batches that resume exactly.

The order of an epoch is a function of the seed and the epoch alone (:class:`EpochSampler`), so a checkpoint
stores the epoch and the batches consumed, and a resumed run starts mid-epoch without reading the batches
before; an iterable data set skips them by reading. Details: docs/internals.md, "Data order".
"""

from __future__ import annotations

import math
import random
import re
import signal
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

from hookexp.errors import ConfigError, did_you_mean
from hookexp.run.distributed import Dist

DEFAULT_EPOCHS = 10  # trainer.epochs: null means this many epochs, unless trainer.max_steps is set
# data-level keys every option has; any other key at data level belongs to the option and must be used by it
COMMON_KEYS = ("batch_size", "eval_batch_size", "num_workers", "val_fraction", "split_seed", "collate_fn", "dataset",
               "name", "pin_memory")


class EpochSampler(Sampler[int]):
    """The indices of one epoch for one rank, from position ``start``: the same for the same (seed, epoch).

    Training (``train``) shuffles and trims the permutation to a multiple of the world size so that every rank
    takes the same number of steps; validation keeps every index in order (ranks take ``rank::world_size``, no
    duplicates).
    """

    def __init__(self, size: int, seed: int, train: bool, rank: int = 0, world_size: int = 1):
        self.size, self.seed = size, seed
        self.shuffle = self.drop_last = train
        self.rank, self.world_size = rank, world_size
        self.epoch = self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def indices(self) -> list[int]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=gen).tolist()
        else:
            order = list(range(self.size))
        if self.world_size > 1:
            if self.drop_last:
                order = order[:len(order) - len(order) % self.world_size]
            order = order[self.rank::self.world_size]
        return order

    def __len__(self) -> int:
        n = self.size // self.world_size if self.drop_last else math.ceil((self.size - self.rank) / self.world_size)
        return max(n - self.start, 0)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start:])


def no_batch() -> ConfigError:
    """A training set that gave no batch in a whole epoch (the preflight and the loop raise it)."""
    return ConfigError("the training set gave no batch in a whole epoch (an empty data set, or an iterable one that "
                       "yields nothing). Check the data factory.", key="data.dataset")


def seed_worker(worker_id: int) -> None:
    """In a worker process: leave SIGTERM/SIGINT to the main process (SLURM and Ctrl-C signal the whole process
    group; a worker that dies of it kills the run instead of letting it checkpoint), and seed python's and numpy's
    generators from torch's per-worker seed (set by the loader)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a batch (tensor, tuple/list/namedtuple, mapping, HF BatchEncoding) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)
        except TypeError:
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@dataclass
class Loaders:
    """The training and validation sets of a run and how to batch them."""

    train: Dataset
    val: Dataset | None
    info: dict[str, Any]
    collate_fn: Callable[[list[Any]], Any] | None
    batch_size: int
    eval_batch_size: int
    num_workers: int
    seed: int
    ranks: Dist
    pin_memory: bool = False

    @property
    def iterable(self) -> bool:
        return isinstance(self.train, IterableDataset)

    def _loader(self, dataset: Dataset, batch_size: int, sampler: Sampler[int] | None, seed: int) -> DataLoader:
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False, drop_last=False,
                          collate_fn=self.collate_fn or default_collate, num_workers=self.num_workers,
                          worker_init_fn=seed_worker if self.num_workers else None,
                          generator=torch.Generator().manual_seed(seed), pin_memory=self.pin_memory)

    def batches_per_epoch(self) -> int | None:
        """Training batches per epoch on this rank (None: an iterable data set without a length)."""
        if self.iterable:
            try:
                return math.ceil(len(self.train) / self.batch_size)  # type: ignore[arg-type]
            except TypeError:
                return None
        return math.ceil(len(self._sampler(0)) / self.batch_size)

    def steps_per_epoch(self, accumulate: int) -> int | None:
        batches = self.batches_per_epoch()
        return None if batches is None else math.ceil(batches / accumulate)

    def total_steps(self, epochs: int | None, max_steps: int | None, accumulate: int) -> tuple[int, str]:
        """The run's length in optimizer steps and the limit that sets it, as the final log line names it.

        ``epochs`` None is the default of 10 epochs, which an explicit ``max_steps`` lifts (as transformers'
        Trainer and Lightning do); both explicit: the first reached."""
        per_epoch = self.steps_per_epoch(accumulate)
        if per_epoch is None:
            if max_steps is None:
                raise ConfigError("is needed with an iterable data set, which has no length to count epochs by. "
                                  "Set trainer.max_steps=N.", key="trainer.max_steps")
            total, limit = max_steps, f"trainer.max_steps={max_steps}"
        else:
            if per_epoch == 0:
                raise ConfigError(f"the training set has {len(self.train)} examples: not one batch for this rank. "  # type: ignore[arg-type]
                                  "Use more data or fewer ranks.", key="data.dataset")
            if epochs is None and max_steps is not None:
                total, limit = max_steps, f"trainer.max_steps={max_steps}"
            else:
                n = DEFAULT_EPOCHS if epochs is None else epochs
                by_epochs = f"trainer.epochs={n}" if epochs is not None else f"the default {n} epochs"
                total, limit = ((n * per_epoch, by_epochs) if max_steps is None or n * per_epoch <= max_steps
                                else (max_steps, f"trainer.max_steps={max_steps}"))
        if total < 1:
            raise ConfigError("the run would take no step: set trainer.epochs or trainer.max_steps to at least 1.",
                              key="trainer.epochs")
        return total, limit

    def _sampler(self, epoch: int, start: int = 0) -> EpochSampler:
        sampler = EpochSampler(len(self.train), self.seed, True, self.ranks.rank, self.ranks.world_size)  # type: ignore[arg-type]
        sampler.set_epoch(epoch, start)
        return sampler

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """The training batches of ``epoch`` from batch ``start_batch`` on (on the host)."""
        worker_seed = self.seed * 1_000_003 + epoch
        if self.iterable:
            batches = iter(self._loader(self.train, self.batch_size, None, worker_seed))
            for _ in range(start_batch):
                next(batches, None)
            return batches
        sampler = self._sampler(epoch, start_batch * self.batch_size)
        return iter(self._loader(self.train, self.batch_size, sampler, worker_seed))

    def validation(self) -> Iterator[Any] | None:
        if self.val is None:
            return None
        sampler = None
        if not isinstance(self.val, IterableDataset):
            sampler = EpochSampler(len(self.val), self.seed, False, self.ranks.rank, self.ranks.world_size)  # type: ignore[arg-type]
        return iter(self._loader(self.val, self.eval_batch_size, sampler, self.seed))


def _interpolated_keys(node: Any) -> set[str]:
    """Data-level keys that the option's nested nodes interpolate (``${..path}``, ``${data.path}``)."""
    found: set[str] = set()
    if isinstance(node, Mapping):
        for v in node.values():
            found |= _interpolated_keys(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            found |= _interpolated_keys(v)
    elif isinstance(node, str):
        found |= set(re.findall(r"\$\{(?:\.\.+|data\.)([A-Za-z_][\w]*)", node))
    return found


def check_data_config(data: DictConfig) -> None:
    """The common keys' types, and no data-level key that nothing uses (a typo such as ``data.pth``)."""
    raw = OmegaConf.to_container(data, resolve=False)
    assert isinstance(raw, dict)
    used = _interpolated_keys({k: v for k, v in raw.items() if isinstance(v, (dict, list))})
    option_keys = sorted(k for k in raw if k not in COMMON_KEYS)
    for key in option_keys:
        if key not in used:
            known = [*COMMON_KEYS, *(k for k in option_keys if k in used)]
            raise ConfigError(f"unknown data key {key!r}: the data option does not use it.{did_you_mean(key, known)} "
                              f"Its keys: {', '.join(known)}.", key=f"data.{key}")

    def integer(key: str, low: int, allow_none: bool = False) -> None:
        value = data.get(key)
        if value is None and allow_none:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"expected an integer >= {low}{' or null' if allow_none else ''}, got {value!r}.",
                              key=f"data.{key}")

    integer("batch_size", 1)
    integer("eval_batch_size", 1, allow_none=True)
    integer("num_workers", 0)
    fraction = data.get("val_fraction")
    if fraction is not None and (not isinstance(fraction, (int, float)) or isinstance(fraction, bool)
                                 or not 0.0 <= fraction < 1.0):
        raise ConfigError(f"expected a fraction in [0, 1) (the share of the data held out for validation) or null, "
                          f"got {fraction!r}.", key="data.val_fraction")
    if data.get("dataset") is None or data.dataset.get("_target_") is None:
        raise ConfigError("needs a '_target_' that returns the training and validation sets, e.g. "
                          "data.dataset._target_=my_pkg.make_data.", key="data.dataset")


def make_loaders(data: DictConfig, seed: int, ranks: Dist, device: torch.device, overrides: list[str] | None = None
                 ) -> Loaders:
    """Build the data sets (``data.dataset``), normalise them (:func:`hookexp.workloads.data.as_splits`) and the collate
    function, checked before anything loads."""
    from hookexp.run.instantiate import drop_inherited, instantiate
    from hookexp.workloads.data import as_splits

    check_data_config(data)
    made = instantiate(drop_inherited(data.dataset, "data.dataset", overrides), "data.dataset")
    fraction = data.get("val_fraction")
    splits = as_splits(made, 0.2 if fraction is None else fraction, data.get("split_seed", 0) or 0, key="data.dataset")
    collate = splits.collate_fn
    if data.get("collate_fn") is not None:
        collate = instantiate(data.collate_fn, "data.collate_fn")
        if not callable(collate):
            raise ConfigError(f"built a {type(collate).__name__}, not a function of a list of examples. Give a "
                              "function with _partial_: true, or a factory that returns one.", key="data.collate_fn")
    eval_batch = data.get("eval_batch_size") or data.batch_size
    return Loaders(splits.train, splits.val, dict(splits.info), collate, data.batch_size, eval_batch,
                   data.num_workers, seed, ranks, pin_memory=device.type == "cuda")
