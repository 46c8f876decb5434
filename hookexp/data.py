"""Data for hookexp runs: the factories ``data.dataset._target_`` names, and :func:`as_splits`, which turns
whatever a factory returns into one :class:`Splits`.

A factory may return a :class:`Splits`, a pair ``(train, val)``, a mapping with ``train`` and ``val`` or
``validation`` (a HF ``DatasetDict`` qualifies), or one data set that :func:`as_splits` splits by
``data.val_fraction``. ``Splits.info`` carries what the data knows and a model needs (``num_classes``,
``vocab_size``, ...): a model config value ``auto`` is filled from it, so one model file fits every data set.

The shipped factories need no download: ``digits`` (scikit-learn), ``synthetic`` and ``synthetic_regression``
(seeded generators), ``modular_addition`` (the grokking task), ``text_file`` (any local UTF-8 file),
``torchvision`` (MNIST/CIFAR from a local folder) and ``hf_disk`` (a HF ``datasets`` folder or local files).
In-memory sets are :class:`TensorSet`\\ s, which hand the DataLoader whole batches through ``__getitems__``
(one index op per batch, no per-example Python); their Splits name :func:`whole_batch` as the collate function.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from hookexp.errors import ConfigError, did_you_mean

# -- containers ---------------------------------------------------------------------------------------------


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


# -- normalising what a factory returns ---------------------------------------------------------------------

ACCEPTED = ("a hookexp.data.Splits(train, val, info); a pair (train, val) of data sets; a mapping with 'train' and "
            "'val' or 'validation' (a HF DatasetDict qualifies); or one map-style data set, which is split by "
            "data.val_fraction. A data set is a torch Dataset or IterableDataset, a HF datasets.Dataset, or a list "
            "of examples")


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
        raise ConfigError(f"returned a pair of tensors {_describe(obj)}, read as (train, val) data sets. For inputs "
                          "and labels return hookexp.data.TensorSet(x, y) (or torch.utils.data.TensorDataset(x, y)), "
                          f"which is split by data.val_fraction. Accepted: {ACCEPTED}.", key=key)
    if _is_dataset(obj):
        return _split_one(obj, val_fraction, seed, key)
    raise ConfigError(f"returned {_describe(obj)}, which is not training and validation data. Return one of: "
                      f"{ACCEPTED}.", key=key)


def _describe(obj: Any) -> str:
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
        raise ConfigError(f"the {which} set is {_describe(ds)}, not a data set. Accepted: {ACCEPTED}.", key=key)
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


def input_size(ds: Any) -> int | None:
    """The number of elements of one example's input in a map-style set of ``(input, label)`` pairs (what a flat
    model's ``input_dim`` is); None when it cannot be known (an iterable set, other examples)."""
    if ds is None or _is_iterable_only(ds) or len(ds) == 0:
        return None
    example = (ds.x[0], ds.y[0]) if isinstance(ds, TensorSet) else ds[0]
    x = example[0] if isinstance(example, (tuple, list)) and len(example) == 2 else None
    return int(x.numel()) if isinstance(x, torch.Tensor) else None


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


# -- batching variable-length token sequences ---------------------------------------------------------------


class PadCollate:
    """Batches mappings of variable-length token tensors: pads on the right to the longest in the batch.

    ``input_ids`` are padded with ``pad_id``, ``labels`` with ``label_pad`` (ignored by the loss),
    ``attention_mask`` and other sequences with 0; an ``attention_mask`` (1 = token, 0 = padding) is added when
    the examples have none. Scalars are stacked, non-tensor values (strings) kept as lists. A class, not a
    closure, so that DataLoader workers can pickle it.
    """

    def __init__(self, pad_id: int = 0, label_pad: int = -100):
        self.pad_id, self.label_pad = pad_id, label_pad

    def __repr__(self) -> str:
        return f"PadCollate(pad_id={self.pad_id}, label_pad={self.label_pad})"

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, Any]:
        if not examples or not isinstance(examples[0], Mapping):
            raise TypeError(f"pad_collate batches mappings such as {{'input_ids': ...}}, got "
                            f"{type(examples[0]).__name__ if examples else 'no examples'}")
        out: dict[str, Any] = {}
        for name in examples[0]:
            values = [e[name] for e in examples]
            if isinstance(values[0], (str, bytes)):
                out[name] = values
                continue
            tensors = [torch.as_tensor(v) for v in values]
            if tensors[0].dim() == 0:
                out[name] = torch.stack(tensors)
                continue
            pad = {"input_ids": self.pad_id, "labels": self.label_pad}.get(name, 0)
            out[name] = torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=pad)
        if "attention_mask" not in out and isinstance(out.get("input_ids"), torch.Tensor):
            lengths = torch.tensor([len(e["input_ids"]) for e in examples])
            out["attention_mask"] = (torch.arange(out["input_ids"].shape[1]) < lengths[:, None]).long()
        return out


def pad_collate(pad_id: int = 0, label_pad: int = -100) -> PadCollate:
    """The collate function for variable-length token mappings (``data.collate_fn: {_target_:
    hookexp.data.pad_collate, pad_id: 0}``); see :class:`PadCollate`."""
    return PadCollate(pad_id, label_pad)


# -- images and tabular data --------------------------------------------------------------------------------


def _split(x: torch.Tensor, y: torch.Tensor, val_fraction: float, split_seed: int, info: dict[str, Any]) -> Splits:
    check_fraction(val_fraction, "data.val_fraction")
    splits = _split_one(TensorSet(x, y), val_fraction, split_seed, "data.dataset")
    splits.info = info
    return splits


def _image_info(channels: int, image_size: int, num_classes: int) -> dict[str, int]:
    """What an image set tells a model; ``input_dim``/``output_dim`` let a flat MLP take it too."""
    return {"num_classes": num_classes, "in_channels": channels, "image_size": image_size,
            "input_dim": channels * image_size * image_size, "output_dim": num_classes}


def _positive(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"must be an integer of at least {minimum}, got {value!r}.", key=f"data.{name}")
    return value


def digits(val_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    """scikit-learn's digits: 1,797 grey 8x8 images of 10 classes, scaled to [0, 1]; batches ``(x, y)``."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    return _split(x, y, val_fraction, split_seed, _image_info(1, 8, 10))


def synthetic(n: int = 2048, channels: int = 3, image_size: int = 8, num_classes: int = 5,
              val_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    """Gaussian images labelled by a fixed random linear teacher: learnable, seeded, any size."""
    for name, value in (("n", n), ("channels", channels), ("image_size", image_size)):
        _positive(name, value)
    _positive("num_classes", num_classes, 2)
    gen = torch.Generator().manual_seed(split_seed)
    x = torch.randn(n, channels, image_size, image_size, generator=gen)
    teacher = torch.randn(channels * image_size * image_size, num_classes, generator=gen)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    return _split(x, y, val_fraction, split_seed, _image_info(channels, image_size, num_classes))


def synthetic_regression(n: int = 2048, input_dim: int = 16, output_dim: int = 1, noise: float = 0.1,
                         val_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    """Regression with float targets: x ~ N(0, I) of ``input_dim`` features, y = a fixed random two-layer tanh
    teacher of x plus N(0, noise^2); batches ``(x [B, input_dim], y [B, output_dim])``, both float32.

    A separate factory rather than a switch on ``synthetic``: regression data is tabular and its model (an
    MLP with ``input_dim``/``output_dim``) differs from an image classifier's. The teacher's hidden layer
    (32 tanh units) keeps the task out of reach of a linear model, so depth and hooks matter.
    """
    for name, value in (("n", n), ("input_dim", input_dim), ("output_dim", output_dim)):
        _positive(name, value)
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or noise < 0:
        raise ConfigError(f"must be a number of at least 0, got {noise!r}.", key="data.noise")
    gen = torch.Generator().manual_seed(split_seed)
    x = torch.randn(n, input_dim, generator=gen)
    hidden = torch.tanh(x @ torch.randn(input_dim, 32, generator=gen) / math.sqrt(input_dim))
    y = hidden @ torch.randn(32, output_dim, generator=gen) / math.sqrt(32)
    y = y + noise * torch.randn(n, output_dim, generator=gen)
    return _split(x, y, val_fraction, split_seed, {"input_dim": input_dim, "output_dim": output_dim})


# -- the grokking task --------------------------------------------------------------------------------------

OPS = ("add", "sub", "mul", "div")


def _is_prime(p: int) -> bool:
    return p >= 2 and all(p % d for d in range(2, math.isqrt(p) + 1))


def modular_addition(p: int = 97, op: str = "add", train_fraction: float = 0.5, split_seed: int = 0) -> Splits:
    """The grokking task: every equation ``x op y = (x op y) mod p``, a random ``train_fraction`` of them to train.

    Each example is ``(tokens, label)``: tokens ``[x, OP, y, EQ]`` (numbers are tokens 0..p-1, OP = p,
    EQ = p+1, so the vocabulary has p+2 tokens) and the answer ``(x op y) mod p`` as the label; a model reads
    the answer at the last position, as the papers do. The operands follow the papers:

    - add, sub: x, y in [0, p), p*p equations (Power et al. 2022: x+y, x-y mod p);
    - div: x in [0, p), y in [1, p), x / y = x * y^(p-2) mod p; p must be prime (Power et al. 2022);
    - mul: x in [0, p), y in [1, p), p*(p-1) equations (Grokfast, Lee et al. 2024).

    The split is a permutation seeded by ``split_seed`` (fixed across training seeds); every equation is in
    exactly one of train and val. ``info``: vocab_size = num_classes = p+2 (the head predicts a token),
    block_size = 4.
    """
    _positive("p", p, 2)
    if op not in OPS:
        raise ConfigError(f"unknown operation {op!r}.{did_you_mean(op, OPS)} Use one of {', '.join(OPS)}.",
                          key="data.op")
    if op == "div" and not _is_prime(p):
        raise ConfigError(f"op=div needs a prime p (y must have an inverse mod p), got {p}; e.g. data.p=97.",
                          key="data.p")
    train_fraction = check_fraction(train_fraction, "data.train_fraction")
    x = torch.arange(p)
    y = torch.arange(p) if op in ("add", "sub") else torch.arange(1, p)
    x, y = torch.cartesian_prod(x, y).unbind(1)
    if op == "add":
        label = (x + y) % p
    elif op == "sub":
        label = (x - y) % p  # torch's % takes the sign of the divisor: always in [0, p)
    elif op == "mul":
        label = (x * y) % p
    else:
        inverse = torch.tensor([0] + [pow(int(v), p - 2, p) for v in range(1, p)])  # Fermat: y^(p-2) = 1/y
        label = (x * inverse[y]) % p
    tokens = torch.stack([x, torch.full_like(x, p), y, torch.full_like(x, p + 1)], dim=1)
    perm = torch.randperm(len(label), generator=torch.Generator().manual_seed(split_seed))
    n_train = int(len(label) * train_fraction)  # floor, as Grokfast's 50% split of p*(p-1) equations
    if not 0 < n_train < len(label):
        raise ConfigError(f"{train_fraction} of {len(label)} equations leaves {n_train} to train and "
                          f"{len(label) - n_train} to validate; both need at least one.", key="data.train_fraction")
    train_idx, val_idx = perm[:n_train], perm[n_train:]
    info = {"vocab_size": p + 2, "num_classes": p + 2, "block_size": 4}
    return Splits(TensorSet(tokens[train_idx], label[train_idx]), TensorSet(tokens[val_idx], label[val_idx]), info,
                  whole_batch)


# -- text ---------------------------------------------------------------------------------------------------


class CharTokenizer:
    """Characters <-> token ids: id ``i`` is ``vocab[i]``. Encoding goes through numpy on the text's code
    points, so a file of megabytes encodes in milliseconds."""

    def __init__(self, vocab: str):
        if len(set(vocab)) != len(vocab):
            raise ValueError("vocab must not repeat a character")
        self.vocab = vocab
        codes = np.array([ord(c) for c in vocab], dtype=np.int64)
        self._order = np.argsort(codes)
        self._sorted = codes[self._order]

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The vocabulary of ``text``: its distinct characters, sorted (as nanoGPT's shakespeare_char)."""
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
        pos = np.searchsorted(self._sorted, codes).clip(max=len(self._sorted) - 1)
        unknown = self._sorted[pos] != codes
        if unknown.any():
            raise ValueError(f"character {chr(codes[unknown.argmax()])!r} is not in the vocabulary")
        return torch.from_numpy(self._order[pos])

    def decode(self, ids: Any) -> str:
        return "".join(self.vocab[i] for i in torch.as_tensor(ids).tolist())


class TokenWindows(Dataset):
    """Windows of ``block_size`` tokens of one long sequence, starting every ``stride`` tokens:
    ``{"input_ids": LongTensor[block_size]}``. A causal LM predicts each token from those before it."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int):
        if len(tokens) < block_size:
            raise ValueError(f"{len(tokens)} tokens hold no window of block_size={block_size}")
        self.tokens, self.block_size, self.stride = tokens, block_size, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size) // self.stride + 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        start = i * self.stride
        return {"input_ids": self.tokens[start:start + self.block_size].long()}


def _base_dir() -> Path:
    """Where a relative path is read from: the directory the user ran hookexp in (Hydra may change cwd)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.cwd)
    except Exception:
        pass
    return Path.cwd()


def _resolve(path: Any) -> Path:
    """A path from the config: absolute, or relative to where hookexp was started."""
    resolved = Path(str(path)).expanduser()
    return resolved if resolved.is_absolute() else _base_dir() / resolved


def _existing(path: Any, key: str, what: str) -> Path:
    if path is None or path == "":
        raise ConfigError(f"is not set; give {what}.", key=key)
    base = _base_dir()
    resolved = _resolve(path)
    if not resolved.exists():
        raise ConfigError(f"{str(path)!r} does not exist (looked in {resolved.parent}). Give {what}, relative to "
                          f"{base} or absolute.", key=key)
    return resolved


def _import(name: str, key: str, purpose: str) -> Any:
    """Import an optional package, or a ConfigError naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"{purpose} needs the `{name}` package, which is not installed ({e}). Install the extra: "
                          f"pip install 'hookexp[hf]' (or pip install {name}).", key=key) from None


def _hf_tokenizer(tokenizer: Any, key: str) -> Any:
    """A local HF tokenizer folder, loaded without network access."""
    if not isinstance(tokenizer, (str, Path)):
        raise ConfigError(f"must be 'char' or a local tokenizer folder, got {tokenizer!r}.", key=key)
    folder = _resolve(tokenizer)
    if not folder.is_dir():
        raise ConfigError(f"{str(tokenizer)!r} is neither 'char' nor an existing folder (looked in {folder.parent})."
                          f"{did_you_mean(str(tokenizer), ['char'])} Use char, or a folder written by a "
                          "tokenizer's save_pretrained (nothing is downloaded).", key=key)
    transformers = _import("transformers", key, "a HF tokenizer")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise ConfigError(f"could not load a tokenizer from {folder}: {type(e).__name__}: {e}. Give a folder written "
                          "by tokenizer.save_pretrained(...), or char.", key=key) from None


def text_file(path: str, block_size: int = 128, tokenizer: str = "char", val_fraction: float = 0.1,
              stride: int | None = None) -> Splits:
    """Language modelling on any local UTF-8 file: windows ``{"input_ids": LongTensor[block_size]}``.

    ``tokenizer``: ``char`` (the file's sorted characters; ``info["vocab"]`` keeps them, so
    ``CharTokenizer(info["vocab"])`` decodes) or a local HF tokenizer folder. The last ``val_fraction`` of the
    tokens is the validation text, as nanoGPT splits (no window crosses the boundary). Training windows start
    every ``stride`` tokens (default ``block_size``: each token seen once an epoch); validation windows never
    overlap. ``info``: vocab_size, block_size (and vocab for char, pad_id when the tokenizer has one).
    """
    _positive("block_size", block_size)
    stride = block_size if stride is None else _positive("stride", stride)
    val_fraction = check_fraction(val_fraction, "data.val_fraction")
    file = _existing(path, "data.path", "a UTF-8 text file")
    if not file.is_file():
        raise ConfigError(f"{str(path)!r} is a folder ({file}); give a UTF-8 text file.", key="data.path")
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file} is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}). Convert it, "
                          "e.g. iconv -t UTF-8.", key="data.path") from None
    info: dict[str, Any] = {"block_size": block_size}
    if tokenizer == "char":
        chars = CharTokenizer.from_text(text)
        tokens = chars.encode(text)
        info.update(vocab_size=len(chars), vocab=chars.vocab)
    else:
        tok = _hf_tokenizer(tokenizer, "data.tokenizer")
        tokens = torch.tensor(tok(text, add_special_tokens=False, verbose=False)["input_ids"])
        info.update(vocab_size=len(tok), tokenizer=str(tokenizer))
        if tok.pad_token_id is not None:
            info["pad_id"] = tok.pad_token_id
    tokens = tokens.to(torch.int32)  # half the memory of int64; windows come out as int64
    cut = int(len(tokens) * (1 - val_fraction))
    if min(cut, len(tokens) - cut) < block_size:
        raise ConfigError(f"{file} has {len(tokens)} tokens: with val_fraction={val_fraction} the training part has "
                          f"{cut} and the validation part {len(tokens) - cut}, and each needs at least one window of "
                          f"block_size={block_size}. Use a smaller data.block_size, another data.val_fraction or a "
                          "longer file.", key="data.path")
    return Splits(TokenWindows(tokens[:cut], block_size, stride), TokenWindows(tokens[cut:], block_size, block_size),
                  info)


# -- torchvision --------------------------------------------------------------------------------------------

# name -> (torchvision class, channels, image size, classes, mean, std, the files its root must hold)
VISION = {
    "mnist": ("MNIST", 1, 28, 10, (0.1307,), (0.3081,),
              "ROOT/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"),
    "fashion_mnist": ("FashionMNIST", 1, 28, 10, (0.2860,), (0.3530,),
                      "ROOT/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"),
    "cifar10": ("CIFAR10", 3, 32, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616),
                "ROOT/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}"),
    "cifar100": ("CIFAR100", 3, 32, 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762),
                 "ROOT/cifar-100-python/{train,test,meta}"),
}


def torchvision(name: str = "mnist", root: str = "data", download: bool = False, normalize: bool = True) -> Splits:
    """MNIST, FashionMNIST, CIFAR-10 or CIFAR-100 from a local folder: the official train set to train, the
    test set to validate; batches ``(x [B, C, H, W] float, y [B] long)``, normalised by the set's mean and std.

    Nothing is downloaded unless ``download=true``. ``info``: num_classes, in_channels, image_size, input_dim,
    output_dim.
    """
    if name not in VISION:
        raise ConfigError(f"unknown data set {name!r}.{did_you_mean(str(name), VISION)} Use one of "
                          f"{', '.join(VISION)}.", key="data.name")
    cls_name, channels, size, classes, mean, std, layout = VISION[name]
    import importlib

    try:
        tv = importlib.import_module("torchvision")
        datasets, transforms = tv.datasets, tv.transforms
    except Exception as e:  # not installed, or a build that does not match this torch
        raise ConfigError(f"data=torchvision needs torchvision, which does not import here ({type(e).__name__}: "
                          f"{e}). Install the build that matches your torch: pip install 'hookexp[vision]' beside a "
                          "CUDA torch from PyPI; with a CPU torch, pip install torchvision --index-url "
                          "https://download.pytorch.org/whl/cpu (the PyPI wheel is built for the CUDA torch and does "
                          "not import beside the CPU one).", key="data") from None
    if download:  # torchvision makes the folder and fills it
        folder = _base_dir() / str(root)
    else:
        folder = _existing(root, "data.root", f"the folder that holds {cls_name} ({layout})")
    steps = [transforms.ToTensor()] + ([transforms.Normalize(mean, std)] if normalize else [])
    transform = transforms.Compose(steps)
    try:
        train = getattr(datasets, cls_name)(str(folder), train=True, transform=transform, download=download)
        val = getattr(datasets, cls_name)(str(folder), train=False, transform=transform, download=download)
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted. You can use download=True ..."
        expected = layout.replace("ROOT", str(folder))
        raise ConfigError(f"{folder} does not hold {cls_name} ({e}). Expected layout: {expected}; put the files "
                          "there, point data.root at their folder, or set data.download=true where there is "
                          "internet.", key="data.root") from None
    return Splits(train, val, _image_info(channels, size, classes))


# -- HF datasets from disk ----------------------------------------------------------------------------------


def _is_text_feature(feature: Any) -> bool:
    dtype = getattr(feature, "dtype", None)
    if dtype in ("string", "large_string"):
        return True
    inner = getattr(feature, "feature", None)
    return inner is not None and _is_text_feature(inner)


def _load_hf(datasets: Any, path: Any, builder: str | None, data_files: Any) -> Any:
    if builder is None:
        folder = _existing(path, "data.path", "a folder written by save_to_disk")
        try:
            return datasets.load_from_disk(str(folder))
        except FileNotFoundError as e:
            raise ConfigError(f"{folder} is not a folder written by Dataset.save_to_disk ({e}). For json, csv, text "
                              "or parquet files set data.builder (e.g. json) and data.data_files.",
                              key="data.path") from None
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    local = sorted(_PACKAGED_DATASETS_MODULES)
    if builder not in local:
        raise ConfigError(f"unknown builder {builder!r}.{did_you_mean(str(builder), local)} hf_disk reads local "
                          f"files only; use one of {', '.join(local)}.", key="data.builder")
    files = data_files if data_files is not None else path
    if files is None:
        raise ConfigError("is not set; with data.builder give the files to read (or data.path).", key="data.data_files")
    named = files.values() if isinstance(files, Mapping) else [files]
    for entry in named:
        for pattern in [entry] if isinstance(entry, str) else entry:
            if not any(c in str(pattern) for c in "*?[") and not (_base_dir() / str(pattern)).exists():
                _existing(pattern, "data.data_files", f"the {builder} file(s) to read")
    try:
        return datasets.load_dataset(builder, data_files=files)
    except Exception as e:
        raise ConfigError(f"the {builder} builder could not read {files!r}: {type(e).__name__}: {e}.",
                          key="data.data_files") from None


def hf_disk(path: str | None = None, builder: str | None = None, data_files: Any = None, text_column: str = "text",
            tokenizer: str | None = None, block_size: int | None = None, max_length: int | None = None,
            val_fraction: float = 0.1, split_seed: int = 0) -> Splits:
    """A HF ``datasets`` folder written by ``save_to_disk`` (``path``), or local files read by a packaged builder
    (``builder``: json, csv, text, parquet, ...; ``data_files``, default ``path``). Nothing is downloaded.

    Splits: ``train``, and ``validation``, ``val`` or ``test`` (the first present) to validate; without one,
    ``val_fraction`` of train (seeded by ``split_seed``). With ``tokenizer`` (``char`` or a local HF tokenizer
    folder) the ``text_column`` is tokenized: with ``block_size`` the texts are joined and cut into windows
    ``{"input_ids": [block_size]}`` (language modelling, as transformers' run_clm does); without it each row is
    one sequence (cut to ``max_length``), padded per batch by :func:`pad_collate`. A ``label`` column becomes
    ``labels`` (the HF name). Text columns are left out of the tensors. ``info``: vocab_size, block_size, pad_id,
    num_classes (from a ClassLabel or integer labels), vocab (char).
    """
    datasets = _import("datasets", "data", "data=hf_disk")
    if block_size is not None:
        _positive("block_size", block_size)
    if max_length is not None:
        _positive("max_length", max_length)
    loaded = _load_hf(datasets, path, builder, data_files)
    if isinstance(loaded, Mapping):
        if "train" not in loaded:
            raise ConfigError(f"the data has splits {sorted(loaded)} but no 'train'.", key="data.path")
        held_out = next((k for k in ("validation", "val", "test") if k in loaded), None)
        train, val = loaded["train"], loaded[held_out] if held_out else None
    else:
        train, val = loaded, None
    if val is None:
        split = _split_one(train, val_fraction, split_seed, "data.val_fraction")
        train, val = split.train, split.val
    train, val = train.with_format(None), val.with_format(None)
    info: dict[str, Any] = {}
    collate: Callable | None = None
    if "label" in train.column_names and "labels" not in train.column_names:
        train, val = train.rename_column("label", "labels"), val.rename_column("label", "labels")
    if "labels" in train.column_names:
        feature = train.features["labels"]
        if hasattr(feature, "num_classes"):
            info["num_classes"] = feature.num_classes
        elif isinstance(feature, datasets.Value) and feature.dtype.startswith(("int", "uint")):
            info["num_classes"] = max(max(train["labels"]), max(val["labels"])) + 1
    if tokenizer is not None:
        if text_column not in train.column_names:
            raise ConfigError(f"no column {text_column!r}; the data has {', '.join(train.column_names)}."
                              f"{did_you_mean(text_column, train.column_names)}", key="data.text_column")
        if tokenizer == "char":
            chars = CharTokenizer.from_text("".join(train[text_column]) + "".join(val[text_column]))
            info.update(vocab_size=len(chars), vocab=chars.vocab)

            def encode(batch: dict[str, list]) -> dict[str, list]:
                return {"input_ids": [chars.encode(t)[:max_length].tolist() for t in batch[text_column]]}
            pad_id = 0
        else:
            tok = _hf_tokenizer(tokenizer, "data.tokenizer")
            info.update(vocab_size=len(tok), tokenizer=str(tokenizer))
            pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
            if tok.pad_token_id is not None:
                info["pad_id"] = tok.pad_token_id

            def encode(batch: dict[str, list]) -> dict[str, list]:
                cut = {"truncation": True, "max_length": max_length} if max_length else {}
                return dict(tok(batch[text_column], verbose=False, **cut))
        train, val = (d.map(encode, batched=True, remove_columns=[text_column]) for d in (train, val))
        if block_size is not None:
            info["block_size"] = block_size
            windows = []
            for d in (train, val):
                tokens = torch.cat([torch.as_tensor(ids, dtype=torch.int32) for ids in d["input_ids"]])
                if len(tokens) < block_size:
                    raise ConfigError(f"a split has {len(tokens)} tokens, fewer than one window of "
                                      f"block_size={block_size}.", key="data.block_size")
                windows.append(TokenWindows(tokens, block_size, block_size))
            return Splits(windows[0], windows[1], info)
        collate = PadCollate(pad_id)
    texts = [c for c in train.column_names if _is_text_feature(train.features[c])]
    columns = [c for c in train.column_names if c not in texts]
    if texts and tokenizer is None and "input_ids" not in columns:  # else batches would silently lack the text
        raise ConfigError(f"the data has text columns ({', '.join(texts)}) and no input_ids; set data.tokenizer "
                          "(char or a local tokenizer folder) and data.text_column to train on the text, or give "
                          "tokenized data.", key="data.tokenizer")
    if "input_ids" in columns:
        lengths = [len(ids) for d in (train, val) for ids in d["input_ids"]]
        info.setdefault("block_size", max(lengths))
        if "vocab_size" not in info:  # pre-tokenized: the largest id tells the embedding's size
            info["vocab_size"] = max(max(ids) for d in (train, val) for ids in d["input_ids"] if len(ids)) + 1
        if collate is None and len(set(lengths)) > 1:
            collate = PadCollate(0)
    train, val = (d.with_format("torch", columns=columns) for d in (train, val))
    return Splits(train, val, info, collate)
