"""What every data factory returns, and :func:`as_splits`, which turns whatever a factory returns into one
:class:`Splits` (a pair, a mapping, one data set split by ``data.val_fraction``); the checks the factories share."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from hookexp.errors import ConfigError


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


def whole_batch(batch: Any) -> Any:
    """The collate function of a :class:`TensorSet`: its ``__getitems__`` already returns the batch."""
    return batch


@dataclass
class Splits:
    """The training and validation sets of a run, what the data tells the model, and how to batch it.

    ``info`` holds keys among ``num_classes``, ``in_channels``, ``image_size``, ``input_dim``, ``output_dim``,
    ``vocab_size``, ``block_size``, ``pad_id`` (and ``vocab`` for character-level text): the values a model
    config's ``auto`` takes. ``collate_fn`` is the batching the data needs (None: torch's default_collate);
    ``data.collate_fn`` in the config replaces it.
    """

    train: Any
    val: Any
    info: dict[str, Any] = field(default_factory=dict)
    collate_fn: Callable | None = None


ACCEPTED = ("a hookexp.workloads.data.Splits(train, val, info); a pair (train, val) of data sets; a mapping "
            "with 'train' and 'val' or 'validation' (a HF DatasetDict qualifies); or one map-style data set, which "
            "is split by data.val_fraction. A data set is a torch Dataset or IterableDataset, a HF datasets.Dataset, "
            "or a list of examples")


def as_splits(obj: Any, val_fraction: float = 0.2, seed: int = 0, key: str = "data.dataset") -> Splits:
    """Normalise what a data factory returned into :class:`Splits` (see :data:`ACCEPTED`).

    ``seed`` seeds the split of a single data set: pass the data's own split seed, not the training seed,
    so that every training seed sees the same validation set. HF data sets get ``with_format("torch")`` so
    that their examples are tensors. Anything else is a :class:`ConfigError` naming ``key``.
    """
    if isinstance(obj, Splits):
        splits = _pair(obj.train, obj.val, key)
        splits.info, splits.collate_fn = dict(obj.info), obj.collate_fn or splits.collate_fn
        return splits
    if isinstance(obj, Mapping):
        val_key = next((k for k in ("val", "validation") if k in obj), None)
        if "train" in obj and val_key is not None:
            return _pair(obj["train"], obj[val_key], key)
        if list(obj) == ["train"]:  # e.g. load_dataset("json", data_files=...) on one file
            return _split_one(obj["train"], val_fraction, seed, key)
        raise ConfigError(f"returned a mapping with keys {sorted(map(str, obj))}; hookexp needs 'train' and 'val' "
                          f"or 'validation' (rename the held-out split, e.g. {{'train': d['train'], 'val': "
                          f"d['test']}}). Accepted: {ACCEPTED}.", key=key)
    if isinstance(obj, (tuple, list)) and len(obj) == 2 and all(_is_dataset(o) for o in obj):
        return _pair(obj[0], obj[1], key)
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(o, torch.Tensor) for o in obj):
        raise ConfigError(f"returned a pair of tensors {_shown(obj)}, read as (train, val) data sets. For inputs "
                          "and labels return hookexp.workloads.data.TensorSet(x, y) (or "
                          "torch.utils.data.TensorDataset(x, y)), "
                          f"which is split by data.val_fraction. Accepted: {ACCEPTED}.", key=key)
    if _is_dataset(obj):
        return _split_one(obj, val_fraction, seed, key)
    raise ConfigError(f"returned {_shown(obj)}, which is not training and validation data. Return one of: "
                      f"{ACCEPTED}.", key=key)


def _shown(obj: Any) -> str:
    text = repr(obj).replace("\n", " ")
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"a {type(obj).__module__}.{type(obj).__qualname__} ({text})" if obj is not None else "None"


def _is_hf(obj: Any) -> bool:
    datasets = sys.modules.get("datasets")  # an object cannot be a HF data set unless datasets is imported
    return datasets is not None and isinstance(obj, (datasets.Dataset, datasets.IterableDataset))


def _is_dataset(obj: Any) -> bool:
    if isinstance(obj, (Dataset, IterableDataset, list)) or _is_hf(obj):
        return True
    if isinstance(obj, (torch.Tensor, np.ndarray, str, bytes, Mapping, tuple)):
        return False
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")


def _is_iterable_only(obj: Any) -> bool:
    datasets = sys.modules.get("datasets")
    return isinstance(obj, IterableDataset) or (datasets is not None and isinstance(obj, datasets.IterableDataset))


def _checked(ds: Any, key: str, which: str) -> Any:
    """``ds`` as hookexp uses it (HF sets as torch tensors); a clear error for a non-data set or an empty one."""
    if not _is_dataset(ds):
        raise ConfigError(f"the {which} set is {_shown(ds)}, not a data set. Accepted: {ACCEPTED}.", key=key)
    if _is_hf(ds) and getattr(ds, "format", {}).get("type") is None:
        ds = ds.with_format("torch")
    if not _is_iterable_only(ds) and len(ds) == 0:
        raise ConfigError(f"the {which} set is empty: training and validation both need at least one example.",
                          key=key)
    return ds


def _pair(train: Any, val: Any, key: str) -> Splits:
    train, val = _checked(train, key, "train"), _checked(val, key, "val")
    # TensorSets hand out whole batches; torch's default_collate would stack them again
    collate = whole_batch if isinstance(train, TensorSet) and isinstance(val, TensorSet) else None
    return Splits(train, val, {}, collate)


def labels_of(ds: Any) -> torch.Tensor | None:
    """Every label of a map-style set: a TensorSet's ``y``, a TensorDataset's last tensor, else each example's
    last element (a tuple) or ``labels`` / ``label`` (a mapping), read example by example (one pass over the
    set, transforms included). None when it cannot be known: an iterable set (it can be read once, as it
    streams), examples without labels, or labels of different shapes."""
    if _is_iterable_only(ds):
        return None
    if isinstance(ds, TensorSet):
        return ds.y
    if isinstance(ds, TensorDataset):
        return ds.tensors[-1] if len(ds.tensors) > 1 else None
    if isinstance(ds, Subset):
        inner = labels_of(ds.dataset)
        return None if inner is None else inner[torch.as_tensor(ds.indices, dtype=torch.long)]
    labels = []
    for i in range(len(ds)):
        example = ds[i]
        if isinstance(example, Mapping):
            label = example.get("labels", example.get("label"))
        else:
            label = example[-1] if isinstance(example, (tuple, list)) and len(example) > 1 else None
        if label is None:
            return None
        labels.append(torch.as_tensor(label))
        if labels[-1].shape != labels[0].shape:  # not one class per example (e.g. token labels): not known here
            return None
    return torch.stack(labels) if labels else None


def classes_in(*sets: Any) -> int | None:
    """The number of classes map-style sets' integer labels imply (the largest label + 1); None when a set's
    labels cannot be known or are not class indices (floats, negative)."""
    found = -1
    for ds in sets:
        if ds is None:
            continue
        labels = labels_of(ds)
        if labels is None or labels.is_floating_point() or labels.is_complex() or labels.numel() == 0 \
                or labels.dtype == torch.bool or int(labels.min()) < 0:
            return None
        found = max(found, int(labels.max()))
    return found + 1 if found >= 0 else None


def input_shape(ds: Any) -> tuple[int, ...] | None:
    """The shape of one example's input in a map-style set of ``(input, label)`` pairs (an image's ``(C, H, W)``);
    None when it cannot be known (an iterable set, other examples)."""
    if ds is None or _is_iterable_only(ds) or len(ds) == 0:
        return None
    example = (ds.x[0], ds.y[0]) if isinstance(ds, TensorSet) else ds[0]
    x = example[0] if isinstance(example, (tuple, list)) and len(example) == 2 else None
    return tuple(x.shape) if isinstance(x, torch.Tensor) else None


def input_size(ds: Any) -> int | None:
    """The number of elements of one example's input (what a flat model's ``input_dim`` is); None as
    :func:`input_shape`."""
    shape = input_shape(ds)
    return math.prod(shape) if shape is not None else None


def check_fraction(value: Any, key: str) -> float:
    """A fraction strictly between 0 and 1 (a held-out share), or a ConfigError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(f"must be a number strictly between 0 and 1, got {value!r}.", key=key)
    return float(value)


def _held_out(n: int, val_fraction: float, key: str) -> int:
    n_val = round(n * val_fraction)
    if not 0 < n_val < n:
        raise ConfigError(f"{val_fraction} of {n} examples leaves {n_val} for validation and {n - n_val} for "
                          "training; both need at least one.", key=key)
    return n_val


def _split_one(ds: Any, val_fraction: float, seed: int, key: str) -> Splits:
    """One map-style set split at random (fixed by ``seed``): the first ``val_fraction`` of a permutation is val."""
    if _is_iterable_only(ds):
        raise ConfigError(f"returned one iterable data set ({type(ds).__name__}), which cannot be split by "
                          "data.val_fraction: an iterable set has no length or index. Return (train, val) or "
                          "{'train': ..., 'val': ...} instead.", key=key)
    ds = _checked(ds, key, "returned")
    fraction_key = "data.val_fraction"
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))
    n_val = _held_out(len(ds), check_fraction(val_fraction, fraction_key), fraction_key)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    if isinstance(ds, TensorSet):
        return Splits(TensorSet(ds.x[train_idx], ds.y[train_idx]), TensorSet(ds.x[val_idx], ds.y[val_idx]), {},
                      whole_batch)
    if _is_hf(ds):
        return Splits(ds.select(train_idx.tolist()), ds.select(val_idx.tolist()))
    return Splits(Subset(ds, train_idx.tolist()), Subset(ds, val_idx.tolist()))


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"must be an integer of at least {minimum}, got {value!r}.", key=f"data.{name}")
    return value
