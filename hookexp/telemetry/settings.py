"""The settings of the spike recorder and of forensics (``guard.spike``, ``guard.forensics``): every default and
check once, here; :mod:`hookexp.config` puts them in the run's schema, :func:`hookexp.watch` takes their keys.
Imports no torch (the config schema is read without it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hookexp.errors import ConfigError


def _whole(key: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"must be a whole number of at least {least}, got {value!r}.", key=key)


@dataclass
class SpikeConfig:
    """``guard.spike``: the spike recorder (hookexp/telemetry/spike.py). Every step, ``metric`` is compared with the
    median of its last ``window`` steps; on a spike: log every step for ``steps`` steps, turn on the ``record``
    specs for them, save a checkpoint and write the steps and batches to spikes.jsonl."""

    metric: Optional[str] = None  # noqa: UP045 - e.g. train/loss or grad/global_norm; null: off
    window: int = 20  # steps of history the metric is compared with (judged from the 5th value on)
    threshold: float = 3.0  # a spike: the metric above threshold x the median of its window ...
    min_value: float = 0.0  # ... and above this
    steps: int = 10  # log every step for this many steps after a spike
    # hook specs with transform: record that act only in a spike's window
    record: list[str] = field(default_factory=list)
    checkpoint: bool = True  # save a checkpoint at each spike

    def __post_init__(self) -> None:
        _whole("guard.spike.window", self.window, 1)
        _whole("guard.spike.steps", self.steps, 1)
        if not self.threshold > 1:
            raise ConfigError(f"must be above 1 (a spike is the metric above threshold x its recent median), got "
                              f"{self.threshold!r}.", key="guard.spike.threshold")


@dataclass
class ForensicsConfig:
    """``guard.forensics``: which layer went wrong first (hookexp/telemetry/forensics.py). On wherever the guard
    (nan_policy other than off) or the spike recorder is on: a ring buffer on the device keeps, every step, the
    norm of each module's output and input and of each parameter's gradient, optimizer state and weight (and update);
    a spike or a non-finite step ranks them by the step each left its own recent range."""

    window: int = 32  # steps kept (at least 4); 0: off
    z: float = 8.0  # the robust z-score of log(norm) against its earlier steps that counts as leaving the range
    top: int = 10  # targets listed in spikes.jsonl's "first"
    # also the update norms: costs one copy of the weights on the device (memory) and three passes over them a step
    updates: bool = False

    def __post_init__(self) -> None:
        if self.window != 0:
            _whole("guard.forensics.window", self.window, 4)
        _whole("guard.forensics.top", self.top, 1)
        if isinstance(self.z, bool) or not isinstance(self.z, (int, float)) or not self.z > 0:
            raise ConfigError(f"must be a positive z-score, got {self.z!r}.", key="guard.forensics.z")
