"""Checkpoints: the whole state of a run, written so that nothing earlier is ever lost.

:class:`Checkpointer` owns what goes into a checkpoint (everything with a ``state_dict``: model, optimizer,
schedule, scaler, hooks, telemetry, local files, records, random generators, the W&B run id) and how a run
resumes. A checkpoint is written atomically and only from a finite state, and read back with every CRC and
entry checked by ``torch.load(weights_only=True)``; under FSDP it is a directory every rank writes its shards
into. docs/runs.md and docs/scale.md have the rules and formats. Modules: ``checkpointer``, ``state``
(:class:`LoopState`), ``rng``, ``config_diff`` (:func:`config_changes`), ``files`` (the one-file format),
``sharded`` (FSDP), ``signals`` (SIGTERM/SIGINT) and ``writable``.
"""

from __future__ import annotations

from hookexp.run.checkpoint.checkpointer import Checkpointer, finite_parameters
from hookexp.run.checkpoint.config_diff import config_changes
from hookexp.run.checkpoint.files import (
           FORMAT,
           REQUIRED_ENTRIES,
           WEIGHTS,
           atomic_save,
           fsync_dir,
           read_checked,
           save_to,
)
from hookexp.run.checkpoint.rng import rng_state, set_rng_state
from hookexp.run.checkpoint.sharded import SHARDED_REQUIRED
from hookexp.run.checkpoint.state import LoopState, Stateful
from hookexp.run.checkpoint.writable import require_writable

__all__ = ["FORMAT", "REQUIRED_ENTRIES", "SHARDED_REQUIRED", "WEIGHTS", "Checkpointer", "LoopState", "Stateful",
           "atomic_save", "config_changes", "finite_parameters", "fsync_dir", "read_checked", "require_writable",
           "rng_state", "save_to", "set_rng_state"]
