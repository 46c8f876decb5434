"""``hookexp.watch``: the statistics the hookexp trainer logs, in any training loop, with no call in the loop::

    with hookexp.watch(model, optimizer, every=10, log=wandb.run):   # or log=lambda metrics, step: ...
        ...                                                          # your loop, unchanged

The same observers as the trainer (:func:`~hookexp.telemetry.assemble.build_observers`, from a
:class:`~hookexp.config.StatsConfig` and :class:`~hookexp.config.GuardConfig`), driven from optimizer hooks;
``log(metrics, step)`` gets a log step's values, ``step`` the 0-based index of the optimizer step described.
Steps, fp16, DDP, spikes, forensics and the noise scale: docs/statistics.md and docs/internals.md, "watch()".
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookexp.config import GuardConfig, StatsConfig, typed
from hookexp.errors import ConfigError, did_you_mean
from hookexp.telemetry.assemble import Wiring, build_observers
from hookexp.telemetry.forensics import Report, draw
from hookexp.telemetry.readback import split_histograms

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


@dataclass
class WatchOptions:
    """What :class:`Watch` takes beside ``stats`` and ``guard``: ``hooks`` (hook specs, as ``attach`` takes them),
    ``log`` (a W&B run, a callable ``log(metrics, step)`` or None), ``step`` (the index of the next optimizer
    step), ``before_hook`` (False: the loop calls :meth:`Watch.before_step`), ``gns_batch_size`` (samples per
    micro-batch; None: measured), ``grad_scale`` (a callable giving fp16's loss scale), ``forensics`` (on or off;
    None: with a spike recorder), ``forensics_dir`` (None: the W&B run's directory, else none) and ``key`` (how
    errors name a ``stats`` setting; None: as watch()'s keyword, ``watch(<setting>=...)``)."""

    hooks: Any = None
    log: Any = None
    step: int = 0
    before_hook: bool = True
    gns_batch_size: int | None = None
    grad_scale: Any = None
    forensics: bool | None = None
    forensics_dir: str | Path | None = None
    key: Callable[[str], str] | None = None


class Watch:
    """What :func:`watch` returns: the observers of ``stats`` and ``guard`` (:func:`build_observers`, as the
    trainer's), driven from optimizer hooks; :meth:`remove` takes them all away. Errors name a setting as
    watch's keyword (``watch(<setting>=...)``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, stats: StatsConfig | None = None,
                 guard: GuardConfig | None = None, options: WatchOptions | None = None):
        stats = stats if stats is not None else StatsConfig(hist_bins=WATCH_HIST_BINS)
        guard = guard if guard is not None else GuardConfig()
        options = options if options is not None else WatchOptions()
        step = options.step
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"expected a whole number of optimizer steps, at least 0, got {step!r}.",
                              key="watch(step=...)")
        self.every, self.step = stats.every, step
        self._log = as_logger(options.log)
        self._run = options.log if options.log is not None and hasattr(options.log, "log") else None
        self.last: dict[str, Any] = {}  # the metrics of the last log step
        self.spikes: list[dict[str, Any]] = []  # a row per spike found, as the trainer's spikes.jsonl holds
        self.forensics_dir = Path(options.forensics_dir) if options.forensics_dir is not None else \
            Path(self._run.dir) / "forensics" if getattr(self._run, "dir", None) else None
        with contextlib.ExitStack() as attached:
            # the hooks first: their pre_step specs run before the probes look at the gradients
            self.hooks = None
            if options.hooks:
                from hookexp.engine import attach

                self.hooks = attach(model, options.hooks, optimizer, measure=False)
                attached.callback(self.hooks.remove)
                self.hooks.set_step(step)  # the specs' every/start_step/end_step count from the loop's step
                if not options.before_hook:
                    self.hooks.run_pre_step_by_hand()
            self.observers = build_observers(model, optimizer, stats, guard, Wiring(
                hooks=self.hooks, grad_scale=options.grad_scale, gns_batch_size=options.gns_batch_size,
                forensics=options.forensics, key=options.key or watch_key, before_hook=options.before_hook))
            attached.pop_all()
        self.probes, self.recorder = self.observers.named["stats"], self.observers.named["spike"]
        self.forensics = self.observers.named.get("forensics")
        self._handle = optimizer.register_step_post_hook(self._after_step)  # after the observers' own
        self.observers.start(self.step, self.logs(self.step))

    def logs(self, step: int) -> bool:
        return step % self.every == 0 or self.recorder.logging_every_step(step)

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


WATCH_HIST_BINS = 64  # watch() and the callbacks draw histograms by default, as wandb.watch does
RENAMED = {"optimizer": "optimizer_state"}  # a stats setting whose watch() keyword differs (watch's 2nd argument)


def watch_key(setting: str) -> str:
    """The ``watch()`` keyword of a ``stats`` setting (errors name it)."""
    return f"watch({RENAMED.get(setting, setting)}=...)"


def _rekeyed(error: ConfigError, key: Callable[[str], str]) -> ConfigError:
    """A check's error on ``stats.<setting>`` (its dataclass names the trainer's key), naming ``key(setting)``."""
    if not error.key or not error.key.startswith("stats."):
        return error
    return ConfigError(error.message, key=key(error.key.removeprefix("stats.")))


def stats_of(settings: Mapping[str, Any], key: Callable[[str], str], hist_bins: int = WATCH_HIST_BINS) -> StatsConfig:
    """``settings`` (``stats`` keys) as a checked :class:`StatsConfig`, errors naming ``key(setting)``."""
    try:
        return typed(StatsConfig, {"hist_bins": hist_bins, **settings}, key)
    except ConfigError as e:
        raise _rekeyed(e, key) from None


def guard_of(spike: Mapping[str, Any] | None, forensics: Mapping[str, Any] | bool | None) -> tuple[GuardConfig, Any]:
    """The ``guard.spike`` and ``guard.forensics`` keys of watch() and the callbacks, as a :class:`GuardConfig`,
    and whether forensics is on (None: with a spike recorder)."""
    node = {"spike": spike or {}, "forensics": forensics if isinstance(forensics, Mapping) else {}}
    on = True if isinstance(forensics, Mapping) else forensics
    return typed(GuardConfig, node, lambda name: f"guard.{name}"), on


def _check_settings(settings: Mapping[str, Any], known: tuple[str, ...], key: Callable[[str], str]) -> None:
    for name in settings:
        if name not in known:
            raise ConfigError(f"unknown setting.{did_you_mean(name, known)} The settings are: {', '.join(known)}.",
                              key=key(name))


STATS_SETTINGS = tuple(RENAMED.get(f.name, f.name) for f in dataclasses.fields(StatsConfig))
OPTIONS = tuple(f.name for f in dataclasses.fields(WatchOptions) if f.name not in ("log", "before_hook", "forensics"))


def watch(model: nn.Module, optimizer: torch.optim.Optimizer, every: int = StatsConfig.every, log: Any = None,
          **settings: Any) -> Watch:
    """Log the trainer's statistics of ``model`` every ``every`` optimizer steps of any loop; see the module
    docstring. ``settings``: the trainer's ``stats`` keys (grads, activations, params, updates, optimizer_state
    for ``stats.optimizer``, group_by, hist_bins (64, as wandb.watch), hist_sample, gns, gns_ema, compile), hooks (hook
    specs, as ``attach`` takes them), step (the index of the next optimizer step), gns_batch_size, grad_scale,
    spike and forensics (the trainer's ``guard.spike`` and ``guard.forensics`` keys), forensics_dir; or
    ``stats=`` a StatsConfig and ``guard=`` a GuardConfig."""
    _check_settings(settings, (*STATS_SETTINGS, *OPTIONS, "spike", "forensics", "stats", "guard"), watch_key)
    stats = settings.pop("stats", None)
    if stats is None:
        given = {k: settings.pop(k) for k in list(settings) if k in STATS_SETTINGS}
        given = {{v: k for k, v in RENAMED.items()}.get(k, k): v for k, v in given.items()}
        stats = stats_of({"every": every, **given}, watch_key)
    guard, on = guard_of(settings.pop("spike", None), settings.pop("forensics", None))
    guard = settings.pop("guard", None) or guard
    return Watch(model, optimizer, stats, guard, WatchOptions(log=log, forensics=on, **settings))


CALLBACK_STATS = (*(f.name for f in dataclasses.fields(StatsConfig)), "gns_batch_size")


def callback_settings(stats: Mapping[str, Any] | None, guard: Mapping[str, Any] | None
                      ) -> tuple[StatsConfig, GuardConfig, WatchOptions]:
    """A callback's ``stats`` and ``guard`` mappings (the keys of the trainer's ``stats`` config, and
    ``gns_batch_size``, the samples per micro-batch when the model's forward does not show them; ``guard.spike``
    and ``guard.forensics``), checked: an unknown key is refused with a did-you-mean."""
    stats = dict(stats or {})
    _check_settings(stats, CALLBACK_STATS, callback_key)
    batch_size = stats.pop("gns_batch_size", None)
    guard = dict(guard or {})
    _check_settings(guard, ("spike", "forensics"), lambda name: f"guard.{name}")
    checked, on = guard_of(guard.get("spike"), guard.get("forensics"))
    return stats_of(stats, callback_key), checked, WatchOptions(gns_batch_size=batch_size, forensics=on,
                                                                key=callback_key)


def callback_key(setting: str) -> str:
    """A callback's ``stats`` setting as its errors name it: ``stats.<setting>``, the mapping's key."""
    return f"stats.{setting}"
