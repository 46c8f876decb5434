"""``logger=tensorboard``: :class:`TensorBoardSink`, event files under the run directory's ``tensorboard/``
(``torch.utils.tensorboard``, extra ``.[tensorboard]``)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hookexp.errors import MissingExtraError
from hookexp.run.sinks.base import STEP_KEY, Histograms, RunInfo
from hookexp.run.sinks.files import _jsonable, files_error

log = logging.getLogger("hookexp.sinks")


def _tensorboard_missing(error: BaseException | str = "") -> MissingExtraError:
    return MissingExtraError("logger=tensorboard (hookexp.run.sinks.TensorBoardSink)", "tensorboard", "tensorboard",
                             error)


class TensorBoardSink:
    """TensorBoard event files under ``<run_dir>/tensorboard`` (``logger=tensorboard``; ``tensorboard --logdir
    <run_dir>``), written by ``torch.utils.tensorboard.SummaryWriter``: every scalar at its ``trainer/step`` as a
    classic scalar summary (float32, as every TensorBoard reader expects: ``EventAccumulator.Scalars``, tbparse),
    every histogram (``add_histogram_raw``: the
    bin edges as bucket limits after an empty first bucket, as TensorBoard's own histograms; ``sum`` and
    ``sum_squares`` from the bin centres, hookexp counts values only), the hooks table, the config, each spike
    and the summary as text, and the plots as images. A resumed run drops the events written after its
    checkpoint (``purge_step``). A write the disk refuses (full, file size limit) raises the one-paragraph
    :class:`~hookexp.errors.RunFilesError` naming the event file, as ``metrics.jsonl``'s does; the sink then writes
    nothing more and closes quietly. Needs the extra ``.[tensorboard]``."""

    def __init__(self, run: RunInfo):
        self.check()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _tensorboard_missing(e) from None
        self.log_dir = run.run_dir / "tensorboard"
        self.run_dir = run.run_dir
        self.failed: OSError | None = None
        _quiet_writer_threads()
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=run.resumed_step)
        with self.writing():
            if run.hooks_table:
                self.writer.add_text("hooks", hooks_markdown(run.hooks_table), run.resumed_step or 0)
            self.writer.add_text("config", _code_block(run.config), run.resumed_step or 0)

    @contextlib.contextmanager
    def writing(self) -> Iterator[bool]:
        """Around every write: yields whether to write (not after a failed one); an OSError of the writer (raised
        by its thread on the next call) becomes the one paragraph naming the event file."""
        if self.failed is not None:
            yield False
            return
        try:
            yield True
        except OSError as e:
            self.failed = e
            raise files_error(self.event_file(), e, self.run_dir) from None

    def event_file(self) -> Path:
        try:
            return Path(self.writer._get_file_writer().event_writer._file_name)
        except AttributeError:  # another tensorboard release: the folder is name enough
            return self.log_dir

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
        with self.writing() as ok:
            for key, value in metrics.items() if ok else ():
                if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, float(value), step)

    def log_histograms(self, histograms: Histograms, step: int) -> None:
        with self.writing() as ok:
            if ok:
                self._histograms(histograms, step)

    def _histograms(self, histograms: Histograms, step: int) -> None:
        for key, (counts, edges) in histograms.items():
            counts, edges = np.asarray(counts, dtype=np.float64), np.asarray(edges, dtype=np.float64)
            centres = (edges[:-1] + edges[1:]) / 2
            self.writer.add_histogram_raw(key, min=float(edges[0]), max=float(edges[-1]), num=float(counts.sum()),
                                          sum=float(counts @ centres), sum_squares=float(counts @ centres ** 2),
                                          bucket_limits=edges.tolist(), bucket_counts=[0.0, *counts.tolist()],
                                          global_step=step)

    def spike(self, row: Mapping[str, Any]) -> None:
        with self.writing() as ok:
            if ok:
                self.writer.add_text("spikes", _code_block(dict(row)), int(row.get(STEP_KEY, 0)))
                self.writer.flush()

    def image(self, key: str, path: Path, step: int) -> None:
        if self.failed is not None:
            return
        try:
            from matplotlib.image import imread

            self.writer.add_image(key, imread(str(path)), step, dataformats="HWC")
        except Exception as e:  # a plot that does not show in TensorBoard never fails the run
            log.warning("TensorBoard: could not add the image %s (%s: %s)", path, type(e).__name__, e)

    def finish(self, summary: Mapping[str, Any], failed: bool) -> None:
        try:
            with self.writing() as ok:
                if ok:
                    self.writer.add_text("summary", _code_block({k: _jsonable(v) for k, v in summary.items()}),
                                         int(summary.get("trainer/steps", 0) or 0))
        finally:
            if self.failed is not None:
                with contextlib.suppress(OSError):  # its thread raises the failed write again
                    self.writer.close()
            else:
                with self.writing():
                    self.writer.close()


def _quiet_writer_threads() -> None:
    """TensorBoard's event writer thread dies on a failed write (a full disk) and Python prints its traceback; the
    writer raises the same error on its next call, which :meth:`TensorBoardSink.writing` turns into one paragraph.
    So an OSError that ends such a thread is not printed (anything else, and other threads, still are)."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "hookexp_quiet", False):
        return

    def hook(args: Any) -> None:
        writer_thread = type(args.thread).__module__.startswith("tensorboard.summary.writer")
        if not (writer_thread and isinstance(args.exc_value, OSError)):
            previous(args)

    hook.hookexp_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


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
