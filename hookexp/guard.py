"""The non-finite guard: ``trainer.nan_policy = raise | skip_step | warn | off``.

``raise`` and ``warn`` cost nothing on steps that do not log: the trainer's meter keeps every step's
loss on the device, and the log step reads them back with the statistics, then raises (or warns)
naming the first step whose loss was NaN/Inf. ``skip_step`` must decide before each update, so
it reads the loss and every gradient's norm back on every step (one sync a step, free on CPU).
The message names the step, the first affected parameters (non-finite values first: where a NaN came
in) and the hook specs that touch them, since a hook is a likely cause.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from hookexp.engine import HookHandle
from hookexp.errors import ConfigError, HookexpError

log = logging.getLogger("hookexp.guard")
POLICIES = ("raise", "skip_step", "warn", "off")


class NonFiniteError(HookexpError, FloatingPointError):
    """A loss or gradient became NaN or Inf and ``trainer.nan_policy`` is ``raise``."""


class NonFiniteGuard:
    def __init__(self, policy: str, model: nn.Module, hooks: HookHandle, check_grads: bool = True):
        if policy not in POLICIES:
            raise ConfigError(f"unknown policy {policy!r}. Use one of: {', '.join(POLICIES)}.",
                              key="trainer.nan_policy")
        self.policy = policy
        self.check_grads = check_grads
        self.model = model
        self.hooks = hooks
        self.skipped = 0
        self.warned = 0

    def grads_finite(self) -> bool:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return True
        return bool(torch.stack(torch._foreach_norm(grads)).isfinite().all())

    def check(self, loss: torch.Tensor, step: int) -> bool:
        """Before ``optimizer.step()``: True to take the step, False to skip it. Only ``skip_step``
        looks at anything here; ``raise`` and ``warn`` are decided on the log step."""
        if self.policy != "skip_step":
            return True
        finite = bool(torch.isfinite(loss.detach()).all())
        if finite and self.check_grads:
            finite = self.grads_finite()
        if finite:
            return True
        self.skipped += 1
        log.warning("%s Skipping this step (trainer.nan_policy=skip_step).", self.describe(loss, step))
        return False

    def on_log_step(self, first_bad: int | None, loss: torch.Tensor, step: int) -> None:
        """On a log step: raise (or warn) if a loss since the last log step was non-finite;
        ``first_bad`` is the first such step (the trainer's meter read it with the statistics)."""
        if self.policy not in ("raise", "warn") or first_bad is None:
            return
        message = self.describe(loss, first_bad, seen_at=step)
        if self.policy == "raise":
            raise NonFiniteError(message + " Set trainer.nan_policy=skip_step to skip such steps, or warn to go on.")
        self.warned += 1
        log.warning("%s Going on (trainer.nan_policy=warn).", message)

    def describe(self, loss: torch.Tensor, step: int, most: int = 5, seen_at: int | None = None) -> str:
        values: list[str] = []  # non-finite parameters first: where a NaN came in, not where it spread
        grads: list[str] = []
        for name, p in self.model.named_parameters():
            grad_bad = p.grad is not None and not bool(torch.isfinite(p.grad).all())
            if not bool(torch.isfinite(p.detach()).all()):
                values.append(f"{name} (value{' and gradient' if grad_bad else ''})")
            elif grad_bad:
                grads.append(f"{name} (gradient)")
        bad = values + grads
        touching = self._hooks_touching([b.split(" ")[0] for b in bad])
        loss_text = f"loss {loss.detach().float().item():g}" + (f" at step {seen_at}" if seen_at is not None else "")
        params = ", ".join(bad[:most]) + (f" and {len(bad) - most} more" if len(bad) > most else "") or "none"
        hooks = ", ".join(touching) or "none"
        first = "first non-finite loss" if seen_at is not None else "non-finite values"
        return f"{first} at step {step}: {loss_text}; parameters: {params}; hooks touching them: {hooks}."

    def _hooks_touching(self, params: list[str]) -> list[str]:
        """Specs whose targets are these parameters, or modules that own them."""
        out = []
        for b in self.hooks.bindings:
            if not b.spec.enabled:
                continue
            for t in b.targets:
                if any(p in t.names or any(p.startswith(n + ".") or n == "" for n in t.names) for p in params):
                    out.append(f"{b.spec.name} ({b.spec.kind} {b.transform.name} on {t.name})")
                    break
        return out


def as_dict(guard: NonFiniteGuard) -> dict[str, Any]:
    return {"guard/skipped_steps": guard.skipped, "guard/nonfinite_warnings": guard.warned}
