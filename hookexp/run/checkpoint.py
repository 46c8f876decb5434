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

Under FSDP (``trainer.strategy=fsdp``) a checkpoint is a directory, ``checkpoints/last/``, written by every rank
with ``torch.distributed.checkpoint`` (each rank writes its own shards, nobody gathers the model)::

    .metadata, __0_0.distcp, __1_0.distcp, ...   model and optimizer tensors, sharded (torch.distributed.checkpoint)
    rank0.pt, rank1.pt, ...                      each rank's own state: everything else, as in the single file
                                                 (loop, config, its random generators, hooks, its metric sums...)
    checksums.json                               size and CRC-32 of every file above, the world size; written last

The same rules hold: the ranks write into ``checkpoints/.last.tmp/``, rank 0 writes ``checksums.json`` once
every rank has written and renamed the directory over ``last/`` (the one before it becomes ``previous/``); a
model that is not finite on any rank is saved by none; every file's CRC is checked before resuming (each rank
checks its share of the files, and every rank raises the same error), then each rank's own state as above.
Resume needs the same world size. The tensors are read by torch.distributed.checkpoint, whose ``.metadata``
is a pickle (torch's format): resume only from checkpoints you trust; the numbers and names of the optimizer's
parameter groups are kept in the rank files, so that torch.distributed.checkpoint reads no pickled values.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import threading
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hookexp.errors import CheckpointError, ConfigError
from hookexp.run.distributed import Dist
from hookexp.run.rundir import CLI, RESUMABLE_CHANGES, Launch
from hookexp.sinks import files_error

log = logging.getLogger("hookexp.checkpoint")

FORMAT = 2
REQUIRED = ("format", "config", "loop", "rng", "model", "optimizer", "hooks")
WEIGHTS = ("model", "optimizer")  # restored first, before hooks and probes are attached (restore_weights)
SHARDED_REQUIRED = ("format", "config", "loop", "rng", "optimizer_groups", "hooks")  # a rank file's entries


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
    line), except the resumable ones and keys the saved config lacks inside a group both have (added to the
    schema since: a resume composes them at their defaults, and only resumable keys may be overridden)."""
    out: list[str] = []
    for k in sorted(set(saved) | set(current), key=str):
        key = f"{prefix}{k}"
        if key.startswith(RESUMABLE_CHANGES):
            continue
        if k not in saved and prefix and prefix != "hooks.":
            continue  # a key added to the schema since the run started: the resume composed it at its default
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


def save_to(obj: Any, f: Any) -> None:
    """``torch.save`` into an open file; an OSError while writing (a full disk) comes out as itself, not as the
    RuntimeError torch's zip writer raises after it (``[enforce fail at inline_container.cc]``)."""
    try:
        torch.save(obj, f)
    except RuntimeError as e:
        os_error = e.__cause__ or e.__context__
        if isinstance(os_error, OSError):
            raise os_error from None
        raise


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary file in the same folder, flushed, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            save_to(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _unusable(path: Path, why: str, previous: Path, launch: Launch = CLI) -> CheckpointError:
    fallback = (f" The checkpoint before it is {previous}: {launch.resume_from.format(path=previous)} continues "
                "from there." if previous.exists() and previous != path else "")
    return CheckpointError(f"cannot resume from {path}: {why}.{fallback} Or start again with {launch.overwrite}.",
                           key=launch.resume_key)


def read_checked(path: Path, required: tuple[str, ...] = REQUIRED, previous: Path | None = None,
                 launch: Launch = CLI) -> dict[str, Any]:
    """A checkpoint's contents after checking its CRCs, format and entries; CheckpointError naming the file."""
    def bad(why: str) -> CheckpointError:
        return _unusable(path, why, previous or path.with_name("previous.pt"), launch)

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
    missing = [k for k in required if k not in data]
    if missing:
        raise bad(f"it lacks {', '.join(missing)}: it is incomplete")
    return data


def finite_parameters(model: torch.nn.Module) -> bool:
    """Whether every parameter is finite (one host read; a DTensor by its local shard)."""
    params = [p.detach() for p in model.parameters() if p.numel()]
    if not params:
        return True
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return bool(torch.stack([n.float() for n in torch._foreach_norm(local, float("inf"))]).isfinite().all())


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _write(payload: Any, path: Path) -> None:
    with open(path, "wb") as f:
        save_to(payload, f)
        f.flush()
        os.fsync(f.fileno())


def _tensors(state: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors of an optimizer state (by parameter name): what torch.distributed.checkpoint saves, sharded."""
    return {fqn: {k: v for k, v in values.items() if isinstance(v, torch.Tensor)} for fqn, values in state.items()}


def _others(state: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The rest of an optimizer state (numbers some optimizers keep): saved in the rank files."""
    out = {fqn: {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)} for fqn, values in state.items()}
    return {fqn: values for fqn, values in out.items() if values}


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict`` (state and groups by parameter name), without the zero-gradient optimizer step
    torch takes to make a state when there is neither a state nor a gradient (a stateless optimizer between
    steps): the hooks on the optimizer would see that step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    params = [p for group in optimizer.param_groups for p in group["params"]]
    bare = not optimizer.state and all(p.grad is None for p in params)
    if bare:
        for p in params:
            p.grad = torch.zeros_like(p)
    try:
        return get_optimizer_state_dict(model, optimizer)  # type: ignore[return-value]
    finally:
        if bare:
            for p in params:
                p.grad = None


class Checkpointer:
    """Saves and restores a run; turns SIGTERM/SIGINT into a flag the loop checks after each step.

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
        self.signum: int | None = None
        self._previous_handlers: dict[int, Any] = {}
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
                                  f"the config it was written with (only {', '.join(RESUMABLE_CHANGES[:-2])} and "
                                  "logger.* may change), or start a new run.", key="resume")
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

    def _read_sharded(self) -> dict[str, Any]:
        """Check a sharded checkpoint's files against ``checksums.json`` (each rank its share of them; every rank
        raises the same error), then read this rank's own state."""
        path, ranks = self.source, self.ranks
        assert path is not None
        previous = path.with_name(self.previous_name)
        problem = None
        try:
            sums = json.loads((path / "checksums.json").read_text())
            if sums.get("format") != FORMAT:
                problem = f"it is not a hookexp checkpoint of format {FORMAT} (found {sums.get('format')!r})"
            elif sums["world_size"] != ranks.world_size:
                problem = (f"it was written by {sums['world_size']} ranks and this run has {ranks.world_size}; an FSDP "
                           f"checkpoint resumes on the same number of ranks (torchrun --nnodes ... "
                           f"--nproc_per_node ... making {sums['world_size']} in all)")
            else:
                names = sorted(sums["files"])
                for name in names[ranks.rank::ranks.world_size]:
                    size, crc = sums["files"][name]
                    file = path / name
                    if not file.is_file():
                        problem = f"its file {name!r} is missing"
                    elif file.stat().st_size != size or _crc32(file) != crc:
                        problem = f"its file {name!r} fails its CRC check: the file is corrupt"
                    if problem:
                        break
        except FileNotFoundError:
            problem = "it has no checksums.json: it is incomplete (a save was cut short) or not written by hookexp"
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"its checksums.json cannot be read ({type(e).__name__}: {e})"
        found = next((p for p in ranks.gather(problem) if p), None)
        if found:
            raise _unusable(path, found, previous, self.launch)
        return read_checked(path / f"rank{ranks.rank}.pt", SHARDED_REQUIRED, previous, self.launch)

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

    def _load_sharded_weights(self, data: Mapping[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        model, optimizer = self.objects["model"], self.objects["optimizer"]
        optim = get_optimizer_state_dict(model, optimizer)  # type: ignore[arg-type]
        tensors = {"model": get_model_state_dict(model), "optimizer": _tensors(optim["state"])}  # type: ignore[arg-type]
        dcp.load(tensors, checkpoint_id=self.source)
        for fqn, values in data.get("optimizer_other", {}).items():
            optim["state"].setdefault(fqn, {}).update(values)
        optim["param_groups"] = data["optimizer_groups"]
        set_model_state_dict(model, tensors["model"])  # type: ignore[arg-type]
        set_optimizer_state_dict(model, optimizer, optim)  # type: ignore[arg-type]

    # -- writing ---------------------------------------------------------------------------------------
    def clean(self) -> None:
        """Remove temporary files (and, under FSDP, directories) a kill inside a write left behind."""
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

    def save(self, loop: LoopState, extra: Mapping[str, Any] | None = None) -> Path:
        """Write the checkpoint of ``loop`` (rank 0; others return at once; under FSDP every rank). The caller has
        made sure that the state is finite (:meth:`finite`)."""
        if self.sharded:
            return self._save_sharded(loop, extra)
        payload: dict[str, Any] = {"format": FORMAT, "config": dict(self.config), "loop": asdict(loop),
                                   "rng": rng_state(), **(extra or {})}
        for name, obj in self.objects.items():  # on every rank: a state may gather the ranks' parts (the meter's)
            if obj is not None:
                payload[name] = obj.state_dict()
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

    def _save_sharded(self, loop: LoopState, extra: Mapping[str, Any] | None) -> Path:
        """Every rank writes its shards and its own state into ``.last.tmp/``; rank 0 adds ``checksums.json`` and
        renames the directory over ``last/``. A rank that fails to write makes every rank raise the same error."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        ranks, tmp = self.ranks, self.dir / ".last.tmp"
        model, optimizer = self.objects["model"], self.objects["optimizer"]
        self._agree(lambda: _fresh_dir(tmp) if ranks.is_main else None, tmp)
        optim = _optimizer_state(model, optimizer)  # type: ignore[arg-type]
        dcp.save({"model": get_model_state_dict(model), "optimizer": _tensors(optim["state"])},  # type: ignore[arg-type]
                 checkpoint_id=tmp)
        payload: dict[str, Any] = {"format": FORMAT, "config": dict(self.config), "loop": asdict(loop),
                                   "rng": rng_state(), "rank": ranks.rank, "world_size": ranks.world_size,
                                   "optimizer_groups": optim["param_groups"],
                                   "optimizer_other": _others(optim["state"]), **(extra or {})}
        for name, obj in self.objects.items():
            if obj is not None and name not in WEIGHTS:
                payload[name] = obj.state_dict()
        mine = tmp / f"rank{ranks.rank}.pt"
        self._agree(lambda: _write(payload, mine), mine)
        names = sorted(p.name for p in tmp.iterdir())  # every rank's files are there: _agree waited for them
        share: dict[str, list[int]] = {}
        self._agree(lambda: share.update({n: [(tmp / n).stat().st_size, _crc32(tmp / n)]
                                          for n in names[ranks.rank::ranks.world_size]}), tmp)
        sums = {"format": FORMAT, "world_size": ranks.world_size, "step": loop.step, "files": {}}
        for part in ranks.gather(share):
            sums["files"].update(part)
        self._agree(lambda: self._publish(tmp, sums) if ranks.is_main else None, self.path)
        self.saved_step = loop.step
        return self.path

    def _publish(self, tmp: Path, sums: dict[str, Any]) -> None:
        """Rank 0, once every rank has written: the checksums, then ``last`` -> ``previous``, ``.last.tmp`` ->
        ``last``."""
        with open(tmp / "checksums.json", "w") as f:
            json.dump(sums, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if self.path.exists():
            previous = self.dir / self.previous_name
            shutil.rmtree(previous, ignore_errors=True)
            os.replace(self.path, previous)
        os.replace(tmp, self.path)
        fsync_dir(self.dir)

    def _agree(self, write: Any, path: Path) -> None:
        """Run this rank's part of a sharded save; if it fails on any rank, every rank raises (none waits forever
        for another)."""
        error = None
        try:
            write()
        except OSError as e:
            error = (str(path), e.errno, e.strerror or str(e))
        failed = next((e for e in self.ranks.gather(error) if e is not None), None)
        if failed is not None:
            where, code, text = failed
            raise files_error(Path(where), OSError(code, text), self.run_dir) from None

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
