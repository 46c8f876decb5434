"""Where metrics go: always local files in the run directory, and the backend ``logger._target_`` names
(``logger=wandb``: :class:`WandbSink`, ``logger=tensorboard``: :class:`TensorBoardSink`, ``logger=none``: none).

Every sink implements :class:`Sink` and gets the same dict for the same step; ``wandb`` and ``tensorboard``
are imported only by their sinks, only when used. The modules: docs/internals.md, "Sinks".
"""

from __future__ import annotations

from hookexp.run.sinks.backends import backend_class, check_logger, make_backend
from hookexp.run.sinks.base import STEP_KEY, Histograms, RunInfo, Sink
from hookexp.run.sinks.fanout import NullSinks, Sinks
from hookexp.run.sinks.files import JsonLines, LocalFiles, files_error, free_space, write_json_atomic
from hookexp.run.sinks.tensorboard import TensorBoardSink, hooks_markdown
from hookexp.run.sinks.wandb import WandbSink, wandb_mode

__all__ = ["STEP_KEY", "Histograms", "JsonLines", "LocalFiles", "NullSinks", "RunInfo", "Sink", "Sinks",
           "TensorBoardSink", "WandbSink", "backend_class", "check_logger", "files_error", "free_space",
           "hooks_markdown", "make_backend", "wandb_mode", "write_json_atomic"]
