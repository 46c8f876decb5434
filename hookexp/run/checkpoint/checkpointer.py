"""The :class:`Checkpointer`: what goes into a checkpoint, when a run resumes from one, and saving it (one file,
or under FSDP the sharded directory of :mod:`hookexp.run.checkpoint.sharded`)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hookexp.errors import CheckpointError
from hookexp.run.checkpoint.config_diff import config_changes
from hookexp.run.checkpoint.files import FORMAT, WEIGHTS, fsync_dir, read_checked, save_to
from hookexp.run.checkpoint.rng import rng_state, set_rng_state
from hookexp.run.checkpoint.sharded import ShardedFormat
from hookexp.run.checkpoint.signals import StopSignals
from hookexp.run.checkpoint.state import LoopState, Stateful
from hookexp.run.distributed import Dist
from hookexp.run.rundir import CLI, Launch, resumable_changes, set_aside
from hookexp.run.sinks import files_error

log = logging.getLogger("hookexp.checkpoint")


def finite_parameters(model: torch.nn.Module) -> bool:
    """Whether every parameter is finite (one host read; a DTensor by its local shard)."""
    params = [p.detach() for p in model.parameters() if p.numel()]
    if not params:
        return True
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return bool(torch.stack([n.float() for n in torch._foreach_norm(local, float("inf"))]).isfinite().all())


class Checkpointer(ShardedFormat):
    """Saves and restores a run; ``stops`` (:class:`StopSignals`) is the flag SIGTERM/SIGINT set, which the loop
    checks after each step.

    ``track(name=obj)`` registers what goes into a checkpoint (anything with state_dict/load_state_dict).
    ``ranks``: under FSDP (``ranks.sharded``) the checkpoint is a directory every rank writes its shards into;
    otherwise one file, written by rank 0.
    """

    def __init__(self, run_dir: Path, config: Mapping[str, Any], resume: Any = None, *, ranks: Dist | None = None,
                 launch: Launch = CLI):
        self.launch = launch  # how the run was started: its errors name their fixes so
        self.ranks = ranks or Dist()
        self.sharded = self.ranks.sharded
        self.run_dir = run_dir
        self.dir = run_dir / "checkpoints"
        self.name, self.previous_name = ("last", "previous") if self.sharded else ("last.pt", "previous.pt")
        self.path = self.dir / self.name
        self.config = config
        self.main = self.ranks.is_main  # only rank 0 writes the files of a one-file checkpoint
        self.source = self._resolve(resume)
        self.objects: dict[str, Stateful | None] = {}
        self.stops = StopSignals()
        self._restored: set[str] = set()
        self.saved_step: int | None = None

    def _resolve(self, resume: Any) -> Path | None:
        if resume is None or resume is False or str(resume).lower() in ("false", "none", "null"):
            return None
        if resume is True or str(resume).lower() == "true":
            return self.path
        path = Path(str(resume))
        return path / "checkpoints" / self.name if (path / "checkpoints").is_dir() else path

    @property
    def source_run_dir(self) -> Path | None:
        """The run directory the resumed checkpoint belongs to (its files are continued)."""
        return None if self.source is None else self.source.parent.parent

    # -- reading ---------------------------------------------------------------------------------------
    def load(self) -> dict[str, Any] | None:
        """The checkpoint to resume from, checked (None for a fresh run); under FSDP this rank's part of it. Called
        before anything is built, so that a bad checkpoint fails first and nothing of the run is touched."""
        if self.source is None:
            return None
        exists = Path.is_dir if self.sharded else Path.is_file
        if not exists(self.source):
            previous = self.source.with_name(self.previous_name)
            if self.source.name == self.name and exists(previous):  # killed between the two renames of a save
                log.warning("no %s: resuming from %s (a save was cut short)", self.source, previous)
                self.source = previous
            elif self.source == self.path and not self._other_layout():  # resume=true: no checkpoint here yet
                aside = set_aside(self.run_dir, self.launch) if self.main else None
                log.warning("resume: %s holds no checkpoint: starting from step 0%s", self.run_dir,
                            f" (the files of the attempt before, which never checkpointed, are in {aside})" if aside
                            else "")
                self.source = None
                return None
            else:
                how = self.launch
                raise CheckpointError(f"there is no checkpoint at {self.source}{self._other_layout()}. "
                                      f"{how.resume_here} continues the run in {how.dir_name} ({how.give_dir}); "
                                      "resume=PATH names a checkpoint or run directory.", key=how.resume_key)
        data = self._read_sharded() if self.sharded else read_checked(self.source, launch=self.launch)
        changes = config_changes(data["config"], self.config)
        if changes:
            raise CheckpointError(f"the checkpoint {self.source} was written with another config; resuming would mix "
                                  f"two runs. Differences: {'; '.join(changes[:12])}"
                                  f"{f' (and {len(changes) - 12} more)' if len(changes) > 12 else ''}. Resume with "
                                  f"the config it was written with (only {resumable_changes()} may change), or "
                                  "start a new run.", key="resume")
        return data

    def _other_layout(self) -> str:
        """Why there is no checkpoint when the other strategy's one is there."""
        other = self.source.with_name("last" if not self.sharded else "last.pt") if self.source else None
        if other is None or not other.exists():
            return ""
        if self.sharded:
            return (f" (there is {other}, a single-file checkpoint of a run without FSDP: resume it with the "
                    "trainer.strategy it was written with)")
        return (f" (there is {other}, a sharded checkpoint of an FSDP run: resume it with trainer.strategy=fsdp "
                "under torchrun with as many ranks)")

    def track(self, **objects: Stateful | None) -> None:
        self.objects.update(objects)

    def restore_weights(self, data: Mapping[str, Any]) -> None:
        """The tracked model's and optimizer's state, right after they are built and before hooks and probes are
        attached: under FSDP, torch makes the optimizer state to load into with an optimizer step (zero gradients,
        no learning rate), which hooks on the optimizer must not see."""
        if self.sharded:
            try:
                self._load_sharded_weights(data)
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"the checkpoint {self.source} does not fit this run's model or optimizer "
                                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Resume "
                                      "with the config it was written with.", key="resume") from None
            self._restored.update(WEIGHTS)
            return
        for name in WEIGHTS:
            self._restore_one(name, data)

    def restore(self, data: Mapping[str, Any]) -> LoopState:
        """Load every tracked object's state (those :meth:`restore_weights` did not) and the random generators;
        returns the loop position."""
        for name in self.objects:
            self._restore_one(name, data)
        set_rng_state(data["rng"])
        self.saved_step = int(data["loop"]["step"])
        return LoopState(**data["loop"])

    def _restore_one(self, name: str, data: Mapping[str, Any]) -> None:
        obj = self.objects.get(name)
        if obj is None or name in self._restored:
            return
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
        self._restored.add(name)

    # -- writing ---------------------------------------------------------------------------------------
    def clean(self) -> None:
        """Remove temporary files (and, under FSDP, directories) a kill inside a write left behind; refuse a
        directory where a checkpoint file goes (before training, not at the first checkpoint)."""
        for name in () if self.sharded else (self.name, self.previous_name):
            if (self.dir / name).is_dir():
                raise files_error(self.dir / name, IsADirectoryError(name), self.run_dir)
        if self.dir.is_dir():
            for tmp in self.dir.glob(".*.tmp"):
                if tmp.is_dir():
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    tmp.unlink(missing_ok=True)

    def finite(self, model: torch.nn.Module) -> bool:
        """Whether every parameter is finite (one host read; under FSDP on every rank: one all-reduce). A checkpoint
        is written from finite states only."""
        here = finite_parameters(model)
        if self.sharded and self.ranks.enabled:
            return not self.ranks.any(not here, next(model.parameters()).device)
        return here

    def gather(self, loop: LoopState, extra: Mapping[str, Any] | None = None, only: tuple[str, ...] | None = None
               ) -> dict[str, Any]:
        """What a one-file checkpoint of ``loop`` holds (``only``: just these tracked objects), not copied: the
        tensors are the live ones (:mod:`hookexp.run.rollback` copies them into its snapshots)."""
        payload: dict[str, Any] = {"format": FORMAT, "config": dict(self.config), "loop": asdict(loop),
                                   "rng": rng_state(), **(extra or {})}
        for name, obj in self.objects.items():  # on every rank: a state may gather the ranks' parts (the meter's)
            if obj is not None and (only is None or name in only):
                payload[name] = obj.state_dict()
        return payload

    def save(self, loop: LoopState, extra: Mapping[str, Any] | None = None) -> Path:
        """Write the checkpoint of ``loop`` (rank 0; others return at once; under FSDP every rank). The caller has
        made sure that the state is finite (:meth:`finite`)."""
        if self.sharded:
            return self._save_sharded(loop, extra)
        payload = self.gather(loop, extra)
        if not self.main:
            return self.path
        tmp = self.dir / f".last.pt.{os.getpid()}.tmp"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                save_to(payload, f)
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
