"""The non-finite guard: ``guard.nan_policy = raise | skip_step | warn | off``.

After backward (and the fp16 unscale), before the update, the guard asks whether the loss and every
gradient are finite. Finiteness is read from each gradient's largest magnitude, not its norm: a float32
norm overflows to inf for finite gradients of large magnitude (``optim.lr=1e10``), which must not count.

- ``skip_step`` decides before each update, so it reads the answer back every step (free on a CPU, one
  sync a step on a GPU) and skips the update of a non-finite step, naming it.
- ``raise`` and ``warn`` on the CPU also read it back every step (it costs nothing there): ``raise``
  stops before a NaN gradient reaches the weights. On a GPU they cost no sync: the first non-finite step
  is remembered on the device and read back with the log step's other values, then raised or warned.
- ``off``: nothing.

The message names the step, the parameters (non-finite values first: where a NaN came in, not where it
spread) and the hook specs that touch them, since a hook is a likely cause. With forensics
(:mod:`hookexp.telemetry.forensics`) it also names the first module whose output went non-finite and whether
its input was finite (the producer) or not (a propagator); so does ``summary.json``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hookexp.errors import ConfigError, NonFiniteError
from hookexp.telemetry.observer import Observer

log = logging.getLogger("hookexp.guard")
POLICIES = ("raise", "skip_step", "warn", "off")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor: this rank's shard


@torch.no_grad()
def largest_magnitude(loss: torch.Tensor | None, grads: list[torch.Tensor]) -> torch.Tensor | None:
    """A 0-d tensor on the device: the largest magnitude of the loss and every gradient, NaN where any is NaN,
    finite exactly when all of them are (three ops a step: one foreach max-norm, a stack, a max); None: nothing
    to check."""
    local = [_local(g) for g in grads if g is not None and g.numel()]
    if loss is not None:
        local.append(loss)
    return torch.stack(torch._foreach_norm(local, float("inf"))).amax() if local else None


def all_finite(loss: torch.Tensor | None, grads: list[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool on the device: the loss and every gradient are finite (by their largest magnitude)."""
    largest = largest_magnitude(loss, grads)
    return torch.ones((), dtype=torch.bool) if largest is None else largest * 0 == 0  # inf * 0 and NaN: NaN


class NonFiniteGuard(Observer):
    """The guard (module docstring), an :class:`~hookexp.telemetry.observer.Observer`: ``allow_update`` decides,
    ``pending`` reads a deferred first bad step on the log step."""

    def __init__(self, policy: str, model: nn.Module, touching: Callable[[list[str]], list[str]] | None = None,
                 device: torch.device | None = None, check_grads: bool = True,
                 agree: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if policy not in POLICIES:
            raise ConfigError(f"unknown policy {policy!r}. Use one of: {', '.join(POLICIES)}.", key="guard.nan_policy")
        self.policy = policy
        self.model = model
        self.touching = touching or (lambda params: [])
        self.check_grads = check_grads  # False under fp16: the GradScaler itself skips overflowing steps
        # FSDP: each rank sees its own shards; agree() makes the answer every rank's (else one rank raises or
        # skips alone and the others wait for it in the next collective)
        self.agree = agree
        self.sync = device is None or device.type == "cpu" or policy == "skip_step"
        self.skipped = 0
        self.warned = 0
        self._first: torch.Tensor | None = None  # the first non-finite step since the last log step (device)
        self.forensics: Any = None  # a Forensics observer, asked where the first non-finite output came from
        self.producer: dict[str, Any] | None = None  # its answer for the first non-finite step

    def allow_update(self, loss: torch.Tensor | None, step: int) -> bool:
        """True to take the optimizer step, False to skip it (``skip_step`` only)."""
        if self.policy == "off":
            return True
        grads = [p.grad for p in self.model.parameters()] if self.check_grads else []
        if self.sync and self.agree is None:  # read back now: the check is on the host (one op fewer than isfinite)
            largest = largest_magnitude(loss, grads)
            if largest is None or math.isfinite(largest.item()):
                return True
            return self._bad(loss, step)
        finite = all_finite(loss, grads)
        if self.agree is not None:
            finite = self.agree(finite)
        if not self.sync:  # raise / warn on a GPU: remember the first bad step, read it on the log step
            here = torch.where(finite, -1, step)
            self._first = here if self._first is None else torch.where(self._first >= 0, self._first, here)
            return True
        if bool(finite):
            return True
        return self._bad(loss, step)

    def _bad(self, loss: torch.Tensor | None, step: int) -> bool:
        """A non-finite step read now: skip it (False) or report it."""
        message = self.describe(loss, step)
        if self.policy == "skip_step":
            self.skipped += 1
            log.warning("%s Skipping this update (guard.nan_policy=skip_step).", message)
            return False
        self._report(message)
        return True

    def _report(self, message: str) -> None:
        if self.policy == "raise":
            raise NonFiniteError(message + " Set guard.nan_policy=skip_step to skip such updates, or warn to go on.")
        self.warned += 1
        log.warning("%s Going on (guard.nan_policy=warn).", message)

    def pending(self) -> tuple[torch.Tensor | None, Callable[[list[float]], dict[str, Any]]]:
        """The deferred first bad step for the log step's read-back (None when every step was checked)."""
        first, self._first = self._first, None
        return (None if first is None else first.reshape(1).double()), self._decode

    def _decode(self, values: Any) -> dict[str, Any]:
        if len(values) and values[0] >= 0:
            self._report(self.describe(None, int(values[0]), deferred=True))
        return {}

    def refuse_checkpoint(self, step: int, saved_step: int | None) -> None:
        """The model went non-finite before a checkpoint was due: raise (``raise``) or warn, naming the first bad
        step (read back from the device: checkpoints are rare) — never write that state."""
        first = self._first
        bad = int(first.item()) if first is not None and int(first.item()) >= 0 else step - 1
        kept = f": the last good one (step {saved_step}) is kept" if saved_step is not None else \
            ", and there is no earlier one"
        message = f"{self.describe(None, bad, deferred=True)} No checkpoint was written at step {step}{kept}."
        if self.policy == "raise":
            raise NonFiniteError(message)
        self.warned += 1
        log.warning("%s", message)

    def describe(self, loss: torch.Tensor | None, step: int, most: int = 5, deferred: bool = False) -> str:
        values: list[str] = []
        grads: list[str] = []
        for name, p in self.model.named_parameters():
            grad_bad = p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())
            if not bool(torch.isfinite(_local(p.detach())).all()):
                values.append(f"{name} (value{' and gradient' if grad_bad else ''})")
            elif grad_bad:
                grads.append(f"{name} (gradient)")
        bad = values + grads
        loss_text = "" if loss is None else f"loss {loss.detach().float().item():g}; "
        params = ", ".join(bad[:most]) + (f" and {len(bad) - most} more" if len(bad) > most else "")
        hooks = ", ".join(self.touching([b.split(" ")[0] for b in bad])) or "none"
        now = " (now)" if deferred else ""
        return (f"non-finite loss or gradient at step {step}: {loss_text}parameters{now}: {params or 'none'}; "
                f"hooks touching them: {hooks}.{self._where(step)}")

    def _where(self, step: int) -> str:
        """Forensics' answer: the first module whose output went non-finite, and whether its input was finite."""
        if self.forensics is None:
            return ""
        if self.producer is not None:  # forensics looks at the first non-finite step only
            first = self.producer
            return f" The first non-finite module output was {first['module']}, at step {first['step']}."
        report = self.forensics.report(step, "non-finite")
        outputs = report.nonfinite_outputs()
        if not outputs:
            return " No module output was non-finite (the loss or a gradient went first)."
        first = outputs[0]
        finite = first.get("input") != "non-finite"
        self.producer = {"module": first["target"], "step": first["step"], "inputs_finite": finite}
        role = "its input finite: it produced the first non-finite value" if finite else \
            "its input already non-finite: it propagated a non-finite value from outside any module"
        after = [e["target"] for e in outputs[1:4]]
        then = f"; then {', '.join(after)}" if after else ""
        return f" First non-finite module output: {first['target']} at step {first['step']} ({role}){then}."

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"guard/skipped_steps": self.skipped, "guard/nonfinite_warnings": self.warned}
        if self.producer is not None:
            out.update({"guard/first_nonfinite_module": self.producer["module"],
                        "guard/first_nonfinite_step": self.producer["step"],
                        "guard/first_nonfinite_inputs_finite": self.producer["inputs_finite"]})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"guard/skipped_steps": self.skipped, "guard/nonfinite_warnings": self.warned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = int(state["guard/skipped_steps"])
        self.warned = int(state["guard/nonfinite_warnings"])
