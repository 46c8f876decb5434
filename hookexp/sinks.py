"""Where metrics go: always local files in the run directory, and the backend ``logger._target_`` names
(``logger=wandb``: :class:`WandbSink`, ``logger=tensorboard``: :class:`TensorBoardSink`, ``logger=none``: none).

Every sink implements :class:`Sink` and gets the same dict for the same step, so the local files and the
backend hold the same numbers: the scalars in ``metrics.jsonl``, the histograms in ``histograms.jsonl`` (bin
edges and counts, as W&B stores them). ``wandb`` and ``tensorboard`` are imported only by their sinks, only
when they are used.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import logging
import math
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import orjson

from hookexp.errors import ConfigError, MissingExtraError, RunFilesError

log = logging.getLogger("hookexp.sinks")

STEP_KEY = "trainer/step"
Histograms = Mapping[str, tuple[Any, Any]]  # key -> (counts, bin edges): float lists or 1-d float64 arrays


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf": JSON has no literal for them
    return value


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


class Sink(Protocol):
    """Where a run's records go. The trainer hands every sink the same values in the same order: on a log step
    ``log_histograms`` (when there are histograms) and then ``log`` for the same step; ``spike`` for each spike the
    spike recorder found (:mod:`hookexp.telemetry.spike`); ``image`` for a plot written at the end; ``finish``
    once, last. ``resume_state`` is kept in each checkpoint and handed back to the sink of a run resumed from it
    (:class:`RunInfo`, ``resume``): W&B's run id, so that the resumed run continues the same W&B run. Local files
    (:class:`LocalFiles`) are always written; ``logger._target_`` adds one backend (:func:`make_backend`)."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def log_histograms(self, histograms: Histograms, step: int) -> None: ...

    def spike(self, row: Mapping[str, Any]) -> None: ...

    def image(self, key: str, path: Path, step: int) -> None: ...

    def resume_state(self) -> dict[str, Any]: ...

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None: ...


@dataclass(frozen=True)
class RunInfo:
    """What a backend is given besides its own ``logger`` keys: the run directory, the config as run (resolved,
    the model's arguments as built), the hooks table, and for a resumed run the step it resumes from and what
    this backend's :meth:`Sink.resume_state` returned when the checkpoint was written (None: a new run, or a
    checkpoint written with another backend)."""

    run_dir: Path
    config: dict[str, Any] = field(default_factory=dict)
    hooks_table: list[dict[str, Any]] = field(default_factory=list)
    resumed_step: int | None = None
    resume: dict[str, Any] | None = None


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


def backend_class(cfg: Mapping[str, Any]) -> type | None:
    """The class ``logger._target_`` names (None: ``logger=none``), or a :class:`ConfigError` naming the key."""
    target = cfg.get("_target_")
    if target is None:
        return None
    from hydra.utils import get_class

    try:
        return get_class(str(target))
    except Exception as e:  # Hydra raises ImportError or ValueError, with its own long message
        if isinstance(e, MissingExtraError):
            raise
        raise ConfigError(f"cannot import the logger backend {target!r} ({str(e).splitlines()[0]}). Use logger=wandb, "
                          "logger=tensorboard or logger=none, or the import path of a class that implements "
                          "hookexp.sinks.Sink (local files are always written).", key="logger._target_") from None


def check_logger(cfg: Mapping[str, Any]) -> None:
    """Refuse an unknown backend or mode, or a backend whose package is missing, before anything is built or
    written."""
    backend = backend_class(cfg)
    if cfg.get("mode") not in ("offline", "online", "disabled"):
        raise ConfigError(f"unknown W&B mode {cfg.get('mode')!r}. Use offline, online or disabled.",
                          key="logger.mode")
    env = os.environ.get("WANDB_MODE")
    if backend is WandbSink and env is not None and env not in ("offline", "online", "disabled", "dryrun", "run"):
        raise ConfigError(f"the environment sets WANDB_MODE={env!r}, which W&B refuses (and which would override "
                          f"logger.mode={cfg.get('mode')}). Unset it (`unset WANDB_MODE`) or set it to offline, online "
                          "or disabled.", key="WANDB_MODE")
    if backend is not None and callable(getattr(backend, "check", None)):
        backend.check()


def make_backend(cfg: Mapping[str, Any], run: RunInfo) -> Sink | None:
    """The sink ``logger._target_`` names, made the way Hydra instantiates a ``_target_`` node: the class gets
    ``run`` and those ``logger`` keys its constructor names (the schema holds W&B's keys for every backend; a
    backend that does not name them does not get them). None for ``logger=none``."""
    backend = backend_class(cfg)
    if backend is None:
        return None
    params = inspect.signature(backend).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    args = {k: v for k, v in cfg.items() if k != "_target_" and (takes_any or k in params)}
    return backend(run, **args)  # type: ignore[no-any-return]


def wandb_mode(mode: str) -> str:
    """The W&B mode a run uses: ``WANDB_MODE`` in the environment wins over ``logger.mode``, as W&B users expect
    (CI switches W&B off with ``WANDB_MODE=disabled``); W&B's old names ``dryrun`` and ``run`` are offline and
    online. :func:`check_logger` has refused any other value."""
    env = os.environ.get("WANDB_MODE")
    return str(mode) if env is None else {"dryrun": "offline", "run": "online"}.get(env, env)


class WandbSink:
    """One W&B run per job (``logger=wandb``). ``mode=offline`` writes it under ``<run_dir>/wandb``; an unreachable
    server in ``online`` mode falls back to offline with one warning instead of killing training; ``disabled``
    (or ``WANDB_MODE=disabled``): this sink does nothing and W&B is not imported. The arguments are the
    ``logger`` keys; the W&B tags are ``tags`` and the names of the enabled hook specs.

    ``run.log`` costs milliseconds of Python for a log step with many keys, so it runs on one worker
    thread that consumes an ordered queue (while the training thread is inside torch's kernels,
    which release the GIL). ``finish`` drains the queue first; a failure in the worker is reported
    once as a warning and never stops training (the local files hold the same numbers). The queue is
    bounded (``QUEUE_SIZE`` log steps): if W&B falls behind, training waits rather than memory grows.
    A step's histograms wait for its scalars: they are one W&B history row, as in the local files' step.
    """

    QUEUE_SIZE = 32

    def __init__(self, run: RunInfo, *, mode: str = "offline", project: str | None = "hookexp",
                 entity: str | None = None, group: str | None = None, job_type: str | None = "train",
                 name: str | None = None, tags: Sequence[str] = (), init_timeout: float = 30.0, quiet: bool = True):
        self.run: Any = None
        self._hists: tuple[int, dict[str, Any]] | None = None
        self._error: BaseException | None = None
        resolved = wandb_mode(mode)
        if resolved != mode:
            log.info("W&B mode %s, from WANDB_MODE in the environment (it wins over logger.mode=%s)", resolved, mode)
        if resolved == "disabled":
            return
        import wandb

        self._wandb = wandb
        run_dir = run.run_dir
        tags = [*tags, *(row["spec"] for row in run.hooks_table if row["enabled"])]
        kwargs = dict(project=project or "hookexp", entity=entity, group=group, job_type=job_type, name=name,
                      tags=tags, config=run.config, dir=str(run_dir), reinit="finish_previous")
        if run.resume and run.resume.get("id"):  # a resumed run continues its W&B run
            kwargs.update(id=run.resume["id"], resume="allow")
        timeout = float(init_timeout)
        if resolved == "online":
            base_url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
            if not _answers(base_url, timeout):  # never start an online run that would hang init and the exit
                log.warning("the W&B server %s did not answer within logger.init_timeout=%g s; logging offline under "
                            "%s/wandb instead. Upload later with `wandb sync`.", base_url, timeout, run_dir)
                resolved = "offline"
                # W&B's own telemetry exporter would wait on the same server at exit (~10 s with wandb 0.31)
                os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        # quiet: W&B's ~30 lines of history and summary at the end would bury hookexp's own summary line
        settings = wandb.Settings(init_timeout=timeout, quiet=bool(quiet))
        try:
            self.run = wandb.init(mode=resolved, settings=settings, **kwargs)
        except Exception as e:
            if resolved != "online":
                raise
            log.warning("W&B online init failed (%s: %s); logging offline under %s/wandb instead. Upload later with "
                        "`wandb sync`.", type(e).__name__, e, run_dir)
            self.run = wandb.init(mode="offline", settings=settings, **kwargs)
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        if run.hooks_table:
            columns = ["spec", "kind", "transform", "args", "enabled", "targets"]
            rows = [[r["spec"], r["kind"], r["transform"], json.dumps(r["args"]), r["enabled"],
                     ", ".join(r["targets"])] for r in run.hooks_table]
            self.run.log({"hooks/table": wandb.Table(columns=columns, data=rows)}, commit=False)
        # Bounded: when W&B falls behind, training waits for it instead of queueing rows without end.
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=self.QUEUE_SIZE)
        self._worker = threading.Thread(target=self._work, name="hookexp-wandb", daemon=True)
        self._worker.start()

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else str(self.run.id)

    def resume_state(self) -> dict[str, Any]:
        """The W&B run id: a run resumed from this checkpoint continues this W&B run."""
        return {} if self.run is None else {"id": self.run_id}

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

    def _send(self, row: dict[str, Any], hists: Mapping[str, tuple[Any, Any]]) -> None:
        self._queue.put(lambda: self.run.log({**row, **{k: self._histogram(*h) for k, h in hists.items()}}))
        self._check()

    def _send_histograms(self) -> None:
        """Histograms whose step logged no scalars: a row of their own."""
        if self._hists is not None:
            (step, hists), self._hists = self._hists, None
            self._send({STEP_KEY: step}, hists)

    def log_histograms(self, histograms: Histograms, step: int) -> None:
        if self.run is not None:
            self._send_histograms()
            self._hists = (step, dict(histograms))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self.run is None:
            return
        hists: dict[str, Any] = {}
        if self._hists is not None and self._hists[0] == step:
            (_, hists), self._hists = self._hists, None
        self._send_histograms()
        self._send({STEP_KEY: step, **metrics}, hists)

    def _histogram(self, counts: Any, edges: Any) -> Any:
        return self._wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges)))

    def spike(self, row: Mapping[str, Any]) -> None:
        """Nothing: ``spikes.jsonl`` holds the spikes."""

    def image(self, key: str, path: Path, step: int) -> None:
        if self.run is not None:
            self._send_histograms()
            self._queue.put(lambda: self.run.log({STEP_KEY: step, key: self._wandb.Image(str(path))}))

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        if self.run is None:
            return
        self._send_histograms()
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


def _tensorboard_missing(error: BaseException | str = "") -> MissingExtraError:
    return MissingExtraError("logger=tensorboard (hookexp.sinks.TensorBoardSink)", "tensorboard", "tensorboard", error)


class TensorBoardSink:
    """TensorBoard event files under ``<run_dir>/tensorboard`` (``logger=tensorboard``; ``tensorboard --logdir
    <run_dir>``), written by ``torch.utils.tensorboard.SummaryWriter``: every scalar at its ``trainer/step``
    (stored as float64, so that it equals ``metrics.jsonl``'s value), every histogram (``add_histogram_raw``: the
    bin edges as bucket limits after an empty first bucket, as TensorBoard's own histograms; ``sum`` and
    ``sum_squares`` from the bin centres, hookexp counts values only), the hooks table, the config, each spike
    and the summary as text, and the plots as images. A resumed run drops the events written after its
    checkpoint (``purge_step``). Needs the extra ``.[tensorboard]``."""

    def __init__(self, run: RunInfo):
        self.check()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _tensorboard_missing(e) from None
        self.log_dir = run.run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=run.resumed_step)
        if run.hooks_table:
            self.writer.add_text("hooks", hooks_markdown(run.hooks_table), run.resumed_step or 0)
        self.writer.add_text("config", _code_block(run.config), run.resumed_step or 0)

    @staticmethod
    def check() -> None:
        """A :class:`MissingExtraError` naming the extra when the ``tensorboard`` package is not installed."""
        from importlib.util import find_spec

        try:
            found = find_spec("tensorboard") is not None
        except (ImportError, ValueError):  # None in sys.modules: a module that failed to import
            found = False
        if not found:
            raise _tensorboard_missing()

    def resume_state(self) -> dict[str, Any]:
        return {}

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
                self.writer.add_scalar(key, float(value), step, new_style=True, double_precision=True)

    def log_histograms(self, histograms: Histograms, step: int) -> None:
        for key, (counts, edges) in histograms.items():
            counts, edges = np.asarray(counts, dtype=np.float64), np.asarray(edges, dtype=np.float64)
            centres = (edges[:-1] + edges[1:]) / 2
            self.writer.add_histogram_raw(key, min=float(edges[0]), max=float(edges[-1]), num=float(counts.sum()),
                                          sum=float(counts @ centres), sum_squares=float(counts @ centres ** 2),
                                          bucket_limits=edges.tolist(), bucket_counts=[0.0, *counts.tolist()],
                                          global_step=step)

    def spike(self, row: Mapping[str, Any]) -> None:
        self.writer.add_text("spikes", _code_block(dict(row)), int(row.get(STEP_KEY, 0)))
        self.writer.flush()

    def image(self, key: str, path: Path, step: int) -> None:
        try:
            from matplotlib.image import imread

            self.writer.add_image(key, imread(str(path)), step, dataformats="HWC")
        except Exception as e:  # a plot that does not show in TensorBoard never fails the run
            log.warning("TensorBoard: could not add the image %s (%s: %s)", path, type(e).__name__, e)

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        try:
            self.writer.add_text("summary", _code_block({k: _jsonable(v) for k, v in summary.items()}),
                                 int(summary.get("trainer/steps", 0) or 0))
        finally:
            self.writer.close()


def _code_block(data: Any) -> str:
    """``data`` as indented JSON in a Markdown code block (TensorBoard renders text as Markdown)."""
    text = json.dumps(data, indent=2, default=str)
    return "\n".join("    " + line for line in text.splitlines())


def hooks_markdown(table: Sequence[Mapping[str, Any]]) -> str:
    """The hooks table (:meth:`hookexp.engine.HookHandle.table`) as a Markdown table."""
    columns = ["spec", "kind", "transform", "args", "enabled", "targets"]

    def cell(row: Mapping[str, Any], column: str) -> str:
        value = row[column]
        text = ", ".join(value) if column == "targets" else json.dumps(value) if column == "args" else str(value)
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row, c) for c in columns) + " |" for row in table]
    return "\n".join(lines)


class NullSinks:
    """What ranks other than 0 log to: nothing."""

    def log(self, metrics: Mapping[str, Any], step: int, histograms: Histograms | None = None) -> None:
        pass

    def log_histograms(self, histograms: Histograms, step: int) -> None:
        pass

    def spike(self, row: Mapping[str, Any]) -> None:
        pass

    def image(self, key: str, path: Path, step: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        pass


class Sinks:
    """Fan-out to the local files and the backends (by their ``logger._target_``), in that order. ``log`` also
    takes the step's histograms (each sink gets them first, through ``log_histograms``). A sink that fails to
    finish does not stop the others; the first failure is raised once all have finished. :meth:`state_dict` is
    what a checkpoint keeps of the backends: their :meth:`Sink.resume_state` by ``_target_``."""

    def __init__(self, local: LocalFiles, backends: Mapping[str, Sink] | None = None):
        self.local = local
        self.backends = dict(backends or {})
        self.sinks: list[Sink] = [local, *self.backends.values()]

    def log(self, metrics: Mapping[str, Any], step: int, histograms: Histograms | None = None) -> None:
        if histograms:
            self.log_histograms(histograms, step)
        for sink in self.sinks:
            sink.log(metrics, step)

    def log_histograms(self, histograms: Histograms, step: int) -> None:
        for sink in self.sinks:
            sink.log_histograms(histograms, step)

    def spike(self, row: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.spike(row)

    def image(self, key: str, path: Path, step: int) -> None:
        for sink in self.sinks:
            sink.image(key, path, step)

    def state_dict(self) -> dict[str, Any]:
        return {target: getattr(sink, "resume_state", dict)() for target, sink in self.backends.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing: a backend is given its kept state when it is made (:class:`RunInfo`, ``resume``)."""

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        errors: list[BaseException] = []
        for sink in self.sinks:
            try:
                sink.finish(summary, failed)
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]
