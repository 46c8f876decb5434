"""Where metrics go: always local files in the run directory, and W&B when configured.

Every sink gets the same dict for the same step, so the local files and the W&B history hold the
same numbers: the scalars in ``metrics.jsonl``, the histograms in ``histograms.jsonl`` (bin edges and
counts, as W&B stores them). ``wandb`` is imported only by :class:`WandbSink`, only when it is used.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from hookexp.errors import ConfigError

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
    return len(path.read_text(encoding="utf-8").splitlines()) if path.exists() else 0


class LocalFiles:
    """The run directory's own record: ``metrics.jsonl`` (one line of scalars per log step),
    ``histograms.jsonl`` (one line per log step that has histograms: ``{"trainer/step": s, key:
    {"bins": edges, "values": counts}}``, W&B's own shape) and, at the end, ``summary.json``.

    Lines reach the disk at least every ``FLUSH_S`` seconds, at every checkpoint and at the end: a
    flush per line cost more than the statistics on a small model. :attr:`lines` counts each file's
    lines, so that a checkpoint can say which of them a resumed run keeps (:meth:`keep`).
    """

    FLUSH_S = 1.0  # at most this long between a line and the disk (and at every close)
    # bytes per file held before a write to the disk (flushed sooner by FLUSH_S): many lines, where Python's default
    # 8 kB is less than one histogram line of a small CNN, which made every log step a write syscall
    BUFFER = 1 << 20
    FILES = ("metrics.jsonl", "histograms.jsonl")

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.histograms_path = run_dir / "histograms.jsonl"
        self.lines = {name: _count_lines(run_dir / name) for name in self.FILES}
        self._metrics = self.metrics_path.open("ab", buffering=self.BUFFER)  # UTF-8 bytes, as orjson writes them
        self._histograms: Any = None  # opened by the first histogram: runs without any have no such file
        self._flushed = time.monotonic()

    @classmethod
    def keep(cls, source: Path, run_dir: Path, lines: Mapping[str, int]) -> None:
        """Write into ``run_dir`` the first ``lines[name]`` lines of each file in ``source`` (a resumed
        run keeps exactly what was written before its checkpoint; a file not counted keeps none)."""
        for name in cls.FILES:
            previous = source / name
            kept = previous.read_text(encoding="utf-8").splitlines(keepends=True) if previous.exists() else []
            kept = kept[:lines.get(name, 0)]
            if kept or (run_dir / name).exists():
                (run_dir / name).write_text("".join(kept), encoding="utf-8")

    def log(self, metrics: Mapping[str, Any], step: int, histograms: Histograms | None = None) -> None:
        self._metrics.write(_dumps({STEP_KEY: step, **metrics}) + b"\n")
        self.lines["metrics.jsonl"] += 1
        if histograms:
            if self._histograms is None:
                self._histograms = self.histograms_path.open("ab", buffering=self.BUFFER)
            row = {STEP_KEY: step, **{k: {"bins": edges, "values": counts}
                                      for k, (counts, edges) in histograms.items()}}
            self._histograms.write(_dumps(row) + b"\n")
            self.lines["histograms.jsonl"] += 1
        now = time.monotonic()
        if now - self._flushed >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        for f in (self._metrics, self._histograms):
            if f is not None and not f.closed:
                f.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        for f in (self._metrics, self._histograms):
            if f is not None and not f.closed:
                f.close()

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        self.close()
        data = {k: _jsonable(v) for k, v in summary.items()}
        (self.run_dir / "summary.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def check_logger(cfg: Mapping[str, Any]) -> None:
    """Refuse an unknown backend or mode before anything is built or written."""
    if cfg.get("backend") not in ("wandb", "none"):
        raise ConfigError(f"unknown logger backend {cfg.get('backend')!r}. Use wandb or none (local files are "
                          "always written).", key="logger.backend")
    if cfg.get("mode") not in ("offline", "online", "disabled"):
        raise ConfigError(f"unknown W&B mode {cfg.get('mode')!r}. Use offline, online or disabled.",
                          key="logger.mode")


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
        mode = cfg.get("mode", "offline")
        try:
            settings = wandb.Settings(init_timeout=float(cfg.get("init_timeout", 30.0)))
            self.run = wandb.init(mode=mode, settings=settings, **kwargs)
        except Exception as e:
            if mode != "online":
                raise
            warnings.warn(f"W&B online init failed ({type(e).__name__}: {e}); logging offline under {run_dir}/wandb "
                          "instead. Upload later with `wandb sync`.", RuntimeWarning, stacklevel=2)
            self.run = wandb.init(mode="offline", **kwargs)
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
            warnings.warn(f"W&B logging failed ({type(self._error).__name__}: {self._error}); the run continues "
                          "and the local files (metrics.jsonl, histograms.jsonl) hold every value.", RuntimeWarning,
                          stacklevel=3)

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


class NullSinks:
    """What ranks other than 0 log to: nothing."""

    def log(self, metrics: Mapping[str, Any], step: int, histograms: Histograms | None = None) -> None:
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

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        try:
            self.local.finish(summary, failed)
        finally:
            if self.wandb is not None:
                self.wandb.finish(summary, failed)
