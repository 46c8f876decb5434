"""A user's stream of labelled vectors with a poisoned stretch: the inputs of some batches scaled by 1000.

``make(poison=[23, 24], batch_size=32)``: (train, val) for ``data.dataset._target_=poisoned.make``; batch ``i`` of
every epoch holds examples ``i * batch_size ...`` (a stream is read in order). ``drop=true`` leaves the poisoned
batches out instead (the same data without them).
"""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset, TensorDataset


class Stream(IterableDataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __iter__(self):
        return iter(zip(self.x, self.y, strict=True))


def make(poison: list[int] = (), batch_size: int = 32, n: int = 2048, dim: int = 16, classes: int = 4,
         factor: float = 1000.0, drop: bool = False):
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(dim, classes, generator=gen)
    x = torch.randn(n + 512, dim, generator=gen)
    y = (x @ teacher).argmax(1)
    train_x, train_y, val = x[:n].clone(), y[:n], TensorDataset(x[n:], y[n:])
    keep = torch.ones(n, dtype=torch.bool)
    for b in poison:
        rows = slice(b * batch_size, (b + 1) * batch_size)
        if drop:
            keep[rows] = False
        else:
            train_x[rows] *= factor
    return Stream(train_x[keep], train_y[keep]), val


def kill_once(x, ctx, step: int, marker: str):
    """Changes nothing; SIGKILLs this process during training step ``step`` unless the file ``marker`` exists
    (it is created first: a resumed run that passes the step again goes on)."""
    import os
    import signal
    from pathlib import Path

    if ctx.step == step and not Path(marker).exists():
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return x
