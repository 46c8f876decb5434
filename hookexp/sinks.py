"""Where metrics go: always local files in the run directory, and W&B when configured.

Every sink gets the same dict for the same step, so the local files and the W&B history hold the
same numbers: the scalars in ``metrics.jsonl``, the histograms in ``histograms.jsonl`` (bin edges and
counts, as W&B stores them). ``wandb`` is imported only by :class:`WandbSink`, only when it is used.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from hookexp.errors import ConfigError, RunFilesError

log = logging.getLogger("hookexp.sinks")

STEP_KEY = "trainer/step"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf": JSON has no literal for them
    return value


Histograms = Mapping[str, tuple[Any, Any]]  # key -> (counts, bin edges): float lists or 1-d float64 arrays


def _plain(value: Any) -> Any:
    """numpy values for the ``json`` fallback of :func:`_dumps` (orjson writes them itself, with
    OPT_SERIALIZE_NUMPY); anything else is refused."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(type(value).__name__)  # orjson says "Type is not JSON serializable: <type>"


def _dumps(row: Mapping[str, Any]) -> bytes:
    """One JSON line. orjson writes a log step's ~100 floats ten times faster than ``json`` (the same
    shortest round-trip text); it writes NaN and Inf as null, so a line with a null is written again
    by ``json`` with "nan", "inf" strings (JSON has no literal for them)."""
    line = orjson.dumps(row, default=_plain, option=orjson.OPT_SERIALIZE_NUMPY)
    if b"null" in line:
        return json.dumps({k: _jsonable(v) for k, v in row.items()}, default=_plain).encode()
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
        self._files["metrics.jsonl"].add(_dumps({STEP_KEY: step, **metrics}))
        if histograms:
            row = {STEP_KEY: step, **{k: {"bins": edges, "values": counts}
                                      for k, (counts, edges) in histograms.items()}}
            self._files["histograms.jsonl"].add(_dumps(row))
        if time.monotonic() - self._flushed >= self.FLUSH_S:
            self.flush()

    def spike(self, row: Mapping[str, Any]) -> None:
        """A line of ``spikes.jsonl``, on the disk at once (a spike is rare, and what follows it may crash)."""
        self._files["spikes.jsonl"].add(_dumps(row))
        self.flush()

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


def check_logger(cfg: Mapping[str, Any]) -> None:
    """Refuse an unknown backend or mode before anything is built or written."""
    if cfg.get("backend") not in ("wandb", "none"):
        raise ConfigError(f"unknown logger backend {cfg.get('backend')!r}. Use wandb or none (local files are "
                          "always written).", key="logger.backend")
    if cfg.get("mode") not in ("offline", "online", "disabled"):
        raise ConfigError(f"unknown W&B mode {cfg.get('mode')!r}. Use offline, online or disabled.",
                          key="logger.mode")
    env = os.environ.get("WANDB_MODE")
    if cfg.get("backend") == "wandb" and env is not None and env not in ("offline", "online", "disabled", "dryrun",
                                                                        "run"):
        raise ConfigError(f"the environment sets WANDB_MODE={env!r}, which W&B refuses (and which would override "
                          f"logger.mode={cfg.get('mode')}). Unset it (`unset WANDB_MODE`) or set it to offline, online "
                          "or disabled.", key="WANDB_MODE")


def wandb_mode(cfg: Mapping[str, Any]) -> str:
    """The W&B mode a run uses: ``WANDB_MODE`` in the environment wins over ``logger.mode``, as W&B users expect
    (CI switches W&B off with ``WANDB_MODE=disabled``); W&B's old names ``dryrun`` and ``run`` are offline and
    online. :func:`check_logger` has refused any other value."""
    env = os.environ.get("WANDB_MODE")
    return str(cfg.get("mode", "offline")) if env is None else {"dryrun": "offline", "run": "online"}.get(env, env)


class WandbSink:
    """One W&B run per job. ``mode=offline`` writes it under ``<run_dir>/wandb``; an unreachable
    server in ``online`` mode falls back to offline with one warning instead of killing training.

    ``run.log`` costs milliseconds of Python for a log step with many keys, so it runs on one worker
    thread that consumes an ordered queue (while the training thread is inside torch's kernels,
    which release the GIL). ``finish`` drains the queue first; a failure in the worker is reported
    once as a warning and never stops training (the local files hold the same numbers). The queue is
    bounded (``QUEUE_SIZE`` log steps): if W&B falls behind, training waits rather than memory grows.
    """

    QUEUE_SIZE = 32

    def __init__(self, run_dir: Path, cfg: Mapping[str, Any], config: dict[str, Any], tags: list[str],
                 hooks_table: list[dict[str, Any]], run_id: str | None = None):
        import wandb

        self._wandb = wandb
        kwargs = dict(
            project=cfg.get("project") or "hookexp", entity=cfg.get("entity"), group=cfg.get("group"),
            job_type=cfg.get("job_type"), name=cfg.get("name"), tags=tags, config=config,
            dir=str(run_dir), reinit="finish_previous",
        )
        if run_id is not None:  # a resumed run continues its W&B run
            kwargs.update(id=run_id, resume="allow")
        mode = wandb_mode(cfg)
        if mode != cfg.get("mode", "offline"):
            log.info("W&B mode %s, from WANDB_MODE in the environment (it wins over logger.mode=%s)", mode,
                     cfg.get("mode"))
        timeout = float(cfg.get("init_timeout", 30.0))
        if mode == "online":
            base_url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
            if not _answers(base_url, timeout):  # never start an online run that would hang init and the exit
                log.warning("the W&B server %s did not answer within logger.init_timeout=%g s; logging offline under "
                            "%s/wandb instead. Upload later with `wandb sync`.", base_url, timeout, run_dir)
                mode = "offline"
                # W&B's own telemetry exporter would wait on the same server at exit (~10 s with wandb 0.31)
                os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        # quiet: W&B's ~30 lines of history and summary at the end would bury hookexp's own summary line
        settings = wandb.Settings(init_timeout=timeout, quiet=bool(cfg.get("quiet", True)))
        try:
            self.run = wandb.init(mode=mode, settings=settings, **kwargs)
        except Exception as e:
            if mode != "online":
                raise
            log.warning("W&B online init failed (%s: %s); logging offline under %s/wandb instead. Upload later with "
                        "`wandb sync`.", type(e).__name__, e, run_dir)
            self.run = wandb.init(mode="offline", settings=settings, **kwargs)
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        if hooks_table:
            columns = ["spec", "kind", "transform", "args", "enabled", "targets"]
            rows = [[r["spec"], r["kind"], r["transform"], json.dumps(r["args"]), r["enabled"],
                     ", ".join(r["targets"])] for r in hooks_table]
            self.run.log({"hooks/table": wandb.Table(columns=columns, data=rows)}, commit=False)
        # Bounded: when W&B falls behind, training waits for it instead of queueing rows without end.
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=self.QUEUE_SIZE)
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._work, name="hookexp-wandb", daemon=True)
        self._worker.start()

    @property
    def run_id(self) -> str:
        return str(self.run.id)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            if self._error is None:
                try:
                    job()
                except Exception as e:
                    self._error = e

    def _check(self) -> None:
        if self._error is not None and not getattr(self, "_warned", False):
            self._warned = True
            log.warning("W&B logging failed (%s: %s); the run continues and the local files (metrics.jsonl, "
                        "histograms.jsonl) hold every value.", type(self._error).__name__, self._error)

    def log(self, metrics: Mapping[str, Any], step: int, histograms: Histograms | None = None) -> None:
        row = {STEP_KEY: step, **metrics}
        hists = dict(histograms or {})
        self._queue.put(lambda: self.run.log({**row, **{k: self._histogram(*h) for k, h in hists.items()}}))
        self._check()

    def _histogram(self, counts: Any, edges: Any) -> Any:
        return self._wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges)))

    def log_image(self, key: str, path: Path) -> None:
        self._queue.put(lambda: self.run.log({key: self._wandb.Image(str(path))}))

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        self._queue.put(None)
        self._worker.join()
        self._check()
        for k, v in summary.items():
            self.run.summary[k] = v
        self.run.finish(exit_code=1 if failed else 0)


def _answers(url: str, timeout: float) -> bool:
    """Whether an HTTP server answers at ``url`` within ``timeout`` seconds (any status counts)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # it answered, if only to refuse
    except (OSError, ValueError):
        return False


class NullSinks:
    """What ranks other than 0 log to: nothing."""

    def log(self, metrics: Mapping[str, Any], step: int, histograms: Histograms | None = None) -> None:
        pass

    def spike(self, row: Mapping[str, Any]) -> None:
        pass

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        pass


class Sinks:
    """Fan-out to every sink; a sink that fails to finish does not stop the others."""

    def __init__(self, local: LocalFiles, wandb_sink: WandbSink | None):
        self.local = local
        self.wandb = wandb_sink

    def log(self, metrics: Mapping[str, Any], step: int, histograms: Histograms | None = None) -> None:
        self.local.log(metrics, step, histograms)
        if self.wandb is not None:
            self.wandb.log(metrics, step, histograms)

    def spike(self, row: Mapping[str, Any]) -> None:
        self.local.spike(row)

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        try:
            self.local.finish(summary, failed)
        finally:
            if self.wandb is not None:
                self.wandb.finish(summary, failed)
