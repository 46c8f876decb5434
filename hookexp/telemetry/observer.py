"""The observer seam: what a training step shows the telemetry, and in what order.

Everything that watches training is an :class:`Observer`; the trainer, :func:`hookexp.watch` and the callbacks
drive the same objects (built by :func:`hookexp.telemetry.assemble.build_observers`) through one
:class:`Observers`: ``start(step, log)``, ``allow_update`` (the trainer), ``before_update``, ``after_update``,
``read()`` (a log step: one device-to-host copy), ``observe(metrics, step)``, ``end(step)``, ``settle()``.
Observers hold device tensors between these calls and never sync the host off log steps (``settle()`` aside);
docs/internals.md, "The observer seam".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hookexp.telemetry.readback import Flight, Pending, read


class Observer:
    """One thing a training step is observed by. Every method is optional: the defaults do nothing.
    ``optional_state``: a checkpoint written before this observer kept state may lack it."""

    optional_state = False

    def start(self, step: int, log: bool) -> None:
        """Before step ``step``'s forward; ``log``: whether it is a log step."""

    def allow_update(self, loss: torch.Tensor | None, step: int) -> bool:
        """Before ``optimizer.step()`` (the trainer only): False skips this update."""
        return True

    def before_update(self) -> None:
        """On the final gradients, right before the update."""

    def after_update(self) -> None:
        """Right after the update."""

    def pending(self) -> Pending:
        """A log step: this observer's values as a device tensor and the decoder of its host copy."""
        return None, lambda host: {}

    def observe(self, metrics: Mapping[str, Any], step: int) -> Any:
        """A log step, after the read-back: what was logged."""
        return None

    def end(self, step: int) -> None:
        """After step ``step``."""

    def settle(self) -> None:
        """Act on every value still on its way to the host (it may sync): where the driver syncs anyway (the trainer:
        before validation, before a checkpoint and as the run ends, also when a signal stops it)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a resumed run)."""

    def reset_after_rollback(self, step: int) -> None:
        """A rollback restored the state before step ``step`` (:meth:`load_state_dict` of its snapshot): drop what
        still describes the undone steps (values on their way to the host)."""

    def summary(self) -> dict[str, Any]:
        """Entries for the run's summary.json."""
        return {}

    def close(self) -> None:
        """Remove every hook this observer holds."""


class Observers:
    """Drives named observers in order; see the module docstring.

    With an ``optimizer``, :meth:`before_update` and :meth:`after_update` run from one step pre-hook and one
    post-hook registered now (after the hook specs' own pre-hook, so the observers see the gradients after
    the ``pre_step`` specs); ``before_hook=False`` leaves :meth:`before_update` to the driver, for loops whose
    ``optimizer.step(closure)`` runs the backward after torch's pre-hooks (Lightning)."""

    def __init__(self, observers: Mapping[str, Observer], optimizer: torch.optim.Optimizer | None = None,
                 before_hook: bool = True):
        self.named = dict(observers)
        self.log = False  # whether the current step logs
        # only the observers that act around the update are called there, and no optimizer hook when none does
        self._before = [o for o in self if type(o).before_update is not Observer.before_update]
        self._after = [o for o in self if type(o).after_update is not Observer.after_update]
        self._handles: list[Any] = []
        if optimizer is not None:
            if before_hook and self._before:
                self._handles.append(optimizer.register_step_pre_hook(lambda *_: self.before_update()))
            if self._after:
                self._handles.append(optimizer.register_step_post_hook(lambda *_: self.after_update()))

    def __iter__(self) -> Any:
        return iter(self.named.values())

    def start(self, step: int, log: bool) -> None:
        self.log = log
        for o in self:
            o.start(step, log)

    def allow_update(self, loss: torch.Tensor | None, step: int) -> bool:
        return all([o.allow_update(loss, step) for o in self])  # every observer sees the step

    def before_update(self) -> None:
        for o in self._before:
            o.before_update()

    def after_update(self) -> None:
        for o in self._after:
            o.after_update()

    def read(self) -> dict[str, Any]:
        """The log step: every observer's values in one read-back (``.../hist`` keys hold (counts, edges))."""
        return read([o.pending() for o in self])

    def send(self, *extra: Pending) -> Flight:
        """The log step's values on their way to the host (no sync on CUDA); ``land()`` gives what :meth:`read`
        gives. ``extra``: the driver's own values, in the same copy."""
        return Flight([*(o.pending() for o in self), *extra])

    def observe(self, metrics: Mapping[str, Any], step: int) -> dict[str, Any]:
        """Each observer's answer to the logged ``metrics`` that is not None, by name."""
        answers = {name: o.observe(metrics, step) for name, o in self.named.items()}
        return {name: a for name, a in answers.items() if a is not None}

    def end(self, step: int) -> None:
        for o in self:
            o.end(step)

    def settle(self) -> None:
        for o in self:
            o.settle()

    def state_dict(self) -> dict[str, Any]:
        return {name: state for name, o in self.named.items() if (state := o.state_dict())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Each observer's state by name; a missing one is a KeyError (a checkpoint of another kind), unless the
        observer keeps none or says its state is optional."""
        for name, o in self.named.items():
            if name in state:
                o.load_state_dict(state[name])
            elif o.state_dict() and not o.optional_state:
                raise KeyError(name)

    def reset_after_rollback(self, step: int) -> None:
        for o in self:
            o.reset_after_rollback(step)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for o in self:
            out.update(o.summary())
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for o in self:
            o.close()
