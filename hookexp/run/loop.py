"""A run, wired: :func:`run_job` sets up the ranks, the checkpoint and the parts, then hands them to the
:class:`~hookexp.run.trainer.Trainer` (the step, the log step, validation, checkpoints, shutdown).
:func:`dry_run` checks the hooks on one batch and trains nothing.

Building (seed, device, data, model, task, optimizer, schedule) is :mod:`hookexp.run.build`; saving and
restoring the loop state is :mod:`hookexp.run.checkpoint`; what gets measured is :mod:`hookexp.telemetry.assemble`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from hookexp.engine import check_on_batch
from hookexp.errors import ConfigError, HookCheckError
from hookexp.run import distributed
from hookexp.run.build import Parts, build, pick_device
from hookexp.run.checkpoint import Checkpointer, require_writable
from hookexp.run.loaders import no_batch, to_device
from hookexp.run.rundir import CLI, Launch
from hookexp.run.sinks import check_logger, write_json_atomic
from hookexp.run.trainer import Trainer, hook_specs, summarize

__all__ = ["Trainer", "check_hooks", "dry_run", "hook_specs", "preflight", "run_job", "summarize"]


def run_job(cfg: DictConfig, run_dir: Path, overrides: list[str] | None = None, *, launch: Launch = CLI
            ) -> dict[str, Any]:
    """Run the job ``cfg`` describes into ``run_dir``; returns the summary (final and best metrics). ``launch``:
    how it was started (the command line, or :func:`hookexp.run.train`), for the fixes its errors name."""
    started = time.perf_counter()
    check_logger(cfg.logger)
    device = pick_device(cfg.trainer.device)
    distributed.refuse_kinds(hook_specs(cfg), cfg.trainer.strategy)
    ranks = distributed.setup(device, cfg.trainer.strategy)
    with distributed.released_on_error(ranks):  # a failure before training leaves no process group behind
        device = ranks.place(device)
        run_dir = ranks.broadcast(run_dir)  # rank 0's (each rank's Hydra may have named its own timestamped one)
        ckpt = Checkpointer(run_dir, OmegaConf.to_container(cfg, resolve=True), cfg.resume, ranks=ranks,
                            launch=launch)
        resumed = ckpt.load()  # a bad checkpoint fails before anything is built or written
        if ranks.is_main:
            require_writable(run_dir)
            ckpt.clean()
        parts = build(cfg, ranks, device, overrides)  # FSDP shards here
        if resumed is not None and (done := finished_at(run_dir, int(resumed["loop"]["step"]), parts.total_steps)):
            return done
        preflight(parts)
        ckpt.track(model=parts.model, optimizer=parts.optimizer)
        if resumed is not None:  # the weights before the hooks attach (see Checkpointer.restore_weights)
            ckpt.restore_weights(resumed)
        trainer = Trainer(cfg, parts, ckpt, resumed, started)
    if ranks.is_main:  # now certain to exist and to stay: a failure before here removes it
        logging.getLogger("hookexp").info("run directory: %s", run_dir)
    return trainer.fit()


def finished_at(run_dir: Path, step: int, total: int) -> dict[str, Any] | None:
    """A resumed run whose checkpoint is its finished end, asked for no more steps: its summary, untouched (and
    "nothing to do" logged); None when there is something to do."""
    path = run_dir / "summary.json"
    if step < total or not path.is_file():
        return None
    summary = json.loads(path.read_text())
    if summary.get("status") != "finished" or summary.get("trainer/steps") != step:
        return None
    logging.getLogger("hookexp").info("nothing to do: the run in %s finished at step %d; raise trainer.max_steps "
                                      "to continue", run_dir, step)
    return {**summary, "nothing_to_do": True}


@torch.no_grad()
def preflight(parts: Parts) -> None:
    """The task on one training batch (eval mode, no grad, no hooks: nothing changes, no random draw), so that a
    model and data the task cannot use (no logits, missing labels, wrong shapes) fail before the run starts."""
    parts.model.eval()
    try:
        batch = next(parts.loaders.epoch(0), None)
        if batch is None:
            raise no_batch()
        batch = to_device(batch, parts.device)
        try:
            output = parts.task.forward(parts.model, batch)
        except TypeError as e:  # the model's own forward cannot take what the batch gives it (not one inside it)
            if f"{getattr(type(parts.model).forward, '__qualname__', '?')}()" not in str(e):
                raise
            given = (f"a mapping with keys {sorted(batch)}" if isinstance(batch, Mapping) else
                     f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else
                     type(batch).__name__)
            raise ConfigError(f"the model cannot take a training batch: {e}. The batch is {given}: a mapping's entries "
                              "go to forward's parameters of the same names, a tuple's elements but the last "
                              "(the target) go positionally. Name the data's keys after forward's parameters, "
                              "return (inputs, target) pairs, or say which entry goes to which parameter: "
                              "task.inputs={idx: input_ids}.", key="data.dataset") from None
        parts.task.sums(output, batch, parts.task.loss(output, batch))
    finally:
        parts.model.train()


def check_hooks(parts: Parts, specs: Any) -> Any:
    """The hooks checked on the first training batch, through the task's own forward and loss."""
    batch = to_device(next(parts.loaders.epoch(0)), parts.device)
    task = parts.task
    return check_on_batch(parts.model, specs, batch, parts.optimizer, forward=lambda model, b: task.forward(model, b),
                    loss_fn=lambda output, b: task.loss(output, b))


def dry_run(cfg: DictConfig, run_dir: Path, overrides: list[str] | None = None) -> None:
    """``+dry_run=true``: check the hooks on one training batch, print the table, train nothing.

    Writes ``dry_run.json`` (the table and errors); a failed check raises :class:`HookCheckError`."""
    device = pick_device(cfg.trainer.device)
    distributed.refuse_kinds(hook_specs(cfg), cfg.trainer.strategy)  # what training would refuse (one process here)
    report = check_hooks(build(cfg, distributed.Dist(), device, overrides), hook_specs(cfg))
    print(report.render(), flush=True)
    require_writable(run_dir)
    write_json_atomic(run_dir / "dry_run.json", {"ok": report.ok, "hooks": report.rows, "errors": report.errors})
    if not report.ok:
        raise HookCheckError(f"the dry run found {len(report.errors)} error(s): {report.errors[0]}")
