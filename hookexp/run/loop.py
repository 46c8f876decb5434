"""The training loop. Read it top to bottom: :func:`train` is a whole run.

Building (seed, device, data, model, task, optimizer, schedule) is :mod:`hookexp.run.build`; saving and
restoring the loop state is :mod:`hookexp.run.checkpoint`; what gets measured and read back is
:mod:`hookexp.run.telemetry`. Costs: a step that does not log does a forward, a backward and an update,
plus one on-device add of the task's metric sums; a log step (every ``stats.every`` steps, and the last)
adds the statistics and one device-to-host copy. ``trainer/step`` in every record is the 0-based index of
the optimizer step whose gradients are described; validation runs after that step's update.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from hookexp.engine import HookHandle, attach, validate
from hookexp.engine.validate import hooks_summary
from hookexp.errors import ConfigError, HookCheckError
from hookexp.goals import lower_is_better
from hookexp.plots import plot_grad_norms
from hookexp.run import distributed
from hookexp.run.build import MixedPrecision, Parts, build, pick_device
from hookexp.run.checkpoint import Checkpointer, LoopState, require_writable
from hookexp.run.loaders import to_device
from hookexp.run.manifest import run_config, write_manifest
from hookexp.run.records import Records
from hookexp.run.rundir import CLI, Launch
from hookexp.run.telemetry import Telemetry
from hookexp.sinks import LocalFiles, NullSinks, RunInfo, Sinks, check_logger, make_backend, write_json_atomic

log = logging.getLogger("hookexp.train")


@contextlib.contextmanager
def explaining(hooks: HookHandle) -> Any:
    """torch's errors around the hooks (an in-place op next to a full backward hook, a transform that cut the
    graph) as errors naming the spec."""
    try:
        yield
    except RuntimeError as e:
        better = hooks.explain(e)
        if better is None:
            raise
        raise better from e


def hook_specs(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg.hooks, resolve=True)  # type: ignore[return-value]


def train(cfg: DictConfig, run_dir: Path, overrides: list[str] | None = None, *, launch: Launch = CLI
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
        main = ranks.is_main  # only rank 0 writes files and logs
        run_dir = ranks.broadcast(run_dir)  # rank 0's (each rank's Hydra may have named its own timestamped one)
        ckpt = Checkpointer(run_dir, OmegaConf.to_container(cfg, resolve=True), cfg.resume, main=main, ranks=ranks,
                            launch=launch)
        resumed = ckpt.load()  # a bad checkpoint fails before anything is built or written
        if main:
            require_writable(run_dir)
            ckpt.clean()

        # -- build (FSDP shards here); then hooks and probes, attached before wrapping and compiling (targets keep
        # their names); the weights of a resumed run are loaded before them (see Checkpointer.restore_weights) ----
        parts = build(cfg, ranks, device, overrides)
        model, optimizer, task = parts.model, parts.optimizer, parts.task
        preflight(parts)
        ckpt.track(model=model, optimizer=optimizer)
        if resumed is not None:
            ckpt.restore_weights(resumed)
        hooks = attach(model, hook_specs(cfg), optimizer, measure=False)
        telemetry: Telemetry | None = None
        try:
            amp = MixedPrecision(cfg.trainer.precision, device, hooks)
            telemetry = Telemetry(model, optimizer, hooks, task, cfg.stats, cfg.guard, device, ranks,
                                  grads_scaled=amp.scaler is not None, clip_grad_norm=cfg.trainer.clip_grad_norm)
            forward = distributed.wrap(model, cfg.trainer, ranks, device)
            records = Records(hooks, run_dir, enabled=main and cfg.trainer.save_records)
            local = LocalFiles(run_dir) if main else None
            ckpt.track(scheduler=parts.scheduler, scaler=amp, hooks=hooks, telemetry=telemetry, files=local,
                       records=records)
            loop = ckpt.restore(resumed) if resumed is not None else LoopState()
            config = run_config(cfg, parts.model_config)
            if main:
                write_manifest(run_dir, config, hooks.table(), cfg.seed, parts.ranks.world_size,
                               int(resumed["loop"]["step"]) if resumed is not None else None)
            sinks = make_sinks(cfg, run_dir, config, hooks, local, resumed)
            ckpt.track(sinks=sinks)  # after the restore: what the backends keep is read by make_sinks
            if main and hooks.table():
                log.info("hooks:\n%s", hooks_summary(hooks.table()))
        except BaseException:
            hooks.remove()
            if telemetry is not None:
                telemetry.close()
            raise

    total = parts.total_steps
    status, summary = "failed", {}
    with ckpt.signals():
        try:
            status = loop_over_steps(cfg, parts, forward, hooks, amp, telemetry, ckpt, sinks, loop, total)
        finally:
            summary = shut_down(cfg, run_dir, status, loop, parts, hooks, telemetry, records, local, sinks, ckpt,
                                started)
    return summary


@torch.no_grad()
def preflight(parts: Parts) -> None:
    """The task on one training batch (eval mode, no grad, no hooks: nothing changes, no random draw), so that a
    model and data the task cannot use (no logits, missing labels, wrong shapes) fail before the run starts."""
    parts.model.eval()
    try:
        batch = next(parts.loaders.epoch(0), None)
        if batch is None:
            raise ConfigError("the training set gave no batch in a whole epoch (an empty data set, or an iterable "
                              "one that yields nothing). Check the data factory.", key="data.dataset")
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


def loop_over_steps(cfg: DictConfig, parts: Parts, forward: torch.nn.Module, hooks: HookHandle,
                    amp: MixedPrecision, telemetry: Telemetry, ckpt: Checkpointer, sinks: Any, loop: LoopState,
                    total: int) -> str:
    """Train from ``loop``'s position to ``total`` steps; returns "finished" or "interrupted"."""
    model, optimizer, task, device = parts.model, parts.optimizer, parts.task, parts.device
    per_epoch = parts.loaders.batches_per_epoch()
    accumulate, eval_every = parts.accumulate, cfg.trainer.eval_every
    eval_epochs = cfg.trainer.eval_every_epochs  # 0: never at an epoch's end (full-batch runs: one step an epoch)
    goal = parts.goal
    reached = None  # the step at which a logged value met trainer.stop_when
    checkpoint_every = cfg.trainer.checkpoint_every
    bar = tqdm(total=total, initial=loop.step, disable=not cfg.trainer.progress, desc="train", unit="step",
               leave=False)
    batches, last_log_time = None, time.perf_counter()
    period: list[dict[str, Any]] = []  # the steps since the last log step and their batches (for spikes.jsonl)
    model.train()
    while loop.step < total:
        step_started = time.perf_counter()
        if batches is None:  # this epoch's batches, from the loop's position in it (a resumed run starts mid-epoch)
            batches = parts.loaders.epoch(loop.epoch, loop.batch)
        log_now = telemetry.log_step(loop.step, total - 1)
        telemetry.start_step(log_now)
        first_batch, spike = loop.batch, None
        optimizer.zero_grad(set_to_none=True)
        # gradient accumulation: the epoch's last step takes the micro-batches that are left
        micro = accumulate if per_epoch is None else min(accumulate, per_epoch - loop.batch)
        taken, loss = 0, None
        for i in range(micro):
            batch = next(batches, None)
            if batch is None:  # an iterable data set ran out: the epoch ends here
                break
            batch = to_device(batch, device)
            # DDP all-reduces the gradients on the last micro-batch only
            sync = forward.no_sync() if i < micro - 1 and hasattr(forward, "no_sync") else contextlib.nullcontext()
            with sync, explaining(hooks):
                with amp.autocast():
                    output = task.forward(forward, batch)
                    loss = task.loss(output, batch)
                amp.backward(loss / micro)
            telemetry.add(*task.sums(output, batch, loss))
            taken += 1
        if not taken and not loop.batch:
            raise ConfigError("the training set gave no batch in a whole epoch (an empty data set, or an iterable "
                              "one that yields nothing). Check the data factory.", key="data.dataset")
        loop.batch += taken
        if taken:
            amp.unscale(optimizer)  # pre_step specs, the guard and the statistics see true gradients
            if telemetry.before_update(loss, loop.step):
                amp.step(optimizer)  # runs the pre_step specs, the statistics capture and the clip first
            if parts.scheduler is not None:
                parts.scheduler.step()
            telemetry.set_step(loop.step + 1)  # also when the update was skipped (guard, or fp16 overflow)
            step = loop.step
            loop.step += 1
            bar.update(1)
            period.append({"step": step, "epoch": loop.epoch, "batches": list(range(first_batch, loop.batch))})
            if log_now:
                metrics, histograms = telemetry.read()
                now = time.perf_counter()
                metrics.update(epoch=loop.epoch, **{"perf/step_time": (now - last_log_time) / max(
                    loop.step - loop.last_log_step, 1)})
                sinks.log(metrics, step, histograms)
                if goal is not None and goal.holds(metrics.get(goal.metric, math.nan)):
                    reached = step
                last_log_time, loop.last_log_step = now, loop.step
                spike = telemetry.spiked(metrics, step)
                if spike is not None:
                    log.warning("spike of %s at step %d: %.4g against a median of %.4g; logging every step for %d "
                                "steps", spike.metric, step, spike.value, spike.median, telemetry.spike.steps)
                    sinks.spike(spike.row(period))
                period = []
                if not bar.disable:
                    bar.set_postfix({k.split("/")[1]: f"{v:.4g}" for k, v in metrics.items()
                                     if k.startswith("train/")})
            telemetry.end_step(step)
        loop.train_s += time.perf_counter() - step_started
        epoch_done = (per_epoch is not None and loop.batch >= per_epoch) or taken < micro
        if epoch_done:
            loop.epoch, loop.batch, batches = loop.epoch + 1, 0, None
        epoch_eval = epoch_done and eval_epochs and loop.epoch % eval_epochs == 0
        if taken and (epoch_eval or (eval_every and loop.step % eval_every == 0) or loop.step == total):
            val = evaluate_and_log(forward, parts, amp, sinks, loop)
            if goal is not None and goal.holds(val.get(goal.metric, math.nan)):
                reached = loop.step - 1
        # SIGTERM/SIGINT: under DDP the ranks agree on log steps only, so no other step pays a collective
        stopping = ckpt.stop_requested if not parts.ranks.enabled else (
            log_now and parts.ranks.any(ckpt.stop_requested, device))
        # the last step too, so that a finished run goes on from where it ended (resume=true, a larger max_steps)
        due = checkpoint_every and taken and (loop.step % checkpoint_every == 0 or loop.step == total
                                              or reached is not None)
        if stopping or due or (spike is not None and telemetry.spike.checkpoint):
            save_checkpoint(ckpt, loop, model, telemetry)
        if stopping:
            log.warning("stopped by signal %s after step %d; checkpoint %s", ckpt.signum, loop.step, ckpt.path)
            bar.close()
            return "interrupted"
        if reached is not None:
            log.info("stopped after step %d: %s (trainer.stop_when)", reached, goal)
            parts.limit = f"trainer.stop_when={goal}"  # what ended the run, for the summary and the final line
            break
    bar.close()
    if loop.evaluated != loop.step - 1:  # resumed from the final checkpoint, before its validation ran
        evaluate_and_log(forward, parts, amp, sinks, loop)
    return "finished"


@torch.no_grad()
def evaluate(forward: torch.nn.Module, parts: Parts, amp: MixedPrecision) -> dict[str, float]:
    """The task's metrics over the validation set (summed over ranks), as ``val/<metric>``."""
    batches = parts.loaders.validation()
    if batches is None:
        return {}
    task, device = parts.task, parts.device
    totals = None
    parts.model.eval()
    try:
        for batch in batches:
            batch = to_device(batch, device)
            with amp.autocast():
                output = task.forward(forward, batch)
                loss = task.loss(output, batch)
            sums, count = task.sums(output, batch, loss)
            row = torch.cat([sums.double(), count.double().reshape(1)])
            totals = row if totals is None else totals + row
    finally:
        parts.model.train()
    if totals is None:
        totals = torch.zeros(len(task.metric_names) + 1, dtype=torch.float64, device=device)
    *sums_host, count = parts.ranks.sum(totals).tolist()
    means = {n: s / count if count else math.nan for n, s in zip(task.metric_names, sums_host, strict=True)}
    return {f"val/{k}": v for k, v in task.finish(means).items()}


def evaluate_and_log(forward: torch.nn.Module, parts: Parts, amp: MixedPrecision, sinks: Any, loop: LoopState
                     ) -> dict[str, float]:
    val = evaluate(forward, parts, amp)
    loop.evaluated = loop.step - 1
    if val:
        sinks.log({**val, "epoch": loop.epoch}, loop.step - 1)
    return val


def save_checkpoint(ckpt: Checkpointer, loop: LoopState, model: torch.nn.Module, telemetry: Telemetry) -> None:
    """A checkpoint of the current state, never of a non-finite one: it would replace the last good one."""
    if not ckpt.finite(model):
        telemetry.guard.refuse_checkpoint(loop.step, ckpt.saved_step)
        return
    ckpt.save(loop)


def make_sinks(cfg: DictConfig, run_dir: Path, config: dict[str, Any], hooks: HookHandle, local: LocalFiles | None,
               resumed: dict[str, Any] | None) -> Sinks | NullSinks:
    """The local files and the backend ``logger._target_`` names (rank 0; other ranks log nothing). A resumed run
    hands each backend what it kept in the checkpoint (W&B: its run id)."""
    if local is None:
        return NullSinks()
    target = cfg.logger.get("_target_")
    kept = resumed.get("sinks", {}).get(target) if resumed is not None else None
    run = RunInfo(run_dir, config, hooks.table(), int(resumed["loop"]["step"]) if resumed is not None else None,
                  kept)
    backend = make_backend(cfg.logger, run)
    return Sinks(local, {target: backend} if backend is not None else None)


def summarize(metrics_path: Path) -> dict[str, Any]:
    """Every key's last value in ``metrics.jsonl``, and ``val/<metric>_best`` (lowest for losses): the summary
    always says what the file says, also after a resume."""
    last: dict[str, Any] = {}
    best: dict[str, float] = {}
    if metrics_path.exists():
        for line in metrics_path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            last.update(row)
            for key, value in row.items():
                if key.startswith("val/") and isinstance(value, (int, float)) and math.isfinite(value):
                    lower = lower_is_better(key)
                    if key not in best or (value < best[key] if lower else value > best[key]):
                        best[key] = value
    last.pop("trainer/step", None)
    return {**last, **{f"{k}_best": v for k, v in best.items()}}


def shut_down(cfg: DictConfig, run_dir: Path, status: str, loop: LoopState, parts: Parts, hooks: HookHandle,
              telemetry: Telemetry, records: Records, local: LocalFiles | None, sinks: Any, ckpt: Checkpointer,
              started: float) -> dict[str, Any]:
    """One cleanup path, run with signals held (see Checkpointer.signals): records, files, plot, summary, W&B.

    Each part runs even when one before it failed; the first failure is raised at the end unless an error
    from the loop is already on its way."""
    failures: list[BaseException] = []

    def attempt(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except BaseException as e:
            failures.append(e)
            return None

    telemetry.close()
    kept = len(failures)
    attempt(records.save)
    calls = {f"hook/{name}/calls": row["calls"] for name, row in hooks.stats(reset=False).items()}
    hooks.remove()
    if local is not None:
        attempt(local.close)
    if len(failures) > kept:  # the run's own files are incomplete: it did not finish, whatever the loop said
        status = "failed"
    summary = summarize(run_dir / "metrics.jsonl") if local is not None else {}
    summary.update({
        "status": status, "signal": ckpt.signum, "trainer/steps": loop.step, "trainer/epochs": loop.epoch,
        "runtime_s": time.perf_counter() - started, "perf/train_loop_s": loop.train_s,
        "run_dir": str(run_dir), **telemetry.summary(), **calls,
    })
    if status == "finished":
        summary["trainer/stopped_by"] = parts.limit  # the limit that ended the run, e.g. trainer.max_steps=4000
    if parts.ranks.enabled and status != "failed":
        summary.update({"dist/world_size": parts.ranks.world_size, "dist/strategy": parts.ranks.strategy})
        if not parts.ranks.sharded:  # replicas: they must hold the same parameters (FSDP's ranks hold shards)
            summary["dist/params_in_sync"] = parts.ranks.params_in_sync(parts.model)
    if local is not None:
        plot = attempt(plot_grad_norms, local.metrics_path, run_dir / "plots" / "grad_norms.png")
        if plot is not None:
            attempt(sinks.image, "plots/grad_norms", plot, max(loop.step - 1, 0))
    summary["signal"] = ckpt.signum  # also one that came during this shutdown (it did not cut it)
    attempt(sinks.finish, summary, status == "failed")
    attempt(distributed.teardown, parts.ranks, status != "failed")  # after a failure: no barrier (a rank may be gone)
    if failures and sys.exc_info()[1] is None:
        raise failures[0]
    for e in failures:
        log.warning("during shutdown: %s: %s", type(e).__name__, e)
    return summary


def check_hooks(parts: Parts, specs: Any) -> Any:
    """The hooks checked on the first training batch, through the task's own forward and loss."""
    batch = to_device(next(parts.loaders.epoch(0)), parts.device)
    task = parts.task
    return validate(parts.model, specs, batch, parts.optimizer, forward=lambda model, b: task.forward(model, b),
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
