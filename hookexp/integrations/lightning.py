"""``HookexpCallback`` for ``lightning.Trainer``: hook specs and the hookexp trainer's statistics in a Lightning fit.

::

    from hookexp.integrations.lightning import HookexpCallback
    trainer = lightning.Trainer(callbacks=[HookexpCallback(
        hooks={"clamp": {"target": "conv", "kind": "output_grad", "transform": "clamp", "args": {"min": 0.0}}},
        stats={"every": 10, "activations": "relu*", "hist_bins": 32})])

When training starts (after a resumed fit has restored ``global_step``) it attaches the specs and the probes
(:class:`hookexp.Watch`) to the LightningModule and its first optimizer; at the end, or on an exception, it
removes them. Every ``stats.every``-th optimizer step its metrics go to every logger of the trainer
(``logger.log_metrics``; a ``WandbLogger`` gets one row with the histograms too), with ``step`` the 0-based
index of the optimizer step described, counted by Lightning's ``global_step``. Lightning's
``optimizer.step(closure)`` runs the backward inside the closure, after torch's step pre-hooks, so the
``pre_step`` specs and the gradient probes run from ``on_before_optimizer_step`` instead, on the final
gradients (before Lightning's gradient clipping), for the watched optimizer only. With ``stats={"gns": True}``
the gradient noise scale's small batches are the ``accumulate_grad_batches`` micro-batches (times the DDP
ranks), their samples measured from the LightningModule's own forward (``gns_batch_size`` when
``training_step`` does not call it).

``guard={"spike": {"metric": "grad/global_norm"}, "forensics": {...}}`` (the trainer's ``guard.spike`` and
``guard.forensics`` keys) adds the spike recorder and first-divergence forensics: each spike's row, with the
targets that left their range first, is in ``callback.spikes`` and its heatmap in ``default_root_dir``/forensics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

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
