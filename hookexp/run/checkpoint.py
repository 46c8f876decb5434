"""Checkpoints: the whole state of a run, written so that nothing earlier is ever lost.

:class:`Checkpointer` owns the loop position (:class:`LoopState`), the stop signals, and saving and
restoring everything that has a ``state_dict``: model, optimizer, schedule, GradScaler, the hooks (counters,
noise generators, stateful transforms), the telemetry (the log period's sums), the local files (how many
lines they held: a resumed run keeps exactly those), the records, every random generator and the W&B run id.

The rules it keeps (issue "Nothing lost, nothing mixed"):
- written atomically: a temporary file in ``checkpoints/``, flushed to the disk, then renamed over
  ``last.pt``; the one before it stays as ``previous.pt``; temporary files a kill left behind are removed;
- written only from a finite state: a model holding NaN/Inf is never saved over a good checkpoint;
- read back checked: every zip member's CRC (torch.load does not check them), the format and every
  required entry, and the config it was written with — resuming with a different config is an error that
  lists the differing keys, except the few in :data:`RESUMABLE_CHANGES`;
- read with ``torch.load(weights_only=True)``: only tensors, numbers, strings and containers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import threading
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hookexp.errors import CheckpointError, ConfigError
from hookexp.run.rundir import RESUMABLE_CHANGES
from hookexp.sinks import files_error

log = logging.getLogger("hookexp.checkpoint")

FORMAT = 2
REQUIRED = ("format", "config", "loop", "rng", "model", "optimizer", "hooks")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class LoopState:
    """Where the loop is: a new run starts at zero, a resumed one where its checkpoint stopped."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch being trained
    batch: int = 0  # batches of that epoch consumed
    last_log_step: int = 0  # the first step of the current log period
    evaluated: int = -1  # the last step after which validation ran
    train_s: float = 0.0  # seconds spent in training steps (validation and start-up aside)


def rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``key: saved -> current`` for every key where the two configs part (a whole spec that one lacks is one
    line), except the resumable ones."""
    out: list[str] = []
    for k in sorted(set(saved) | set(current), key=str):
        key = f"{prefix}{k}"
        if key.startswith(RESUMABLE_CHANGES):
            continue
        a, b = saved.get(k, "<unset>"), current.get(k, "<unset>")
        if isinstance(a, Mapping) and isinstance(b, Mapping) and a and b:
            out += config_changes(a, b, key + ".")
        elif a != b:
            out.append(f"{key}: {_short(a)} -> {_short(b)}")
    return out


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary file in the same folder, flushed, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def read_checked(path: Path) -> dict[str, Any]:
    """A checkpoint's contents after checking its CRCs, format and entries; CheckpointError naming the file."""
    def bad(why: str) -> CheckpointError:
        previous = path.with_name("previous.pt")
        fallback = (f" The checkpoint before it is {previous}: resume=true hydra.run.dir=... with "
                    f"resume={previous} continues from there." if previous.exists() and previous != path else "")
        return CheckpointError(f"cannot resume from {path}: {why}.{fallback} Or start again with +overwrite=true.",
                               key="resume")

    try:
        with zipfile.ZipFile(path) as zf:
            broken = zf.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        raise bad(f"it is not a readable checkpoint ({type(e).__name__}: {e}); it is empty, truncated or not written "
                  "by hookexp") from None
    if broken is not None:
        raise bad(f"its entry {broken!r} fails its CRC check: the file is corrupt") from None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise bad(f"torch cannot read it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise bad(f"it is not a hookexp checkpoint of format {FORMAT} (found {found!r})")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise bad(f"it lacks {', '.join(missing)}: it is incomplete")
    return data


class Checkpointer:
    """Saves and restores a run; turns SIGTERM/SIGINT into a flag the loop checks after each step.

    ``track(name=obj)`` registers what goes into a checkpoint (anything with state_dict/load_state_dict).
    """

    def __init__(self, run_dir: Path, config: Mapping[str, Any], resume: Any = None, *, main: bool = True):
        self.run_dir = run_dir
        self.dir = run_dir / "checkpoints"
        self.path = self.dir / "last.pt"
        self.config = config
        self.main = main
        self.source = self._resolve(resume)
        self.objects: dict[str, Stateful | None] = {}
        self.signum: int | None = None
        self._previous_handlers: dict[int, Any] = {}
        self.saved_step: int | None = None

    def _resolve(self, resume: Any) -> Path | None:
        if resume is None or resume is False or str(resume).lower() in ("false", "none", "null"):
            return None
        if resume is True or str(resume).lower() == "true":
            return self.path
        path = Path(str(resume))
        return path / "checkpoints" / "last.pt" if path.is_dir() else path

    @property
    def source_run_dir(self) -> Path | None:
        """The run directory the resumed checkpoint belongs to (its files are continued)."""
        return None if self.source is None else self.source.parent.parent

    # -- reading ---------------------------------------------------------------------------------------
    def load(self) -> dict[str, Any] | None:
        """The checkpoint to resume from, checked (None for a fresh run). Called before anything is built,
        so that a bad checkpoint fails first and nothing of the run is touched."""
        if self.source is None:
            return None
        if not self.source.is_file():
            previous = self.source.with_name("previous.pt")
            if self.source.name == "last.pt" and previous.is_file():  # killed between the two renames of a save
                log.warning("no %s: resuming from %s (a save was cut short)", self.source, previous)
                self.source = previous
            else:
                raise CheckpointError(f"there is no checkpoint at {self.source}. resume=true continues the run in "
                                      "hydra.run.dir (give hydra.run.dir=<the interrupted run's directory>); "
                                      "resume=PATH names a checkpoint file or run directory.", key="resume")
        data = read_checked(self.source)
        changes = config_changes(data["config"], self.config)
        if changes:
            raise CheckpointError(f"the checkpoint {self.source} was written with another config; resuming would mix "
                                  f"two runs. Differences: {'; '.join(changes[:12])}"
                                  f"{f' (and {len(changes) - 12} more)' if len(changes) > 12 else ''}. Resume with "
                                  f"the config it was written with (only {', '.join(RESUMABLE_CHANGES[:-2])} and "
                                  "logger.* may change), or start a new run.", key="resume")
        return data

    def track(self, **objects: Stateful | None) -> None:
        self.objects.update(objects)

    def restore(self, data: Mapping[str, Any]) -> LoopState:
        """Load every tracked object's state and the random generators; returns the loop position."""
        for name, obj in self.objects.items():
            if obj is None:
                continue
            if name not in data:
                raise CheckpointError(f"the checkpoint {self.source} holds no {name!r} state, which this run needs "
                                      "(it was written without it). Start a new run.", key="resume")
            try:
                obj.load_state_dict(data[name])
            except CheckpointError:
                raise
            except (RuntimeError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"the checkpoint {self.source} does not fit this run's {name} "
                                      f"({type(e).__name__}: {str(e).splitlines()[0]}). Resume with the config it "
                                      "was written with.", key="resume") from None
        set_rng_state(data["rng"])
        self.saved_step = int(data["loop"]["step"])
        return LoopState(**data["loop"])

    # -- writing ---------------------------------------------------------------------------------------
    def clean(self) -> None:
        """Remove temporary files a kill inside a write left behind."""
        if self.dir.is_dir():
            for tmp in self.dir.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)

    def save(self, loop: LoopState, extra: Mapping[str, Any] | None = None) -> Path:
        """Write the checkpoint of ``loop`` (rank 0; others return at once). The caller has made sure that
        the state is finite (:meth:`finite`)."""
        if not self.main:
            return self.path
        payload: dict[str, Any] = {"format": FORMAT, "config": dict(self.config), "loop": asdict(loop),
                                   "rng": rng_state(), **(extra or {})}
        for name, obj in self.objects.items():
            if obj is not None:
                payload[name] = obj.state_dict()
        tmp = self.dir / f".last.pt.{os.getpid()}.tmp"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            if self.path.exists():
                os.replace(self.path, self.dir / "previous.pt")
            os.replace(tmp, self.path)
            fsync_dir(self.dir)
        except OSError as e:
            raise files_error(self.path, e, self.run_dir) from None
        finally:
            tmp.unlink(missing_ok=True)
        self.saved_step = loop.step
        return self.path

    @staticmethod
    def finite(model: torch.nn.Module) -> bool:
        """Whether every parameter is finite (one host read): a checkpoint is written from finite states only."""
        params = [p.detach() for p in model.parameters() if p.numel()]
        if not params:
            return True
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        return bool(torch.stack([n.float() for n in torch._foreach_norm(local, float("inf"))]).isfinite().all())

    # -- signals ---------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum

    @property
    def stop_requested(self) -> bool:
        return self.signum is not None

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT set a flag for the whole block — the loop and the shutdown after it — so that a
        signal during shutdown cannot cut the summary or the W&B finish short (main thread only)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            yield
        finally:
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
            self._previous_handlers.clear()


def require_writable(run_dir: Path) -> None:
    """One paragraph when the run directory cannot be written (read-only disk, permissions)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test.{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write to the run directory {run_dir} ({e.strerror or e}). Choose a writable "
                          "directory with hydra.run.dir=PATH, or free space/permissions there.",
                          key="hydra.run.dir") from None
