"""Learning-rate schedules for the ``scheduler`` config group, stepped once per optimizer step.

Each factory takes the optimizer and the run's ``total_steps`` (the trainer passes both) and returns a
torch ``LRScheduler``, so its state goes into checkpoints as torch's own does. A user schedule is any
``_target_`` taking ``optimizer`` (and ``total_steps`` if it wants it), e.g. ``torch.optim.lr_scheduler.StepLR``.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR


class _Warmup:
    """Multiplier: linear from 1/(warmup+1) up to 1 over the first ``warmup`` steps (``from_zero``: t/warmup,
    0 at the first step, as ``LambdaLR(lambda t: min(t / warmup, 1))`` in many papers' code), then ``after(t)``.

    A class, not a lambda: LambdaLR saves callable objects' ``__dict__`` in its state_dict."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.0, cosine: bool = False,
                 from_zero: bool = False):
        self.warmup_steps, self.total_steps, self.min_ratio, self.cosine = warmup_steps, total_steps, min_ratio, cosine
        self.from_zero = from_zero

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps if self.from_zero else (step + 1) / (self.warmup_steps + 1)
        if not self.cosine:
            return 1.0
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check(warmup_steps: int, min_lr_ratio: float = 0.0) -> None:
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be a non-negative integer, got {warmup_steps!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")


def constant(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
             warmup_from_zero: bool = False) -> LRScheduler:
    """The optimizer's lr, after a linear warmup over ``warmup_steps`` updates (``warmup_from_zero``: the
    multiplier is step / warmup_steps, 0 on the first update; else (step + 1) / (warmup_steps + 1))."""
    _check(warmup_steps)
    return LambdaLR(optimizer, _Warmup(warmup_steps, total_steps, from_zero=bool(warmup_from_zero)))


def cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
           min_lr_ratio: float = 0.0, warmup_from_zero: bool = False) -> LRScheduler:
    """Linear warmup over ``warmup_steps`` (``warmup_from_zero``: as :func:`constant`'s), then a cosine decay to
    ``min_lr_ratio`` x lr at ``total_steps``."""
    _check(warmup_steps, min_lr_ratio)
    return LambdaLR(optimizer, _Warmup(warmup_steps, total_steps, min_lr_ratio, cosine=True,
                                       from_zero=bool(warmup_from_zero)))


def step(optimizer: torch.optim.Optimizer, total_steps: int, step_size: int, gamma: float = 0.1) -> LRScheduler:
    """Multiply the lr by ``gamma`` every ``step_size`` updates (torch's StepLR)."""
    if not isinstance(step_size, int) or step_size < 1:
        raise ValueError(f"step_size must be a positive integer, got {step_size!r}")
    return StepLR(optimizer, step_size=step_size, gamma=gamma)
