"""``HookexpCallback`` for ``lightning.Trainer``: hook specs and the hookexp trainer's statistics in a fit.

::

    trainer = lightning.Trainer(callbacks=[HookexpCallback(hooks=specs, stats={"every": 10})])

It attaches when training starts (after a resumed fit restored ``global_step``) and removes at the end or on an
exception; metrics go to every logger of the trainer. ``pre_step`` specs and the gradient probes run from
``on_before_optimizer_step``, on the final gradients (``optimizer.step(closure)`` runs the backward after
torch's step pre-hooks); docs/library.md has the rest. ``guard=`` adds the spike recorder and forensics.
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
    from lightning.pytorch.callbacks import Callback
except ImportError as e:
    raise MissingExtraError("hookexp.integrations.lightning.HookexpCallback (a Lightning callback)", "lightning",
                            "lightning", e) from None


class HookexpCallback(Callback):
    def __init__(self, hooks: Any = None, stats: Mapping[str, Any] | None = None,
                 guard: Mapping[str, Any] | None = None):
        if hooks is not None:
            parse_specs(hooks)  # a misspelt kind or transform argument fails here, not when training starts
        self.hooks = hooks
        self.stats, self.guard, self.options = callback_settings(stats, guard)
        self.watch: Watch | None = None
        self.spikes: list[dict[str, Any]] = []  # the spike recorder's rows (guard.spike), kept after the fit
        self._optimizer: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._remove()
        optimizer = trainer.optimizers[0]
        self._optimizer = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the torch one
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed: the loss scale (stats.gns)
        options = replace(self.options, hooks=self.hooks, log=lambda metrics, step: self._log(trainer, metrics, step),
                          step=trainer.global_step, before_hook=False,
                          grad_scale=(lambda: scaler._scale) if scaler is not None else None,
                          forensics_dir=Path(trainer.default_root_dir) / "forensics")
        self.watch = Watch(pl_module, self._optimizer, self.stats, self.guard, options)
        self.spikes = self.watch.spikes

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.watch is not None:
            self.watch.sync(trainer.global_step)  # e.g. after a step fp16's GradScaler skipped

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.watch is not None and getattr(optimizer, "optimizer", optimizer) is self._optimizer:
            self.watch.before_step()

    @staticmethod
    def _log(trainer: Any, metrics: dict[str, Any], step: int) -> None:
        scalars, _ = split_histograms(metrics)
        for logger in trainer.loggers:
            if type(logger).__name__ == "WandbLogger":
                as_logger(logger.experiment)(metrics, step)  # type: ignore[misc]  # one row, histograms too
            else:
                logger.log_metrics({"trainer/step": step, **scalars}, step=step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._remove()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._remove()

    def _remove(self) -> None:
        if self.watch is not None:
            self.watch.remove()
            self.watch = None
