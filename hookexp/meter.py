"""Training loss and accuracy between log steps, at one kernel a step and no host sync.

A step only keeps references: its (detached) loss and the argmax of its logits (the one kernel).
The log step turns them into one small tensor (:meth:`TrainMeter.pending`), which the trainer reads
together with the statistics in a single transfer. On the CPU, where there is nothing to transfer, it
reads them as host values straight away: building that tensor (and joining it to the statistics) cost a
CPU log step more torch ops than reading it. The per-step losses come back too, so the non-finite guard
can name the first step whose loss was NaN/Inf without a check on every step.
Past ``FOLD`` kept steps (a log period longer than that) the references are folded into a running
total on the device. Under DDP the pending tensor also carries the totals summed over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hookexp.stats import wide_dtype

AllReduce = Callable[[torch.Tensor], torch.Tensor]


class TrainMeter:
    """Loss and accuracy of the steps since the last :meth:`read`.

    The local pending values are ``[carried loss sum, carried correct, carried index of the first
    non-finite loss or -1, correct of the kept steps, the kept steps' losses...]``.
    """

    FOLD = 256

    def __init__(self, device: torch.device, loss_sum: float = 0.0, correct: int = 0, seen: int = 0,
                 batches: int = 0, first_step: int = 0, all_reduce: AllReduce | None = None):
        self.device = device
        self._wide = wide_dtype(device)
        self._all_reduce = all_reduce
        self._losses: list[torch.Tensor] = []
        self._preds: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        # a new period's carry, made once (never written in place): no copy to the device per log step
        self._fresh = torch.tensor([0.0, 0.0, -1.0], dtype=self._wide).to(device)
        # on the CPU alone (not under DDP, whose totals are summed as a tensor): pending() gives host values
        self.host = device.type == "cpu" and all_reduce is None
        self._start(loss_sum, correct, seen, batches)
        self._first_step = first_step  # the step of the period's first batch

    def _start(self, loss_sum: float = 0.0, correct: int = 0, seen: int = 0, batches: int = 0) -> None:
        self._carry = self._fresh
        if loss_sum or correct:  # resumed from a checkpoint (once per run)
            self._carry = torch.tensor([loss_sum, float(correct), -1.0], dtype=self._wide).to(self.device)
        self.seen, self.batches = seen, batches

    def _drop_kept(self) -> None:
        self._losses.clear()
        self._preds.clear()
        self._labels.clear()

    def add(self, step: int, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        if self.batches == 0:
            self._first_step = step
        self._losses.append(loss.detach())
        self._preds.append(logits.detach().argmax(dim=1))
        self._labels.append(labels)
        self.seen += len(labels)
        self.batches += 1
        if len(self._losses) >= self.FOLD:
            self._fold()

    def _kept(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept steps' correct count and their losses (None: no step kept since the last read or fold)."""
        if not self._losses:
            return None
        # one batch since the last log step, the usual case, costs no cat or stack of its own
        if len(self._losses) == 1:
            return (self._preds[0] == self._labels[0]).sum(), self._losses[0]
        return (torch.cat(self._preds) == torch.cat(self._labels)).sum(), torch.stack(self._losses)

    def _local(self) -> torch.Tensor:
        kept = self._kept()
        if kept is None:
            return torch.cat([self._carry, self._carry.new_zeros(1)])
        # (torch.cat promotes the int64 count and float32 losses to the carry's dtype: no conversion op)
        return torch.cat([self._carry, kept[0].reshape(1), kept[1].reshape(-1)])

    def _local_host(self) -> list[float]:
        """:meth:`_local`'s values, read on the host (the CPU): the same numbers, without building a tensor."""
        kept = self._kept()
        if kept is None:
            return [*self._carry.tolist(), 0.0]
        return [*self._carry.tolist(), float(kept[0].item()), *kept[1].reshape(-1).tolist()]

    def _fold(self) -> None:
        local = self._local()
        losses = local[4:]
        index = torch.arange(len(losses), device=losses.device, dtype=self._wide) + (self.batches - len(losses))
        first_bad = torch.where(losses.isfinite(), math.inf, index).min()
        first = torch.where(local[2] >= 0, local[2], torch.where(first_bad.isfinite(), first_bad, -1.0))
        self._carry = torch.stack([local[0] + losses.sum(), local[1] + local[3], first])
        self._drop_kept()

    def pending(self) -> torch.Tensor | list[float]:
        """What :meth:`read` decodes: the local values and, under DDP, first ``[loss sum, correct, batches,
        seen]`` summed over ranks; a tensor on the device, or (where :attr:`host`: the CPU) host values."""
        if self.host:
            return self._local_host()
        local = self._local()
        if self._all_reduce is None:
            return local
        counts = local.new_tensor([float(self.batches), float(self.seen)])
        totals = torch.cat([torch.stack([local[0] + local[4:].sum(), local[1] + local[3]]), counts])
        return torch.cat([self._all_reduce(totals), local])

    def _decode(self, local: list[float]) -> tuple[float, float, int]:
        """Loss sum, correct count and the period index of the first non-finite loss (or -1)."""
        losses = local[4:]
        first_bad = int(local[2])
        if first_bad < 0:
            first_bad = next((self.batches - len(losses) + i for i, v in enumerate(losses) if not math.isfinite(v)), -1)
        return local[0] + math.fsum(losses), local[1] + local[3], first_bad

    def read(self, host: list[float]) -> tuple[float, float, int | None]:
        """Mean loss, accuracy (over every rank under DDP) and the step of this rank's first
        non-finite loss (or None) from the values of :meth:`pending`; starts the next period."""
        totals, local = (host[:4], host[4:]) if self._all_reduce is not None else (None, host)
        loss_sum, correct, first_bad = self._decode(local)
        batches, seen = self.batches, self.seen
        if totals is not None:
            loss_sum, correct, batches, seen = totals
        first = None if first_bad < 0 else self._first_step + first_bad
        self._drop_kept()
        self._start()
        return loss_sum / max(batches, 1), correct / max(seen, 1), first

    def snapshot(self) -> dict[str, float | int]:
        """This rank's running totals for a checkpoint (one host read; checkpoints are rare)."""
        loss_sum, correct, _ = self._decode(self._local().tolist())
        return {"loss_sum": loss_sum, "correct": int(correct), "seen": self.seen, "batches": self.batches}
