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

Modules, one concern each: :mod:`~hookexp.run.checkpoint.checkpointer` (:class:`Checkpointer`),
:mod:`~hookexp.run.checkpoint.state` (:class:`LoopState`), :mod:`~hookexp.run.checkpoint.rng` (random generators),
:mod:`~hookexp.run.checkpoint.config_diff` (:func:`config_changes`), :mod:`~hookexp.run.checkpoint.files` (the
one-file format, atomic writes, CRC checks), :mod:`~hookexp.run.checkpoint.sharded` (the FSDP format),
:mod:`~hookexp.run.checkpoint.signals` (SIGTERM/SIGINT) and :mod:`~hookexp.run.checkpoint.writable`
(:func:`require_writable`).
"""

from __future__ import annotations

from hookexp.run.checkpoint.checkpointer import Checkpointer, finite_parameters
from hookexp.run.checkpoint.config_diff import config_changes
from hookexp.run.checkpoint.files import FORMAT, REQUIRED, WEIGHTS, atomic_save, fsync_dir, read_checked, save_to
from hookexp.run.checkpoint.rng import rng_state, set_rng_state
from hookexp.run.checkpoint.sharded import SHARDED_REQUIRED
from hookexp.run.checkpoint.state import LoopState, Stateful
from hookexp.run.checkpoint.writable import require_writable

__all__ = ["FORMAT", "REQUIRED", "SHARDED_REQUIRED", "WEIGHTS", "Checkpointer", "LoopState", "Stateful",
           "atomic_save", "config_changes", "finite_parameters", "fsync_dir", "read_checked", "require_writable",
           "rng_state", "save_to", "set_rng_state"]
