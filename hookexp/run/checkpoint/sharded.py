"""The FSDP checkpoint (``trainer.strategy=fsdp``): a directory every rank writes its shards into with
``torch.distributed.checkpoint``, each rank's own state in ``rankN.pt``, and ``checksums.json`` (size and CRC-32
of every file) written last by rank 0. :class:`ShardedFormat` is the part of
:class:`~hookexp.run.checkpoint.Checkpointer` that reads and writes it."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hookexp.run.checkpoint.files import FORMAT, WEIGHTS, _unusable, fsync_dir, read_checked, save_to
from hookexp.run.checkpoint.rng import rng_state
from hookexp.run.checkpoint.state import LoopState, Stateful
from hookexp.run.distributed import Dist
from hookexp.run.rundir import Launch
from hookexp.run.sinks import files_error

SHARDED_REQUIRED = ("format", "config", "loop", "rng", "optimizer_groups", "hooks")  # a rank file's entries


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


class ShardedFormat:
    """Reading and writing the sharded layout; mixed into :class:`~hookexp.run.checkpoint.Checkpointer`, whose
    attributes below it uses."""

    source: Path | None
    ranks: Dist
    launch: Launch
    config: Mapping[str, Any]
    objects: dict[str, Stateful | None]
    run_dir: Path
    dir: Path
    path: Path
    previous_name: str
    saved_step: int | None

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
