"""Images and tabular data held in memory: ``digits`` (scikit-learn), ``synthetic`` and ``synthetic_regression``
(seeded generators)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from hookexp.errors import ConfigError
from hookexp.workloads.data.splits import Splits, TensorSet, _split_one, check_count, check_fraction


def _split(x: torch.Tensor, y: torch.Tensor, val_fraction: float, split_seed: int, info: dict[str, Any]) -> Splits:
    check_fraction(val_fraction, "data.val_fraction")
    splits = _split_one(TensorSet(x, y), val_fraction, split_seed, "data.dataset")
    splits.info = info
    return splits


def _image_info(channels: int, image_size: int, num_classes: int) -> dict[str, int]:
    """What an image set tells a model; ``input_dim``/``output_dim`` let a flat MLP take it too."""
    return {"num_classes": num_classes, "in_channels": channels, "image_size": image_size,
            "input_dim": channels * image_size * image_size, "output_dim": num_classes}


def _digits_arrays() -> tuple[Any, Any]:
    """The digits' images [1797, 8, 8] and labels, read from the file scikit-learn ships (what ``load_digits``
    reads) without importing ``sklearn.datasets`` (~1.4 s of a run's start); ``load_digits`` where the file moved."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target


def digits(val_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    """scikit-learn's digits: 1,797 grey 8x8 images of 10 classes, scaled to [0, 1]; batches ``(x, y)``."""
    images, target = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(target, dtype=torch.long)
    return _split(x, y, val_fraction, split_seed, _image_info(1, 8, 10))


def synthetic(n: int = 2048, channels: int = 3, image_size: int = 8, num_classes: int = 5,
              val_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    """Gaussian images labelled by a fixed random linear teacher: learnable, seeded, any size."""
    for name, value in (("n", n), ("channels", channels), ("image_size", image_size)):
        check_count(name, value)
    check_count("num_classes", num_classes, 2)
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
        check_count(name, value)
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or noise < 0:
        raise ConfigError(f"must be a number of at least 0, got {noise!r}.", key="data.noise")
    gen = torch.Generator().manual_seed(split_seed)
    x = torch.randn(n, input_dim, generator=gen)
    hidden = torch.tanh(x @ torch.randn(input_dim, 32, generator=gen) / math.sqrt(input_dim))
    y = hidden @ torch.randn(32, output_dim, generator=gen) / math.sqrt(32)
    y = y + noise * torch.randn(n, output_dim, generator=gen)
    return _split(x, y, val_fraction, split_seed, {"input_dim": input_dim, "output_dim": output_dim})
