"""The one-file checkpoint: its format and entries, written atomically (a temporary file in the same folder,
flushed, then renamed) and read back checked (every zip member's CRC, the format, every required entry)."""

from __future__ import annotations

import contextlib
import os
import zipfile
from pathlib import Path
from typing import Any

import torch

from hookexp.errors import CheckpointError
from hookexp.run.rundir import CLI, Launch

FORMAT = 2


REQUIRED_ENTRIES = ("format", "config", "loop", "rng", "model", "optimizer", "hooks")


WEIGHTS = ("model", "optimizer")  # restored first, before hooks and probes are attached (restore_weights)


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


def read_checked(path: Path, required: tuple[str, ...] = REQUIRED_ENTRIES, previous: Path | None = None,
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
