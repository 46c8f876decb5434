"""The spike recorder: ``guard.spike`` watches one logged metric against its recent history.

On every normal log step the metric (``train/loss``, ``grad/global_norm``, any scalar the run logs) is
compared with the median of its last ``window`` values: above ``threshold`` times that median (and above
``min_value``) is a spike. Then, for the next ``steps`` steps, the run logs every step, the ``record``
specs it names (hook specs with the ``record`` transform, idle until then) keep what they see, a
checkpoint is saved, and a line goes to ``spikes.jsonl`` with the step, the value, the median and the
steps since the previous log step with their epoch and batch indices (what to replay) and, with
``guard.forensics``, the targets ranked by the step each left its range (``first``). Then back to
normal. The median of a window, not a mean and a standard deviation: a converged loss's tiny noise is
not a spike, and one spike does not hide the next. Every finite value enters the window (a spike's, and
those logged in the steps after it), so the median follows a lasting change of level: one spike, not one
at every log step after it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hookexp.errors import ConfigError, did_you_mean
from hookexp.telemetry.observer import Observer


@dataclass
class Spike:
    step: int
    metric: str
    value: float
    median: float
    forensics: Any = None  # the forensics Report (hookexp.telemetry.forensics) when forensics is on

    def row(self, period: list[dict[str, Any]]) -> dict[str, Any]:
        first = {"first": self.forensics.first} if self.forensics is not None else {}
        return {"trainer/step": self.step, "metric": self.metric, "value": self.value, "median": self.median,
                "steps": period, **first}


@dataclass
class SpikeRecorder(Observer):
    """The spike recorder (module docstring), an :class:`~hookexp.telemetry.observer.Observer`: it observes the
    log steps' metrics, and turns the ``record`` specs of the hooks given to :meth:`pause_records` on for a
    spike's window."""

    optional_state: ClassVar[bool] = True  # checkpoints written before the spike recorder have no state for it

    metric: str | None = None
    window: int = 20
    threshold: float = 3.0
    steps: int = 10
    min_value: float = 0.0
    record: tuple[str, ...] = ()
    checkpoint: bool = True
    history: deque[float] = field(default_factory=deque)
    until: int = -1  # the window after a spike: steps < until log every step
    found: int = 0
    hooks: Any = None  # the HookHandle whose record specs a spike turns on
    forensics: Any = None  # a Forensics observer: a spike asks it which target left its range first

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None, record_specs: list[str], specs: list[str],
                    metrics: list[str] | None = None) -> SpikeRecorder:
        """``guard.spike``; ``record_specs``: the specs whose transform is ``record``, ``specs``: every spec;
        ``metrics``: what the metric may be (logged on every log step with the same value on every rank, so that
        all ranks see the same spikes; None: anything)."""
        cfg = dict(cfg or {})
        rec = cls(metric=cfg.get("metric"), window=cfg.get("window", 20), threshold=cfg.get("threshold", 3.0),
                  steps=cfg.get("steps", 10), min_value=cfg.get("min_value", 0.0),
                  record=tuple(cfg.get("record") or ()), checkpoint=cfg.get("checkpoint", True))
        if rec.metric is not None and metrics is not None and rec.metric not in metrics:
            raise ConfigError(f"{rec.metric!r} is not a metric every log step of this run gives alike on every rank."
                              f"{did_you_mean(rec.metric, metrics)} Use one of: {', '.join(metrics)}.",
                              key="guard.spike.metric")
        for key, value, least in (("window", rec.window, 1), ("steps", rec.steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"must be a whole number of at least {least}, got {value!r}.",
                                  key=f"guard.spike.{key}")
        if not rec.threshold > 1:
            raise ConfigError(f"must be above 1 (a spike is the metric above threshold x its recent median), got "
                              f"{rec.threshold!r}.", key="guard.spike.threshold")
        for name in rec.record:
            if name not in record_specs:
                why = ("it is not a hook spec of this run" + did_you_mean(name, specs) if name not in specs
                       else "its transform is not 'record'")
                raise ConfigError(f"{name!r} cannot be recorded on a spike: {why}. Name specs with transform: record "
                                  f"(this run's: {', '.join(record_specs) or 'none'}).", key="guard.spike.record")
        rec.history = deque(maxlen=rec.window)
        return rec

    @property
    def enabled(self) -> bool:
        return self.metric is not None

    def pause_records(self, hooks: Any) -> None:
        """The ``record`` specs of ``hooks`` (a HookHandle) stay off until a spike."""
        self.hooks = hooks
        if self.record:
            hooks.pause(self.record)

    def logging_every_step(self, step: int) -> bool:
        return step < self.until

    def observe(self, metrics: Mapping[str, Any], step: int) -> Spike | None:
        """A log step's metrics (step: the 0-based step they describe); a :class:`Spike` when one starts."""
        if not self.enabled:
            return None
        value = metrics.get(self.metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None  # NaN/Inf is the non-finite guard's business
        spike = None
        if step >= self.until and len(self.history) == self.window:
            median = sorted(self.history)[self.window // 2]
            if value > self.threshold * median and value > self.min_value:
                self.until, self.found = step + 1 + self.steps, self.found + 1
                spike = Spike(step, self.metric, float(value), float(median))
                if self.forensics is not None:
                    spike.forensics = self.forensics.report(step, f"spike of {self.metric}")
        # every value enters the window, a spike's and those of the steps after it too: after a lasting rise (a
        # collapse, a new learning rate) the median moves up to the new level, and the rise is one spike
        self.history.append(float(value))
        if spike is not None and self.record and self.hooks is not None:
            self.hooks.pause(self.record, paused=False)
        return spike

    def end(self, step: int) -> None:
        """The step that ends a spike's window turns the record specs off again."""
        if self.record and self.hooks is not None and self.window_ended(step):
            self.hooks.pause(self.record)

    def window_ended(self, step: int) -> bool:
        """Whether ``step`` (just finished) was the last of a spike's window."""
        return self.until >= 0 and step == self.until - 1

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "until": self.until, "found": self.found}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = deque(state["history"], maxlen=self.window)
        self.until, self.found = int(state["until"]), int(state["found"])
        if self.record and self.hooks is not None and self.hooks.step < self.until:  # resumed inside a window
            self.hooks.pause(self.record, paused=False)

    def summary(self) -> dict[str, Any]:
        return {"guard/spikes": self.found} if self.enabled else {}
