"""``HookexpCallback`` for the ``transformers`` Trainer: hook specs and the hookexp trainer's statistics.

::

    from hookexp.integrations.hf import HookexpCallback
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=[HookexpCallback(
        hooks={"clamp_mlp": {"target": "@mlp", "kind": "output_grad", "transform": "clamp", "args": {"min": -1}}},
        stats={"every": 10, "group_by": r"re:^transformer\\.h\\.\\d+"})])

At ``on_train_begin`` it attaches the specs and the probes (:class:`hookexp.Watch`) to the model and the
optimizer the Trainer made (unwrapped from accelerate's wrapper); at ``on_train_end`` it removes them (and a
second ``train()`` after a failed one attaches them once, not twice). Every ``stats.every``-th optimizer step
its metrics go to ``log`` when given (a callable ``log(metrics, step)`` or a W&B run), else to the W&B run the
Trainer's ``report_to="wandb"`` started, and their scalars always to ``state.log_history`` (the Trainer's own
record, saved in ``trainer_state.json``), with ``step`` the 0-based index of the optimizer step described.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import TrainerCallback

from hookexp.telemetry.readback import split_histograms
from hookexp.telemetry.watch import Watch, as_logger, settings_from


class HookexpCallback(TrainerCallback):
    def __init__(self, hooks: Any = None, stats: Mapping[str, Any] | None = None, log: Any = None):
        self.hooks = hooks
        self.stats = settings_from(stats)
        self.log = as_logger(log)
        self.watch: Watch | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self._remove()
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        self.watch = Watch(model, inner, hooks=self.hooks, log=lambda metrics, step: self._log(state, metrics, step),
                           step=state.global_step, **self.stats)

    def _log(self, state: Any, metrics: dict[str, Any], step: int) -> None:
        scalars, _ = split_histograms(metrics)
        state.log_history.append({**scalars, "step": step})
        log = self.log
        if log is None:
            import wandb

            log = as_logger(wandb.run) if wandb.run is not None else None
        if log is not None:
            log(metrics, step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        if self.watch is not None:
            self.watch.remove()
            self.watch = None
