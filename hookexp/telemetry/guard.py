"""The non-finite guard: ``guard.nan_policy = raise | skip_step | warn | off``.

After backward (and the fp16 unscale), before the update, the guard asks on the device whether the loss and every
gradient are finite (by their largest magnitude: a float32 norm overflows for finite large gradients).
``skip_step`` reads the answer back every step (one sync a step on a GPU); ``raise`` and ``warn`` read it at
once on a CPU and, on a GPU, a step later from pinned memory (no sync). The message names the step, the
parameters, the hook specs touching them and, with forensics, the first module whose output went non-finite;
:attr:`NonFiniteGuard.event` gives the step and forensics' onset. Narrative: docs/statistics.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookexp.engine.shards import local_part
from hookexp.errors import ConfigError, NonFiniteError
from hookexp.telemetry.observer import Observer
from hookexp.telemetry.spike import Deferred

log = logging.getLogger("hookexp.guard")
POLICIES = ("raise", "skip_step", "warn", "off", "rollback")



@torch.no_grad()
def largest_magnitude(loss: torch.Tensor | None, grads: list[torch.Tensor]) -> torch.Tensor | None:
    """A 0-d tensor on the device: the largest magnitude of the loss and every gradient, NaN where any is NaN,
    finite exactly when all of them are (three ops a step: one foreach max-norm, a stack, a max); None: nothing
    to check."""
    local = [local_part(g) for g in grads if g is not None and g.numel()]
    if loss is not None:
        local.append(loss)
    return torch.stack(torch._foreach_norm(local, float("inf"))).amax() if local else None


def all_finite(loss: torch.Tensor | None, grads: list[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool on the device: the loss and every gradient are finite (by their largest magnitude)."""
    largest = largest_magnitude(loss, grads)
    return torch.ones((), dtype=torch.bool) if largest is None else largest * 0 == 0  # inf * 0 and NaN: NaN


@dataclass
class NonFinite:
    """A non-finite step the guard reported: ``step``, and ``onset``, the step forensics' first-ranked target left
    its range (None without forensics, or when nothing did)."""

    step: int
    onset: int | None = None


class NonFiniteGuard(Observer):
    """The guard (module docstring), an :class:`~hookexp.telemetry.observer.Observer`: ``allow_update`` decides,
    ``end`` reads the deferred flags that have arrived and ``settle`` every one on its way."""

    def __init__(self, policy: str, model: nn.Module, device: torch.device | None = None, check_grads: bool = True):
        if policy not in POLICIES:
            raise ConfigError(f"unknown policy {policy!r}. Use one of: {', '.join(POLICIES)}.", key="guard.nan_policy")
        self.policy = policy
        self.model = model
        # the specs whose targets own these parameters (the builder sets it from the hooks), for the error
        self.touching: Callable[[list[str]], list[str]] = lambda params: []
        self.check_grads = check_grads  # False under fp16: the GradScaler itself skips overflowing steps
        self.params: list[nn.Parameter] | None = None  # the model's, listed at the first check
        # FSDP: each rank sees its own shards; agree() makes the answer every rank's (else one rank raises or
        # skips alone and the others wait for it in the next collective)
        self.agree: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.sync = device is None or device.type == "cpu" or policy in ("skip_step", "rollback")
        self.rollback_step: int | None = None  # rollback: the non-finite step the trainer rolls back from
        self.skipped = 0
        self.warned = 0
        self.deferred = Deferred()  # raise / warn on a GPU: each step's flag (-1, or the step), read a step later
        self._told = False  # a deferred bad step was reported since the last log step (warn once a period)
        self._logging = False  # the current step logs (its end closes the period)
        self.event: NonFinite | None = None  # the last non-finite step reported
        self.forensics: Any = None  # a Forensics observer, asked where the first non-finite output came from
        self.producer: dict[str, Any] | None = None  # its answer for the first non-finite step

    def allow_update(self, loss: torch.Tensor | None, step: int) -> bool:
        """True to take the optimizer step, False to skip it (``skip_step`` only)."""
        if self.policy == "off":
            return True
        if self.params is None:  # walked once: named_modules() on every step costs ~1 ms on a 12-block GPT's CPU
            self.params = list(self.model.parameters())
        grads = [p.grad for p in self.params] if self.check_grads else []
        if self.sync and self.agree is None:  # read back now: the check is on the host (one op fewer than isfinite)
            largest = largest_magnitude(loss, grads)
            if largest is None or math.isfinite(largest.item()):
                return True
            return self._bad(loss, step)
        finite = all_finite(loss, grads)
        if self.agree is not None:
            finite = self.agree(finite)
        if not self.sync:  # raise / warn on a GPU: the flag reaches the host a step later, without a sync
            self.deferred.put(step, torch.where(finite, -1, step))
            return True
        if bool(finite):
            return True
        return self._bad(loss, step)

    def _bad(self, loss: torch.Tensor | None, step: int) -> bool:
        """A non-finite step read now: skip it (False) or report it."""
        message = self.describe(loss, step)
        if self.policy in ("skip_step", "rollback"):  # rollback: skip it, and hookexp.run.rollback restores a snapshot
            self.skipped += 1
            self.rollback_step = step if self.policy == "rollback" else None
            log.warning("%s Skipping this update (guard.nan_policy=%s).", message, self.policy)
            return False
        self._report(message)
        return True

    def _report(self, message: str) -> None:
        if self.policy == "raise":
            raise NonFiniteError(message + " Set guard.nan_policy=skip_step to skip such updates, or warn to go on.")
        self.warned += 1
        log.warning("%s Going on (guard.nan_policy=warn).", message)

    def _poll(self, wait: bool = False) -> None:
        for _, (bad,) in self.deferred.ready(wait):
            if bad >= 0 and not self._told:
                self._told = True
                self._report(self.describe(None, int(bad), deferred=True))

    def start(self, step: int, log: bool) -> None:
        self._logging = log

    def end(self, step: int) -> None:
        """The flags that have arrived (after a log step read at once, every one on its way: that read waited for
        the work queued before it); a log step closes the period a deferred bad step is reported once in."""
        self._poll()
        if self._logging:
            self._told = False

    def settle(self) -> None:
        """Every flag still on its way, read now (a bad step is raised or warned of as at a step's end)."""
        self._poll(wait=True)

    def refuse_checkpoint(self, step: int, saved_step: int | None) -> None:
        """The model went non-finite before a checkpoint was due: raise (``raise``) or warn, naming the first bad
        step (read back from the device: checkpoints are rare) — never write that state."""
        bad = next((int(v[0]) for _, v in self.deferred.ready(wait=True) if v[0] >= 0), step - 1)
        if self.event is not None and self.event.step < step:
            bad = self.event.step
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
            grad_bad = p.grad is not None and not bool(torch.isfinite(local_part(p.grad)).all())
            if not bool(torch.isfinite(local_part(p.detach())).all()):
                values.append(f"{name} (value{' and gradient' if grad_bad else ''})")
            elif grad_bad:
                grads.append(f"{name} (gradient)")
        bad = values + grads
        loss_text = "" if loss is None else f"loss {loss.detach().float().item():g}; "
        params = ", ".join(bad[:most]) + (f" and {len(bad) - most} more" if len(bad) > most else "")
        hooks = ", ".join(self.touching([b.split(" ")[0] for b in bad])) or "none"
        now = " (now)" if deferred else ""
        self.event = NonFinite(step)
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
        if self.event is not None:
            self.event.onset = report.onset
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
