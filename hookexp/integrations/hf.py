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
Trainer's ``report_to="wandb"`` started, with ``step`` the 0-based index of the optimizer step described
(counted by the Trainer's ``global_step``); their scalars also go to ``state.log_history`` (the Trainer's own
record, saved in ``trainer_state.json``) under the Trainer's own ``step``, the 1-based ``global_step``.

One difference from the hookexp trainer: the Trainer clips the gradients (``max_grad_norm``, default 1.0)
before any callback or optimizer hook runs, so ``grad/*`` describe the clipped gradients and ``pre_step``
specs see them (the Trainer logs the norm before its clip as ``grad_norm``). Set ``max_grad_norm=0`` and clip
with a ``pre_step`` ``clip_norm`` spec to keep the trainer's order. With ``stats={"gns": True}`` (the
gradient noise scale over the ``gradient_accumulation_steps`` micro-batches, times the DDP ranks) this matters
more: a clipped final gradient is not the big batch's, so set ``max_grad_norm=0`` there.

``guard={"spike": {"metric": "grad/global_norm"}, "forensics": {...}}`` (the trainer's ``guard.spike`` and
``guard.forensics`` keys) adds the spike recorder and first-divergence forensics: each spike's row, with the
targets that left their range first, is in ``callback.spikes`` and its heatmap in ``args.output_dir``/forensics.
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
    from transformers import TrainerCallback
except ImportError as e:
    raise MissingExtraError("hookexp.integrations.hf.HookexpCallback (a callback of the transformers Trainer)",
                            "transformers", "hf", e) from None


class HookexpCallback(TrainerCallback):
    def __init__(self, hooks: Any = None, stats: Mapping[str, Any] | None = None, log: Any = None,
                 guard: Mapping[str, Any] | None = None):
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
