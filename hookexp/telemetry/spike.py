"""The spike recorder (``guard.spike``): one metric against the median of its last ``window`` steps, every step.

``train/<metric>`` (from the meter's sums of the step) and ``grad/global_norm`` / ``grad/pre_clip_norm`` are
judged at every step without a host sync: the step's values are copied to pinned memory and read a step later
(at once on a CPU). Other metrics, and every metric under DDP/FSDP, are judged on the log steps. A spike turns
on every-step logging and the ``record`` specs for ``steps`` steps and gives a :class:`Spike` (a row of
spikes.jsonl, with forensics' ranking and its ``onset``). Narrative: docs/statistics.md, "Spikes".
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hookexp.config import SpikeConfig
from hookexp.errors import ConfigError, did_you_mean
from hookexp.telemetry.observer import Observer

WARMUP = 5  # values in the window before the first judgement (a spike at step 25 of a run is seen)
GRAD_NORMS = ("grad/global_norm", "grad/pre_clip_norm")  # both: the gradients' norm before any clip


@dataclass
class Spike:
    step: int
    metric: str
    value: float
    median: float
    forensics: Any = None  # the forensics Report (hookexp.telemetry.forensics) when forensics is on
    onset: int | None = None  # the step the first-ranked target left its range (None without forensics)

    def row(self, period: list[dict[str, Any]]) -> dict[str, Any]:
        first = {"first": self.forensics.first} if self.forensics is not None else {}
        return {"trainer/step": self.step, "metric": self.metric, "value": self.value, "median": self.median,
                "onset": self.onset, "steps": period, **first}


class Deferred:
    """Small device tensors handed to the host without a sync: copied into pinned memory, read once the copy is
    done (the next step, in practice); on a CPU at once."""

    def __init__(self) -> None:
        self.waiting: deque[tuple[int, torch.Tensor, Any]] = deque()
        self.free: list[torch.Tensor] = []

    def put(self, step: int, values: torch.Tensor) -> None:
        if values.device.type != "cuda":
            self.waiting.append((step, values.detach().reshape(-1), None))
            return
        host = next((b for b in self.free if b.numel() == values.numel() and b.dtype == values.dtype), None)
        if host is None:
            host = torch.empty(values.numel(), dtype=values.dtype, pin_memory=True)
        else:
            self.free.remove(host)
        host.copy_(values.detach().reshape(-1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.waiting.append((step, host, event))

    def ready(self, wait: bool = False) -> list[tuple[int, list[float]]]:
        """The (step, values) whose copies are done (``wait``: all, waiting for them)."""
        out = []
        while self.waiting:
            step, host, event = self.waiting[0]
            if event is not None and not (wait or event.query()):
                break
            if event is not None:
                event.synchronize()
            self.waiting.popleft()
            out.append((step, host.tolist()))
            if event is not None:
                self.free.append(host)
        return out

    def clear(self) -> None:
        for _, host, event in self.waiting:
            if event is not None:
                event.synchronize()
                self.free.append(host)
        self.waiting.clear()


class SpikeRecorder(Observer):
    """The spike recorder (module docstring). ``model``: whose gradients give the grad norms; ``meter``: the
    :class:`~hookexp.telemetry.meter.TrainMeter` whose step sums give ``train/<metric>``; without them (or under
    DDP, where the builder passes neither) the metric is judged on the log steps. ``metrics``: what the metric may
    be (None: anything); ``specs``: the hook table's rows (:meth:`HookHandle.table`), whose enabled ``record``
    specs ``guard.spike.record`` may name."""

    optional_state: ClassVar[bool] = True  # checkpoints written before the spike recorder have no state for it

    def __init__(self, config: SpikeConfig | None = None, model: torch.nn.Module | None = None, meter: Any = None,
                 metrics: Sequence[str] | None = None, specs: Sequence[Mapping[str, Any]] = ()):
        config = config if config is not None else SpikeConfig()
        self.config = config
        self.metric, self.window, self.threshold = config.metric, config.window, config.threshold
        self.steps, self.min_value = config.steps, config.min_value
        self.record, self.checkpoint = tuple(config.record or ()), config.checkpoint
        if self.metric is not None and metrics is not None and self.metric not in metrics:
            raise ConfigError(f"{self.metric!r} is not a metric every log step of this run gives alike on every "
                              f"rank.{did_you_mean(self.metric, list(metrics))} Use one of: {', '.join(metrics)}.",
                              key="guard.spike.metric")
        record_specs = [r["spec"] for r in specs if r["transform"] == "record" and r["enabled"]]
        names = [r["spec"] for r in specs]
        for name in self.record:
            if name not in record_specs:
                why = ("it is not a hook spec of this run" + did_you_mean(name, names) if name not in names
                       else "its transform is not 'record'")
                raise ConfigError(f"{name!r} cannot be recorded on a spike: {why}. Name specs with transform: record "
                                  f"(this run's: {', '.join(record_specs) or 'none'}).", key="guard.spike.record")
        self.history: deque[float] = deque(maxlen=self.window)
        self.until = -1  # the window after a spike: steps < until log every step
        self.found = 0
        self.hooks: Any = None  # the HookHandle whose record specs a spike turns on
        self.forensics: Any = None  # a Forensics observer: a spike asks it which target left its range first
        self.meter = meter if self.metric is not None and self.metric.startswith("train/") else None
        self.params = [p for p in model.parameters() if p.requires_grad] \
            if model is not None and self.metric in GRAD_NORMS else []
        self.every_step = self.meter is not None or bool(self.params)
        self.deferred = Deferred()
        self.step = -1
        self._mark: torch.Tensor | None = None
        self._spike: Spike | None = None  # found, not yet given to the driver
        self._last_judged = -1  # the step of the last value judged

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

    # -- every step ----------------------------------------------------------------------------------------
    def start(self, step: int, log: bool) -> None:
        self.step = step
        if self.meter is not None:
            self._mark = self.meter.totals  # (a new tensor) the step's sums: the totals at its end less these

    def before_update(self) -> None:
        if self.meter is not None and self._mark is not None:
            self.deferred.put(self.step, self.meter.totals - self._mark)
        elif self.params:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                with torch.no_grad():
                    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
                    self.deferred.put(self.step, torch.linalg.vector_norm(torch.stack(norms)))

    def _poll(self, wait: bool = False) -> None:
        for step, values in self.deferred.ready(wait):
            value = self.meter.decode(values).get(self.metric, math.nan) if self.meter is not None else values[0]
            self._judge(value, step)

    def end(self, step: int) -> None:
        """Reads the steps' values that reached the host; the step that ends a spike's window turns the record
        specs off again."""
        self._poll()
        if self.record and self.hooks is not None and self.window_ended(step):
            self.hooks.pause(self.record)

    def observe(self, metrics: Mapping[str, Any], step: int) -> Spike | None:
        """A log step's metrics (step: the 0-based step they describe); a :class:`Spike` found since the last log
        step (its own ``step`` may be earlier than ``step``)."""
        if not self.enabled:
            return None
        if self.every_step:
            self._poll()
        else:
            self._judge(metrics.get(self.metric), step)
        spike, self._spike = self._spike, None
        return spike

    def _judge(self, value: Any, step: int) -> None:
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return  # NaN/Inf is the non-finite guard's business
        if step >= self.until and len(self.history) >= min(self.window, WARMUP) and self._spike is None:
            median = sorted(self.history)[len(self.history) // 2]
            if value > self.threshold * median and value > self.min_value:
                self.until, self.found = step + 1 + self.steps, self.found + 1
                spike = Spike(step, self.metric, float(value), float(median))
                if self.forensics is not None:
                    since = self._rise(step, median) - 2 if self.every_step else self._last_judged
                    spike.forensics = self.forensics.report(step, f"spike of {self.metric}", since)
                    spike.onset = spike.forensics.onset
                self._spike = spike
                if self.record and self.hooks is not None:
                    self.hooks.pause(self.record, paused=False)
        # every value enters the window, a spike's and those of the steps after it too: after a lasting rise (a
        # collapse, a new learning rate) the median moves up to the new level, and the rise is one spike
        self.history.append(float(value))
        self._last_judged = step

    def _rise(self, step: int, median: float) -> int:
        """The first step of the run of values, up to the spike at ``step``, above sqrt(threshold) x the median:
        where the metric began to rise (its cause is there or up to two steps before: a gradient changes the next
        loss, its momentum the one after)."""
        rise = step
        for value in reversed(self.history):  # the steps before, newest first (judged every step: consecutive)
            if value <= math.sqrt(self.threshold) * median:
                break
            rise -= 1
        return rise

    def window_ended(self, step: int) -> bool:
        """Whether ``step`` (just finished) was the last of a spike's window."""
        return self.until >= 0 and step == self.until - 1

    def reset_after_rollback(self, step: int) -> None:
        """The run went back to ``step``: the values of the undone steps are dropped, unread (the history, the
        window and the count are the snapshot's: :meth:`load_state_dict`)."""
        self.deferred.clear()
        self._spike = None

    def state_dict(self) -> dict[str, Any]:
        self._poll(wait=True)  # a checkpoint: the values on their way belong to the steps it covers
        return {"history": list(self.history), "until": self.until, "found": self.found}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = deque(state["history"], maxlen=self.window)
        self.until, self.found = int(state["until"]), int(state["found"])
        if self.record and self.hooks is not None and self.hooks.step < self.until:  # resumed inside a window
            self.hooks.pause(self.record, paused=False)

    def summary(self) -> dict[str, Any]:
        return {"guard/spikes": self.found} if self.enabled else {}
