"""The local files every run writes, whatever the backend: ``metrics.jsonl``, ``histograms.jsonl``,
``spikes.jsonl`` in whole lines (:class:`LocalFiles`), JSON files written atomically, and the one-paragraph
error when the disk refuses a write (:func:`files_error`)."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shlex
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from hookexp.errors import RunFilesError
from hookexp.run.sinks.base import STEP_KEY, Histograms


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf": JSON has no literal for them
    return value


def _numpy_to_list(value: Any) -> Any:
    """numpy values for the ``json`` fallback of :func:`_dumps` (orjson writes them itself, with
    OPT_SERIALIZE_NUMPY); anything else is refused."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(type(value).__name__)  # orjson says "Type is not JSON serializable: <type>"


def _dumps(row: Mapping[str, Any]) -> bytes:
    """One JSON line. orjson writes a log step's ~100 floats ten times faster than ``json`` (the same
    shortest round-trip text); it writes NaN and Inf as null, so a line with a null is written again with
    "nan", "inf" strings (JSON has no literal for them): by orjson where they were top-level values, else
    (a None, or NaN inside a list or dict) by ``json``."""
    line = orjson.dumps(row, default=_numpy_to_list, option=orjson.OPT_SERIALIZE_NUMPY)
    if b"null" in line:
        strings = {k: _jsonable(v) for k, v in row.items()}
        line = orjson.dumps(strings, default=_numpy_to_list, option=orjson.OPT_SERIALIZE_NUMPY)
        if b"null" in line:
            return json.dumps(strings, default=_numpy_to_list).encode()
    return line


def _count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def write_json_atomic(path: Path, data: Any) -> None:
    """Write a JSON file through a temporary file and a rename: readers see the old file or the new one, never a
    torn one; a failure (disk full) names the file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise files_error(path, e) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def free_space(path: Path) -> str:
    """The free space of the file system that holds ``path`` (its nearest existing folder), e.g. ``1.5 MiB``."""
    folder = path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = float(shutil.disk_usage(folder).free)
    except OSError:
        return "unknown"
    if free < 1024:
        return f"{free:.0f} B"
    units = ("KiB", "MiB", "GiB", "TiB")
    power = min((int(free).bit_length() - 1) // 10, len(units))
    return f"{free / 1024 ** power:.1f} {units[power - 1]}"


def files_error(path: Path, error: OSError, run_dir: Path | None = None) -> RunFilesError:
    """The one paragraph for a write to ``path`` that failed with ``error``: what is wrong and the fix."""
    resume = f"resume=true hydra.run.dir={run_dir or path.parent}"
    if path.is_dir():  # a folder where the file goes (os.replace onto it fails with EISDIR or ENOTDIR)
        return RunFilesError(f"cannot write {path}: it is a directory, and hookexp writes a file there. "
                             f"Everything written before is intact. Move the directory away or "
                             f"delete it (rm -r {shlex.quote(str(path))}), then continue with {resume} (from its "
                             "last checkpoint).")
    why = {errno.ENOSPC: "the disk is full", errno.EFBIG: "the file size limit is reached",
           errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
           errno.EDQUOT: "the disk quota is exceeded"}.get(error.errno or 0, error.strerror or str(error))
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        why += f" ({free_space(path)} free there)"
    return RunFilesError(f"cannot write {path}: {why}. Everything written before is intact (the run's files end "
                         "with whole lines); free space or fix the permissions, then continue with resume=true "
                         f"hydra.run.dir={run_dir or path.parent} (from its last checkpoint).")


class JsonLines:
    """An append-only file of JSON lines, written in whole lines: a failed write (disk full) is cut back to the
    last whole line. :attr:`lines` counts the lines on the disk (what a checkpoint may promise to keep)."""

    def __init__(self, path: Path):
        self.path = path
        self.lines = _count_lines(path)
        self._fd: int | None = None
        self._pending: list[bytes] = []
        self._size = path.stat().st_size if path.exists() else 0

    def add(self, line: bytes) -> None:
        self._pending.append(line + b"\n")

    def flush(self, durable: bool = False) -> None:
        if self._pending:
            try:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._write(b"".join(self._pending))
                self.lines += len(self._pending)
                self._pending.clear()
            except OSError as e:
                self._keep_what_fits()
                raise files_error(self.path, e) from None
        if durable and self._fd is not None:
            os.fsync(self._fd)

    def _write(self, data: bytes) -> None:
        """Write all of ``data`` or, failing, cut the file back to its last whole line and raise."""
        assert self._fd is not None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)

    def _keep_what_fits(self) -> None:
        """After a failed write (disk full): write the pending lines one by one while they fit."""
        while self._pending and self._fd is not None:
            try:
                self._write(self._pending[0])
            except OSError:
                return
            self._pending.pop(0)
            self.lines += 1

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class LocalFiles:
    """The run directory's own record: ``metrics.jsonl`` (one line of scalars per log step),
    ``histograms.jsonl`` (one line per log step that has histograms: ``{"trainer/step": s, key:
    {"bins": edges, "values": counts}}``, W&B's own shape), ``spikes.jsonl`` (one line per spike the spike
    recorder found, :mod:`hookexp.telemetry.spike`) and, at the end, ``summary.json``.

    Lines reach the disk at least every ``FLUSH_S`` seconds, at every checkpoint (flushed to the disk: the
    checkpoint records how many lines it keeps, :meth:`state_dict`) and at the end.
    """

    FLUSH_S = 1.0
    FILES = ("metrics.jsonl", "histograms.jsonl", "spikes.jsonl")

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.histograms_path = run_dir / "histograms.jsonl"
        self._files = {name: JsonLines(run_dir / name) for name in self.FILES}
        self._flushed = time.monotonic()

    @property
    def lines(self) -> dict[str, int]:
        return {name: f.lines for name, f in self._files.items()}

    def state_dict(self) -> dict[str, Any]:
        """The line counts a checkpoint keeps; every line counted is on the disk (flushed and synced first)."""
        self.flush(durable=True)
        return {"lines": self.lines, "source": str(self.run_dir)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep exactly the lines written before the checkpoint (from the run it was written in)."""
        self.close()
        self.keep(Path(state.get("source") or self.run_dir), self.run_dir, state["lines"])
        self._files = {name: JsonLines(self.run_dir / name) for name in self.FILES}

    @classmethod
    def keep(cls, source: Path, run_dir: Path, lines: Mapping[str, int]) -> None:
        """Write into ``run_dir`` the first ``lines[name]`` lines of each file in ``source`` (a file not counted
        keeps none), atomically."""
        for name in cls.FILES:
            previous = source / name
            kept: list[bytes] = []
            if previous.exists():
                with open(previous, "rb") as f:
                    for i, line in enumerate(f):
                        if i >= lines.get(name, 0):
                            break
                        kept.append(line)
            target = run_dir / name
            if kept or target.exists():
                tmp = target.with_name(f".{name}.{os.getpid()}.tmp")
                try:
                    tmp.write_bytes(b"".join(kept))
                    os.replace(tmp, target)
                except OSError as e:
                    raise files_error(target, e) from None
                finally:
                    tmp.unlink(missing_ok=True)

    def log(self, metrics: Mapping[str, Any], step: int, histograms: Histograms | None = None) -> None:
        """A line of ``metrics.jsonl`` (and, given ``histograms``, one of ``histograms.jsonl``)."""
        self._files["metrics.jsonl"].add(_dumps({STEP_KEY: step, **metrics}))
        if histograms:
            self.log_histograms(histograms, step)
        if time.monotonic() - self._flushed >= self.FLUSH_S:
            self.flush()

    def log_histograms(self, histograms: Histograms, step: int) -> None:
        """A line of ``histograms.jsonl``: ``{"trainer/step": s, key: {"bins": edges, "values": counts}}``."""
        row = {STEP_KEY: step, **{k: {"bins": edges, "values": counts} for k, (counts, edges) in histograms.items()}}
        self._files["histograms.jsonl"].add(_dumps(row))

    def spike(self, row: Mapping[str, Any]) -> None:
        """A line of ``spikes.jsonl``, on the disk at once (a spike is rare, and what follows it may crash)."""
        self._files["spikes.jsonl"].add(_dumps(row))
        self.flush()

    def image(self, key: str, path: Path, step: int) -> None:
        """Nothing: the plot is a file of the run directory already."""

    def resume_state(self) -> dict[str, Any]:
        """Nothing: the checkpointer keeps the line counts (:meth:`state_dict`, as ``files``)."""
        return {}

    def flush(self, durable: bool = False) -> None:
        for f in self._files.values():
            f.flush(durable)
        self._flushed = time.monotonic()

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        try:
            self.close()
        finally:
            write_json_atomic(self.run_dir / "summary.json", {k: _jsonable(v) for k, v in summary.items()})
