"""What a transform knows about the call it is in (:class:`HookContext`) and what ``record`` keeps
(:class:`Record`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hookexp.engine.shards import Shards


@dataclass
class HookContext:
    """What a transform knows about the call it is in. Valid for the duration of the call only: the
    engine reuses one context per target rather than allocating one per call."""

    spec: str
    kind: str
    target: str
    step: int
    index: int | str | None = None
    aux: Any = None
    state: dict[str, Any] = field(default_factory=dict)
    records: list[Record] | None = None
    measuring: bool = False
    emitted: dict[str, list[torch.Tensor]] | None = None
    targets: list[str] | None = None  # batched pre_step calls: the target of each tensor, in order
    shards: Shards | None = None  # parameter kinds under FSDP: the tensor is this rank's shard of these groups

    def sum_over_shards(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks holding the other shards of the tensor (``t`` itself when unsharded)."""
        return t if self.shards is None else self.shards.sum(t)

    def emit(self, name: str, value: torch.Tensor | float) -> None:
        """Report a measurement (mean over calls) as ``hook/<spec>/<name>``; only while measuring,
        i.e. on log steps. Keep ``value`` on the device: it is read back with the other statistics."""
        if self.measuring and self.emitted is not None:
            self.emitted.setdefault(name, []).append(torch.as_tensor(value, dtype=torch.float32).detach())


@dataclass
class Record:
    """One value a ``record`` transform kept: detached copies, never part of the autograd graph."""

    spec: str
    target: str
    step: int
    value: Any
    aux: Any = None
