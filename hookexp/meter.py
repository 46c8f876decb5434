"""Training loss and accuracy between log steps, at one kernel a step and no host sync.

A step only keeps references: its (detached) loss and the argmax of its logits (the one kernel).
The log step reduces them and hands back one small tensor, which the trainer reads together with the
statistics in a single transfer. The per-step losses come back too, so the non-finite guard can name
the first step whose loss was NaN/Inf without a check on every step. Past ``FOLD`` kept steps (a log
period longer than that) the references are folded into a running total on the device.
"""

from __future__ import annotations

import math

import torch

from hookexp.stats import wide_dtype


class TrainMeter:
    """Loss and accuracy of the steps since the last :meth:`read`."""

    FOLD = 256

    def __init__(self, device: torch.device, loss_sum: float = 0.0, correct: int = 0, seen: int = 0,
                 batches: int = 0, first_step: int = 0):
        self.device = device
        self._wide = wide_dtype(device)
        self._losses: list[torch.Tensor] = []
        self._preds: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        # folded steps: [loss sum, correct, index of the first non-finite loss or -1]
        self._carry = torch.tensor([loss_sum, float(correct), -1.0], device=device, dtype=self._wide)
        self._first_step = first_step  # the step of the period's first batch
        self.seen, self.batches = seen, batches

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

    def _correct(self) -> torch.Tensor:
        return (torch.cat(self._preds) == torch.cat(self._labels)).sum().to(self._wide)

    def _fold(self) -> None:
        losses = torch.stack(self._losses).to(self._wide)
        index = torch.arange(len(losses), device=losses.device, dtype=self._wide) + (self.batches - len(losses))
        first_bad = torch.where(losses.isfinite(), math.inf, index).min()
        first = torch.where(self._carry[2] >= 0, self._carry[2], torch.where(first_bad.isfinite(), first_bad, -1.0))
        self._carry = torch.stack([self._carry[0] + losses.sum(), self._carry[1] + self._correct(), first])
        self._losses.clear()
        self._preds.clear()
        self._labels.clear()

    def pending(self) -> torch.Tensor:
        """What :meth:`read` decodes: the carry and the kept losses and correct count (device)."""
        if not self._losses:
            return self._carry
        losses = torch.stack(self._losses).to(self._wide)
        return torch.cat([self._carry, self._correct().reshape(1), losses])

    def totals(self) -> torch.Tensor:
        """``[loss sum, correct, batches, seen]`` on the device (what ranks sum under DDP)."""
        loss_sum, correct = self._carry[0], self._carry[1]
        if self._losses:
            loss_sum = loss_sum + torch.stack(self._losses).to(self._wide).sum()
            correct = correct + self._correct()
        counts = torch.tensor([float(self.batches), float(self.seen)], device=self._carry.device, dtype=self._wide)
        return torch.cat([torch.stack([loss_sum, correct]), counts])

    def read(self, host: list[float]) -> tuple[float, float, int | None]:
        """Mean loss, accuracy and the step of the first non-finite loss (or None) from the values
        of :meth:`pending`; starts the next period."""
        loss_sum, correct, first_bad = host[0], host[1], host[2]
        if len(host) > 3:
            losses = host[4:]
            correct += host[3]
            loss_sum += math.fsum(losses)
            if first_bad < 0:
                first_bad = next((self.batches - len(losses) + i for i, v in enumerate(losses)
                                  if not math.isfinite(v)), -1)
        batches, seen = max(self.batches, 1), max(self.seen, 1)
        first = None if first_bad < 0 else self._first_step + int(first_bad)
        self.reset()
        return loss_sum / batches, correct / seen, first

    def reset(self) -> None:
        self._losses.clear()
        self._preds.clear()
        self._labels.clear()
        self._carry = torch.tensor([0.0, 0.0, -1.0], device=self.device, dtype=self._wide)
        self.seen = self.batches = 0

    def snapshot(self) -> dict[str, float | int]:
        """The running totals for a checkpoint (one host read; checkpoints are rare)."""
        host = self.pending().tolist()
        correct = host[1] + (host[3] if len(host) > 3 else 0.0)
        loss_sum = host[0] + math.fsum(host[4:])
        return {"loss_sum": loss_sum, "correct": int(correct), "seen": self.seen, "batches": self.batches}
