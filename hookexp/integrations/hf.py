"""``HookexpCallback`` for the ``transformers`` Trainer: hook specs and the hookexp trainer's statistics.

::

    trainer = transformers.Trainer(..., callbacks=[HookexpCallback(hooks=specs, stats={"every": 10})])

It attaches at ``on_train_begin`` (to the model and the optimizer, unwrapped from accelerate) and removes at
``on_train_end``; metrics go to ``log`` when given, else to the W&B run of ``report_to="wandb"``, and their
scalars to ``state.log_history``. The Trainer clips gradients before any hook runs: docs/library.md says what
that means for ``grad/*`` and ``pre_step`` specs. ``guard=`` adds the spike recorder and forensics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hookexp.engine import parse_specs
from hookexp.errors import MissingExtraError
from hookexp.telemetry.readback import split_histograms
from hookexp.telemetry.watch import Watch, as_logger, callback_settings

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise MissingExtraError("hookexp.integrations.hf.HookexpCallback (a callback of the transformers Trainer)",
                            "transformers", "hf", e) from None


class HookexpCallback(TrainerCallback):
    def __init__(self, hooks: Any = None, stats: Mapping[str, Any] | None = None, log: Any = None,
                 guard: Mapping[str, Any] | None = None):
        if hooks is not None:
            parse_specs(hooks)  # a misspelt kind or transform argument fails here, not when training starts
        self.hooks = hooks
        self.stats, self.guard, self.options = callback_settings(stats, guard)
        self.log = as_logger(log)
        self.watch: Watch | None = None
        self.spikes: list[dict[str, Any]] = []  # the spike recorder's rows (guard.spike), kept after the fit

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self._remove()
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        scaler = getattr(optimizer, "scaler", None)  # fp16: accelerate's GradScaler (stats.gns divides its scale out)
        options = replace(self.options, hooks=self.hooks, log=lambda metrics, step: self._log(state, metrics, step),
                          step=state.global_step, grad_scale=(lambda: scaler._scale) if scaler is not None else None,
                          forensics_dir=Path(args.output_dir) / "forensics")
        self.watch = Watch(model, inner, self.stats, self.guard, options)
        self.spikes = self.watch.spikes

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is not None:
            self.watch.sync(state.global_step)  # e.g. after a step fp16's GradScaler skipped

    def _log(self, state: Any, metrics: dict[str, Any], step: int) -> None:
        scalars, _ = split_histograms(metrics)
        state.log_history.append({**scalars, "trainer/step": step, "step": step + 1})
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
