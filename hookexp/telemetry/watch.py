"""``hookexp.watch``: the statistics the hookexp trainer logs, in any training loop, with no call in the loop.

::

    import hookexp
    w = hookexp.watch(model, optimizer, every=10, log=wandb.run)        # or log=lambda metrics, step: ...
    for x, y in loader:                                                # your loop, unchanged
        loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
    w.remove()                                                         # or: with hookexp.watch(...):

The drop-in replacement for ``wandb.watch(model, log="gradients")``: the same probes as the trainer
(:class:`~hookexp.telemetry.probes.Probes`: gradients right before ``optimizer.step()``, activations,
weights, updates, optimizer state, group norms, histograms), and optionally hook specs, whose effects are
measured on the same steps. Everything runs from optimizer hooks: after ``optimizer.step()`` of a log step
the probes' values are read back in one copy and handed to ``log(metrics, step)``, ``step`` being the
0-based index of the optimizer step they describe (``trainer/step``); then the next step's probes are
switched on or off. ``step`` counts the ``optimizer.step()`` calls that ran: one that fp16's GradScaler
skips runs no optimizer hook and is not counted, unless the loop says where it is with :meth:`Watch.sync`
(the callbacks do, from the loop's ``global_step``). A W&B run (anything with ``.log``) gets the scalars,
``trainer/step`` and the histograms as ``wandb.Histogram``; a callable gets one dict whose ``.../hist`` keys
hold ``(counts, edges)``.
Under DDP/FSDP every rank must watch (activations and sharded tensors are combined over the ranks);
give ``log`` on rank 0 only, or let it check the rank.

``spike={"metric": "grad/global_norm", ...}`` (the trainer's ``guard.spike`` keys) watches a logged metric for
spikes, with first-divergence forensics (:mod:`hookexp.telemetry.forensics`, ``forensics=`` the trainer's
``guard.forensics`` keys, or False): each spike's row, with the targets ranked by the step each left its range
(``first``), is appended to :attr:`Watch.spikes`, its heatmap written to ``forensics_dir`` (default: the W&B
run's directory, else none) and logged to a W&B run; :meth:`Watch.report` asks by hand (a NaN your loop caught).

``gns=True`` adds the gradient noise scale (:mod:`hookexp.telemetry.gns`, ``gns/...`` keys): its small
batches are the backward passes between two ``optimizer.step()`` calls (gradient accumulation, each loss
divided by their number), times the DDP ranks; the samples per micro-batch are measured from each training
forward of ``model`` (the leading dimension of its first tensor argument) unless ``gns_batch_size`` gives
them; ``gns_ema`` smooths; ``grad_scale`` (a callable) gives fp16's loss scale when the loop scales its losses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookexp.errors import ConfigError, did_you_mean
from hookexp.telemetry.forensics import Forensics, Report, draw
from hookexp.telemetry.gns import GradientNoiseScale
from hookexp.telemetry.observer import Observer, Observers
from hookexp.telemetry.probes import HookEffects, Probes
from hookexp.telemetry.readback import split_histograms
from hookexp.telemetry.settings import ForensicsConfig, SpikeConfig
from hookexp.telemetry.spike import SpikeRecorder

Log = Callable[[dict[str, Any], int], Any]


def as_logger(log: Any) -> Log | None:
    """``log`` as a function of (metrics, step): a W&B run, a callable, or None (keep the values only)."""
    if log is None or (callable(log) and not hasattr(log, "log")):
        return log
    if not callable(getattr(log, "log", None)):
        raise ConfigError(f"expected a W&B run (anything with .log) or a callable log(metrics, step), got {log!r}.",
                          key="watch(log=...)")

    def to_run(metrics: dict[str, Any], step: int) -> None:
        scalars, hists = split_histograms(metrics)
        if hists:
            import wandb

            scalars.update({k: wandb.Histogram(np_histogram=(c, e)) for k, (c, e) in hists.items()})
        log.log({"trainer/step": step, **scalars})
    return to_run


class Watch:
    """What :func:`watch` returns: the statistics probes and the hook specs' effects as observers
    (:class:`~hookexp.telemetry.observer.Observers`, the trainer's seam), driven from optimizer hooks;
    :meth:`remove` takes them all away."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, every: int = 10,
                 grads: str | None = "*", activations: str | None = None, params: str | None = None,
                 updates: str | None = None, optimizer_state: str | None = None, group_by: str | None = None,
                 hist_bins: int = 64, hist_sample: int | None = 4096, hooks: Any = None, log: Any = None,
                 step: int = 0, before_hook: bool = True, gns: bool = False, gns_ema: float = 0.95,
                 gns_batch_size: int | None = None, grad_scale: Any = None, spike: Mapping[str, Any] | None = None,
                 forensics: Mapping[str, Any] | bool | None = None, forensics_dir: str | Path | None = None):
        for name, value in (("every", every), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (name == "every"):
                raise ConfigError(f"expected a whole number of optimizer steps, at least {int(name == 'every')}, got "
                                  f"{value!r}.", key=f"watch({name}=...)")
        self.every, self.step = every, step
        self._log = as_logger(log)
        self._run = log if log is not None and hasattr(log, "log") else None
        self.last: dict[str, Any] = {}  # the metrics of the last log step
        self.spikes: list[dict[str, Any]] = []  # a row per spike found, as the trainer's spikes.jsonl holds
        self.forensics_dir = Path(forensics_dir) if forensics_dir is not None else \
            Path(self._run.dir) / "forensics" if getattr(self._run, "dir", None) else None
        # the hooks first: their pre_step specs run before the probes look at the gradients
        self.hooks = None
        if hooks:
            from hookexp.engine import attach

            self.hooks = attach(model, hooks, optimizer, measure=False)
            self.hooks.set_step(step)  # the specs' every/start_step/end_step count from the loop's step
            if not before_hook:
                self.hooks.run_pre_step_by_hand()
        try:
            self.probes = Probes(model, optimizer, grads=grads, activations=activations, params=params,
                                 updates=updates, optimizer_state=optimizer_state, group_by=group_by,
                                 hist_bins=hist_bins, hist_sample=hist_sample,
                                 key=lambda setting: f"watch({setting}=...)")
        except BaseException:
            if self.hooks is not None:
                self.hooks.remove()
            raise
        named: dict[str, Observer] = {"stats": self.probes}
        if gns:
            try:
                named["gns"] = GradientNoiseScale(model, group_by=group_by, ema=gns_ema, batch_size=gns_batch_size,
                                                  grad_scale=grad_scale, key=lambda setting: f"watch({setting}=...)")
            except BaseException:
                self.probes.close()
                if self.hooks is not None:
                    self.hooks.remove()
                raise
        if self.hooks is not None:
            named["hooks"] = HookEffects(self.hooks)
        try:
            self.recorder = _recorder(model, spike, grads) if spike is not None else None
            self.forensics = _forensics(model, optimizer, forensics, on=spike is not None)
        except BaseException:
            for o in named.values():
                o.close()
            if self.hooks is not None:
                self.hooks.remove()
            raise
        if self.forensics is not None:
            named["forensics"] = self.forensics
        if self.recorder is not None:
            named["spike"] = self.recorder
            self.recorder.forensics = self.forensics
        self.observers = Observers(named, optimizer, before_hook=before_hook)
        self._handle = optimizer.register_step_post_hook(self._after_step)  # after the observers' own
        self.observers.start(self.step, self.logs(self.step))

    def logs(self, step: int) -> bool:
        return step % self.every == 0 or (self.recorder is not None and self.recorder.logging_every_step(step))

    def report(self, step: int | None = None) -> Report:
        """Forensics' ranking up to ``step`` (default: the step in progress, or the last one): which target left its
        range first. Needs forensics on (``forensics=True``)."""
        if self.forensics is None:
            raise ConfigError("forensics is off in this watch(); pass forensics=True (or spike=...) to keep the ring "
                              "buffer.", key="watch(forensics=...)")
        report = self.forensics.report(self.step if step is None else step, "asked")
        self.forensics.take_reports()
        return report

    def sync(self, step: int) -> None:
        """The loop's own count of optimizer steps (``global_step``), before the step's forward: a step fp16's
        GradScaler skipped ran no optimizer hook, and a resumed loop starts past 0."""
        if step != self.step:
            self.step = step
            if self.hooks is not None:
                self.hooks.set_step(step)
            self.observers.start(step, self.logs(step))

    def before_step(self) -> None:
        """With ``before_hook=False``: the loop calls this once the gradients are final, right before the update
        (the ``pre_step`` specs, then the observers). For loops whose ``optimizer.step(closure)`` runs the
        backward inside the closure, after torch's step pre-hooks (Lightning)."""
        if self.hooks is not None:
            self.hooks.apply_pre_step()
        self.observers.before_update()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.observers.log:
            self.last = self.observers.read()
            if self._log is not None:
                self._log(dict(self.last), self.step)
            spike = self.observers.observe(self.last, self.step).get("spike")
            if spike is not None:
                self._spiked(spike)
        self.observers.end(self.step)
        self.step += 1
        self.observers.start(self.step, self.logs(self.step))

    def _spiked(self, spike: Any) -> None:
        """A spike's row into :attr:`spikes`; its forensics heatmap to ``forensics_dir`` and the W&B run."""
        self.spikes.append(spike.row([]))
        reports = self.forensics.take_reports() if self.forensics is not None else []
        if self.forensics_dir is None:
            return
        for report in reports:
            path = draw(report, self.forensics_dir / f"step_{report.step}.png")
            if self._run is not None:
                import wandb

                self._run.log({"trainer/step": report.step, "forensics": wandb.Image(str(path))})

    def remove(self) -> None:
        self._handle.remove()
        self.observers.close()
        if self.hooks is not None:
            self.hooks.remove()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


SETTINGS = ("every", "grads", "activations", "params", "updates", "optimizer_state", "group_by", "hist_bins",
            "hist_sample", "hooks", "log", "step", "gns", "gns_ema", "gns_batch_size",
            "grad_scale", "spike", "forensics", "forensics_dir")
FORENSICS_KEYS = tuple(f.name for f in fields(ForensicsConfig))
SPIKE_KEYS = tuple(f.name for f in fields(SpikeConfig))


def _forensics(model: nn.Module, optimizer: torch.optim.Optimizer, setting: Mapping[str, Any] | bool | None,
               on: bool) -> Forensics | None:
    """``forensics=``: True, a mapping of the trainer's ``guard.forensics`` keys, False, or None (on with a
    spike recorder)."""
    if setting is None:
        setting = on
    if setting is False:
        return None
    keys = dict(setting) if isinstance(setting, Mapping) else {}
    _check_settings(keys, FORENSICS_KEYS, lambda name: f"guard.forensics.{name}")
    config = ForensicsConfig(**keys)
    return Forensics(model, optimizer, config) if config.window else None


def _recorder(model: nn.Module, spike: Mapping[str, Any], grads: str | None) -> SpikeRecorder:
    """``spike=``: the trainer's ``guard.spike`` keys; the gradients' norm is judged every step."""
    keys = dict(spike)
    _check_settings(keys, SPIKE_KEYS, lambda name: f"guard.spike.{name}")
    return SpikeRecorder(SpikeConfig(**keys), model, metrics=["grad/global_norm"] if grads else [])


def _check_settings(settings: Mapping[str, Any], known: tuple[str, ...], key: Any) -> None:
    for name in settings:
        if name not in known:
            raise ConfigError(f"unknown setting.{did_you_mean(name, known)} The settings are: {', '.join(known)}.",
                              key=key(name))


def watch(model: nn.Module, optimizer: torch.optim.Optimizer, every: int = 10, grads: str | None = "*",
          activations: str | None = None, log: Any = None, **settings: Any) -> Watch:
    """Log the trainer's statistics of ``model`` every ``every`` optimizer steps of any loop; see the module
    docstring. ``settings``: params, updates, optimizer_state, group_by, hist_bins (64, as wandb.watch),
    hist_sample, hooks (hook specs, as ``attach`` takes them), step (the index of the next optimizer step), gns,
    gns_ema, gns_batch_size, grad_scale (the gradient noise scale), spike and forensics (the trainer's
    ``guard.spike`` and ``guard.forensics`` keys), forensics_dir."""
    _check_settings(settings, SETTINGS, lambda name: f"watch({name}=...)")
    return Watch(model, optimizer, every=every, grads=grads, activations=activations, log=log, **settings)


STATS_KEYS = ("every", "grads", "activations", "params", "updates", "optimizer", "group_by", "hist_bins",
              "hist_sample", "gns", "gns_ema", "gns_batch_size")


def settings_from(stats: Mapping[str, Any] | None, guard: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A callback's ``stats`` and ``guard`` mappings, with the keys of the trainer's ``stats`` config (``optimizer``
    for the optimizer state; and ``gns_batch_size``, the samples per micro-batch when the model's forward does not
    show them) and ``guard.spike`` / ``guard.forensics``, as :class:`Watch` keywords; an unknown key is refused
    with a did-you-mean."""
    stats = dict(stats or {})
    _check_settings(stats, STATS_KEYS, lambda name: f"stats.{name}")
    if "optimizer" in stats:
        stats["optimizer_state"] = stats.pop("optimizer")
    guard = dict(guard or {})
    _check_settings(guard, ("spike", "forensics"), lambda name: f"guard.{name}")
    return {**stats, **guard}
