"""Roll back and skip: ``guard.spike.action=rollback`` and ``guard.nan_policy=rollback`` (docs/rollback.md).

Host-memory snapshots of the whole training state (what :meth:`Checkpointer.gather` gathers) every
``guard.rollback.every`` steps, ``keep`` of them; on a spike or a non-finite step, restore the newest one at or
before the event's onset, move the data position past the batches to the event (or ``guard.rollback.skip``) and
go on. The optimizer-step position (schedule, hooks' ``start_step``/``end_step``) goes back with the snapshot;
``metrics.jsonl`` and the backends log nothing for a re-done step until the run passes its highest logged step.
Every spike also writes its pre-onset snapshot to ``checkpoints/snapshot_<step>.pt`` for :mod:`hookexp.run.replay`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hookexp.config import GuardConfig, typed
from hookexp.errors import ConfigError, RollbackLimitError
from hookexp.run.checkpoint import LoopState, atomic_save, set_rng_state

log = logging.getLogger("hookexp.rollback")

SNAPSHOT = ("model", "optimizer", "scheduler", "scaler", "hooks", "telemetry")  # tracked objects a snapshot holds


def _copy(value: Any, pinned: bool) -> Any:
    """A host copy of every tensor in a state (non-blocking into pinned memory from a GPU)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type == "cpu":
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
        return out.copy_(t, non_blocking=pinned)
    if isinstance(value, Mapping):
        return type(value)((k, _copy(v, pinned)) for k, v in value.items()) if isinstance(value, dict) else \
            {k: _copy(v, pinned) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v, pinned) for v in value)
    return value


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclass
class Event:
    """A spike or a non-finite step the trainer rolls back from."""

    step: int  # the step it was seen at
    onset: int  # the step it began (forensics' onset, or a fallback)
    reason: str  # "spike of train/loss" | "non-finite"


class Rollback:
    """The snapshots and the skip list of one run (module docstring); the trainer calls :meth:`before_step`,
    :meth:`after_step` and :meth:`summary`, and sends its sinks through :meth:`wrap`."""

    def __init__(self, trainer: Any, resumed: Mapping[str, Any] | None):
        guard = typed(GuardConfig, trainer.cfg.guard, lambda name: f"guard.{name}")  # checks every value once
        self.cfg, self.action = guard.rollback, guard.spike.action
        self.trainer = trainer
        spikes = trainer.observers.named.get("spike")
        self.on_spike = self.action == "rollback"
        if self.on_spike and (spikes is None or not spikes.enabled):
            raise ConfigError("rollback needs the spike recorder: set guard.spike.metric (e.g. train/loss), or "
                              "guard.spike.action=log.", key="guard.spike.action")
        self.on_nonfinite = guard.nan_policy == "rollback"
        # snapshots also while only logging spikes: a spike writes the one before it, for hookexp replay
        self.enabled = self.on_spike or self.on_nonfinite or (spikes is not None and spikes.enabled)
        if self.enabled and trainer.parts.ranks.sharded and (self.on_spike or self.on_nonfinite):
            raise ConfigError("rollback is not supported under trainer.strategy=fsdp (snapshots of sharded state). "
                              "Use guard.spike.action=log and guard.nan_policy=skip_step there, or train with ddp.",
                              key="guard.spike.action" if self.on_spike else "guard.nan_policy")
        self.enabled = self.enabled and not trainer.parts.ranks.sharded
        self.snapshots: deque[dict[str, Any]] = deque(maxlen=self.cfg.keep)
        self.positions: dict[int, tuple[int, list[int]]] = {}  # step -> (epoch, batches) since the oldest snapshot
        self.before: tuple[int, int] = (0, 0)
        self.rollbacks: list[dict[str, Any]] = []  # what each rollback did (summary.json)
        self.skipped: list[list[int]] = []  # every skipped batch, as [epoch, index] (in every checkpoint)
        self.hide_until = -1  # steps <= this were logged before a rollback: not logged again
        self.held: list[dict[str, Any]] = []  # spike rows held until the step's decision
        self.snapshot_bytes = 0
        self.log_steps: deque[int] = deque(maxlen=256)  # the last steps a log step described (train/* values)
        self._max_logged = -1  # the highest step logged
        self._sinks: Any = None
        if resumed is not None and "rollback" in resumed:
            self.load_state_dict(resumed["rollback"])

    # -- the trainer's calls -----------------------------------------------------------------------------------
    def wrap(self, sinks: Any) -> Any:
        """The trainer's sinks, with nothing logged for re-done steps and spike rows held until the step's decision."""
        return _Sinks(sinks, self) if self.enabled else sinks

    def before_step(self) -> None:
        """Before a step: a snapshot when one is due; the data position the step starts at."""
        loop = self.trainer.loop
        self.before = (loop.epoch, loop.batch)
        if not self.enabled or loop.step % self.cfg.every:
            return
        if self.snapshots and self.snapshots[-1]["loop"]["step"] == loop.step:
            return
        ckpt = self.trainer.ckpt
        pinned = self.trainer.parts.device.type == "cuda"
        state = _copy(ckpt.gather(loop, only=SNAPSHOT), pinned)
        self.snapshots.append(state)
        self.snapshot_bytes = _nbytes(state)
        oldest = self.snapshots[0]["loop"]["step"]
        self.positions = {s: p for s, p in self.positions.items() if s >= oldest}

    def after_step(self, spike: Any) -> bool:
        """After a step (before validation and checkpoints): the step's batches; on a spike or non-finite step the
        snapshot before it is written (a spike) and, when the action says so, restored. Returns True after a
        rollback: the loop reopens its batches at the new position."""
        if not self.enabled:
            return False
        loop = self.trainer.loop
        step = loop.step - 1
        if loop.batch > self.before[1] or loop.epoch != self.before[0]:
            self.positions[step] = (self.before[0], list(range(self.before[1], loop.batch)))
        guard = self.trainer.observers.named.get("guard")
        nonfinite = getattr(guard, "rollback_step", None)
        if guard is not None and nonfinite is not None:
            guard.rollback_step = None
        event = None
        if nonfinite is not None and self.on_nonfinite:
            event = Event(nonfinite, _event_onset(getattr(guard, "event", None), nonfinite), "non-finite")
        elif spike is not None:
            event = Event(spike.step, self._spike_onset(spike), f"spike of {spike.metric}")
        if event is None:
            self._release(None)
            return False
        snapshot = self._before(event.onset)
        if snapshot is not None:  # the oldest one before the onset: the most history for a replay's forensics
            self._write(next(s for s in self.snapshots if s["loop"]["step"] <= event.onset), event)
        act = self.on_spike if event.reason != "non-finite" else self.on_nonfinite
        if not act:
            self._release(None)
            return False
        if snapshot is None:
            log.warning("%s at step %d: no snapshot is kept (guard.rollback.every=%d, keep=%d); going on without a "
                        "rollback", event.reason, event.step, self.cfg.every, self.cfg.keep)
            self._release({"action": "rollback", "rolled_back": False})
            return False
        if len(self.rollbacks) >= self.cfg.max:
            self._release({"action": "rollback", "rolled_back": False})
            listed = [f"step {r['step']} (to {r['restored']})" for r in self.rollbacks]
            done = ", ".join(listed if len(listed) <= 8 else [*listed[:3], f"... {len(listed) - 8} more ...",
                                                              *listed[-5:]])
            raise RollbackLimitError(f"{event.reason} at step {event.step}, after {len(self.rollbacks)} rollbacks "
                                     f"(guard.rollback.max={self.cfg.max}): {done or 'none'}. The run stops here; "
                                     "its checkpoints and spikes.jsonl say where. Lower the learning rate, raise "
                                     "guard.rollback.max, or skip more batches (guard.rollback.skip).")
        self._restore(snapshot, event)
        return True

    # -- rolling back ------------------------------------------------------------------------------------------
    def _spike_onset(self, spike: Any) -> int:
        """Forensics' onset; without one, the first step of the log period the spiking value describes."""
        onset = getattr(spike, "onset", None)
        if onset is not None:
            return min(int(onset), spike.step)
        earlier = [s for s in self.log_steps if s < spike.step]
        if earlier:
            return earlier[-1] + 1
        return int(self.snapshots[0]["loop"]["step"]) if self.snapshots else spike.step

    def _before(self, onset: int) -> dict[str, Any] | None:
        """The newest snapshot at or before ``onset``."""
        fit = [s for s in self.snapshots if s["loop"]["step"] <= onset]
        return fit[-1] if fit else None

    def _write(self, snapshot: dict[str, Any], event: Event) -> None:
        """A pre-onset snapshot as ``checkpoints/snapshot_<step>.pt`` (rank 0), for a replay."""
        trainer = self.trainer
        if not trainer.parts.ranks.is_main:
            return
        restored = snapshot["loop"]["step"]
        path = trainer.ckpt.dir / f"snapshot_{restored}.pt"
        if path.exists():
            return
        _settle(trainer.parts.device)
        payload = {**snapshot, "format": trainer.ckpt.gather(trainer.loop, only=())["format"],
                   "config": dict(trainer.ckpt.config), "event": asdict(event)}
        atomic_save(payload, path)

    def _restore(self, snapshot: dict[str, Any], event: Event) -> None:
        trainer, loop = self.trainer, self.trainer.loop
        restored = int(snapshot["loop"]["step"])
        _settle(trainer.parts.device)
        position = LoopState(**snapshot["loop"])
        skipped = self._skipped((position.epoch, position.batch), restored, event.step)
        # counters that describe the whole run survive the restore (spikes found, steps skipped by the guard)
        kept = _counters(trainer.observers)
        objects = trainer.ckpt.objects
        for name in SNAPSHOT:
            obj = objects.get(name)
            if obj is not None and name in snapshot:  # a copy: optimizer.load_state_dict keeps the tensors it gets
                obj.load_state_dict(_copy(snapshot[name], False))
        _set_counters(trainer.observers, kept)
        trainer.observers.reset_after_rollback(restored)  # e.g. an undone step's loss still on its way (CUDA)
        set_rng_state(snapshot["rng"])
        epoch, batch = self._advance((position.epoch, position.batch), skipped)
        loop.step, loop.epoch, loop.batch = position.step, epoch, batch
        loop.last_log_step, loop.evaluated = position.last_log_step, position.evaluated
        trainer.hooks.set_step(loop.step)
        _repause_records(trainer.observers.named.get("spike"), loop.step)
        self.hide_until = max(self.hide_until, event.step, self._logged_max())
        self.snapshots = deque([s for s in self.snapshots if s["loop"]["step"] <= restored], maxlen=self.cfg.keep)
        self.positions = {s: p for s, p in self.positions.items() if s < restored}
        self.log_steps = deque([s for s in self.log_steps if s < restored], maxlen=self.log_steps.maxlen)
        new = [b for b in skipped if b not in self.skipped]
        self.skipped.extend(new)
        row = {"step": event.step, "onset": event.onset, "reason": event.reason, "restored": restored,
               "skipped": skipped}
        self.rollbacks.append(row)
        self._release({"action": "rollback", "rolled_back": True, "restored_step": restored, "skipped": skipped})
        if getattr(trainer, "bar", None) is not None:
            trainer.bar.n = loop.step
            trainer.bar.refresh()
        log.warning("%s at step %d (onset %d): rolled back to the snapshot of step %d and skipped %d batches "
                    "(epoch, index): %s", event.reason, event.step, event.onset, restored, len(skipped),
                    _batch_list(skipped))

    def _skipped(self, start: tuple[int, int], restored: int, step: int) -> list[list[int]]:
        """The batches from the snapshot's position (``start``) through the event's, or ``skip`` batches from
        there."""
        seen = [[epoch, b] for s in sorted(self.positions) if restored <= s <= step
                for epoch, batches in [self.positions[s]] for b in batches]
        if self.cfg.skip is None:
            return seen
        if self.cfg.skip <= len(seen):
            return seen[:self.cfg.skip]
        extra, (epoch, batch) = self.cfg.skip - len(seen), self._advance(start, seen)
        per_epoch = self.trainer.parts.loaders.batches_per_epoch()
        for _ in range(extra):
            seen.append([epoch, batch])
            epoch, batch = (epoch + 1, 0) if per_epoch is not None and batch + 1 >= per_epoch else (epoch, batch + 1)
        return seen

    def _advance(self, start: tuple[int, int], skipped: list[list[int]]) -> tuple[int, int]:
        """The data position after the skipped batches (the start when none)."""
        if not skipped:
            return start
        epoch, batch = skipped[-1]
        batch += 1
        per_epoch = self.trainer.parts.loaders.batches_per_epoch()
        if per_epoch is not None and batch >= per_epoch:
            epoch, batch = epoch + 1, 0
        return epoch, batch

    def _logged_max(self) -> int:
        return self._max_logged

    # -- held spike rows ----------------------------------------------------------------------------------------
    def _release(self, extra: dict[str, Any] | None) -> None:
        rows, self.held = self.held, []
        for row in rows:
            self._sinks.spike({**row, **(extra or {"action": "log"})})

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"skipped": [list(b) for b in self.skipped], "rollbacks": list(self.rollbacks),
                "hide_until": self.hide_until, "logged_max": self._logged_max()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped = [list(b) for b in state.get("skipped", [])]
        self.rollbacks = [dict(r) for r in state.get("rollbacks", [])]
        self.hide_until = int(state.get("hide_until", -1))
        self._max_logged = int(state.get("logged_max", -1))

    def summary(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        out: dict[str, Any] = {"guard/snapshot_bytes": self.snapshot_bytes}
        if self.on_spike or self.on_nonfinite:
            out.update({"guard/rollbacks": len(self.rollbacks), "guard/skipped_batches": len(self.skipped),
                        "guard/rollback_events": self.rollbacks, "guard/skipped": self.skipped})
        return out


class _Sinks:
    """The trainer's sinks as a rolled-back run uses them (see :meth:`Rollback.wrap`)."""

    def __init__(self, sinks: Any, rollback: Rollback):
        self._inner, self._rollback = sinks, rollback
        rollback._sinks = sinks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def log(self, metrics: Mapping[str, Any], step: int, histograms: Any = None) -> None:
        r = self._rollback
        if any(k.startswith("train/") for k in metrics) and (not r.log_steps or r.log_steps[-1] != step):
            r.log_steps.append(step)
        if step <= r.hide_until:
            return
        r._max_logged = max(r._logged_max(), step)
        self._inner.log(metrics, step, histograms)

    def log_histograms(self, histograms: Any, step: int) -> None:
        if step > self._rollback.hide_until:
            self._inner.log_histograms(histograms, step)

    def image(self, key: str, path: Path, step: int) -> None:
        if step > self._rollback.hide_until:
            self._inner.image(key, path, step)

    def spike(self, row: Mapping[str, Any]) -> None:
        self._rollback.held.append(dict(row))  # written by after_step, with what was done about it

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._inner.load_state_dict(state)


def _settle(device: torch.device) -> None:
    """The snapshot copies enqueued on the device's stream have landed in host memory."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _repause_records(spike: Any, step: int) -> None:
    """Restored to before a spike's window: the spike recorder's ``record`` specs are off again."""
    record, hooks, until = (getattr(spike, k, None) for k in ("record", "hooks", "until"))
    if record and hooks is not None and until is not None and step >= until:
        hooks.pause(record)


def _event_onset(event: Any, fallback: int) -> int:
    onset = getattr(event, "onset", None)
    return fallback if onset is None else int(onset)


def _counters(observers: Any) -> dict[str, Any]:
    out = {}
    spike, guard = observers.named.get("spike"), observers.named.get("guard")
    if spike is not None:
        out["found"] = getattr(spike, "found", None)
    if guard is not None:
        out["skipped"], out["warned"] = getattr(guard, "skipped", None), getattr(guard, "warned", None)
    return out


def _set_counters(observers: Any, kept: Mapping[str, Any]) -> None:
    spike, guard = observers.named.get("spike"), observers.named.get("guard")
    if spike is not None and kept.get("found") is not None:
        spike.found = kept["found"]
    if guard is not None:
        for key in ("skipped", "warned"):
            if kept.get(key) is not None:
                setattr(guard, key, kept[key])


def _batch_list(batches: list[list[int]], most: int = 8) -> str:
    text = ", ".join(f"({e}, {b})" for e, b in batches[:most])
    return text + (f" and {len(batches) - most} more" if len(batches) > most else "") if batches else "none"
