"""The task's training metrics between log steps, as sums on the device: no host sync on other steps.

Each micro-batch adds its task's ``(sums, count)`` (:meth:`hookexp.workloads.tasks.Task.sums`) into two running
tensors — two in-place adds a micro-batch, which also widen to float64 (no separate cast). The log step
takes their row with the other producers' values in one device-to-host copy (:meth:`TrainMeter.pending`
gives the row and its decoder) and starts a new period.
Under DDP the sums are added over ranks there, in the one collective of the log step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hookexp.telemetry.observer import Observer
from hookexp.telemetry.readback import wide_dtype

Decoder = Callable[[Any], dict[str, float]]


class _OneProcess:
    enabled, world_size, rank, is_main = False, 1, 0, True


class TrainMeter(Observer):
    """``train/<metric>`` of the steps since the last log step: the task's sums over counted items. ``task``:
    a :class:`hookexp.workloads.tasks.Task` (``metric_names``, ``finish``); ``ranks``: the run's ranks
    (:class:`hookexp.run.distributed.Dist`: ``enabled``, ``sum``, ``gather``, ``world_size``, ``rank``,
    ``is_main``), None for one process."""

    def __init__(self, task: Any, device: torch.device, ranks: Any = None):
        self.task = task
        self.names = tuple(task.metric_names)
        self.device = device
        self.ranks = ranks or _OneProcess()
        self._dtype = wide_dtype(device)
        self._sums = torch.zeros(len(self.names), dtype=self._dtype, device=device)
        self._count = torch.zeros((), dtype=self._dtype, device=device)

    @property
    def totals(self) -> torch.Tensor:
        """sums..., count: one row."""
        return torch.cat([self._sums, self._count.reshape(1)])

    @torch.no_grad()
    def add(self, sums: torch.Tensor, count: torch.Tensor | float) -> None:
        self._sums.add_(sums)  # float64 += float32: widened in the add, no copy first
        self._count.add_(count)

    def pending(self) -> tuple[torch.Tensor, Decoder]:
        """The period's totals (summed over ranks under DDP) and the decoder of their host values; resets."""
        totals = self.totals
        self._sums, self._count = torch.zeros_like(self._sums), torch.zeros_like(self._count)
        if self.ranks.enabled:
            totals = self.ranks.sum(totals)
        return totals, self.decode

    def keys(self) -> list[str]:
        """The ``train/<metric>`` keys a log step gives."""
        return list(self.decode([1.0] * (len(self.names) + 1)))

    def decode(self, values: Any) -> dict[str, float]:
        *sums, count = (float(v) for v in values)
        means = {n: s / count if count else float("nan") for n, s in zip(self.names, sums, strict=True)}
        return {f"train/{k}": v for k, v in self.task.finish(means).items()}

    def state_dict(self) -> dict[str, Any]:
        """The period's sums of every rank (a row each: under DDP/FSDP each rank has summed its own batches)."""
        totals = self.totals.detach()  # a new tensor (a cat): no live state is shared
        if not self.ranks.enabled:  # left on the device: a rollback snapshot copies it without a host sync
            return {"totals": totals[None]}
        return {"totals": torch.stack(self.ranks.gather(totals.cpu()))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's row (a checkpoint of another world size: rank 0 carries their sum)."""
        rows = state["totals"]
        if rows.dim() == 1:  # one process's checkpoint
            rows = rows[None]
        if len(rows) == self.ranks.world_size:
            mine = rows[self.ranks.rank]
        else:
            mine = rows.sum(dim=0) if self.ranks.is_main else torch.zeros_like(rows[0])
        mine = mine.to(self.device, self._dtype).clone()
        self._sums, self._count = mine[:-1].clone(), mine[-1].clone()
