"""The trainer: a run's step, log step, validation, checkpoints and shutdown. Read :meth:`Trainer.fit` first.

:func:`hookexp.run.loop.run_job` wires a run (ranks, checkpoint, parts) and hands it to a :class:`Trainer`.
Costs: a step that does not log does a forward, a backward and an update, plus one on-device add of the
task's metric sums; a log step (every ``stats.every`` steps, the last, and every step of a spike's window)
adds the statistics and one device-to-host copy. ``trainer/step`` in every record is the 0-based index of
the optimizer step whose gradients are described; validation runs after that step's update.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from hookexp.analysis.plots import plot_grad_norms
from hookexp.config import GuardConfig, StatsConfig, typed
from hookexp.engine import HookHandle, attach
from hookexp.engine.dryrun import hooks_summary
from hookexp.errors import ConfigError
from hookexp.goals import lower_is_better
from hookexp.run import distributed
from hookexp.run.build import Parts
from hookexp.run.checkpoint import Checkpointer, LoopState
from hookexp.run.loaders import no_batch, to_device
from hookexp.run.manifest import build_manifest
from hookexp.run.precision import MixedPrecision
from hookexp.run.records import Records
from hookexp.run.rollback import Rollback
from hookexp.run.sinks import LocalFiles, NullSinks, RunInfo, Sinks, make_backend, write_json_atomic
from hookexp.telemetry.assemble import Wiring, build_observers
from hookexp.telemetry.forensics import draw
from hookexp.telemetry.meter import TrainMeter
from hookexp.telemetry.readback import profiler_range, split_histograms

log = logging.getLogger("hookexp.train")


def hook_specs(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg.hooks, resolve=True)  # type: ignore[return-value]


def compile_failure(e: RuntimeError) -> ConfigError | None:
    """torch.compile's own error (Dynamo tracing the model and its hooks, or the backend compiling) as a paragraph
    naming the setting, or None for any other error."""
    exc = sys.modules.get("torch._dynamo.exc")
    if exc is None or not isinstance(e, exc.TorchDynamoException):
        return None
    text = str(e)
    # Dynamo words a failing op as "... got RuntimeError('a and b must have same reduction dim, ...')"
    found = re.search(r"got (\w+)\((['\"])(.*?)\2\)", text)
    cause = f"{found.group(1)}: {found.group(3)}" if found else (text.strip().splitlines() or [type(e).__name__])[0]
    return ConfigError(f"torch.compile failed on the model and its hooks ({cause.rstrip('.')}). "
                       "A hook spec's transform that fails "
                       "on its target fails here as torch's compile error: run once with trainer.compile=false, and "
                       "hookexp names the spec and the target. Without a C++ compiler, "
                       "trainer.compile_backend=aot_eager compiles no kernels.", key="trainer.compile")


def lands_late(parts: Parts, recorder: Any, rollback: Any) -> bool:
    """Whether a log step's record lands with the next step (no host sync: the GPU never waits for the host's
    decoding and writing): on CUDA, where nothing acts on the values at once (no spike recorder, no
    ``trainer.stop_when``, no rollback)."""
    return parts.device.type == "cuda" and not recorder.enabled and parts.goal is None and not rollback.enabled


class StepResult(NamedTuple):
    """What :meth:`Trainer.train_step` did: micro-batches ``taken`` of those ``asked`` for (fewer: the data ran
    out), and the spike its log step found (None: none, or not a log step)."""

    taken: int
    asked: int
    spike: Any = None


def trainer_observers(cfg: DictConfig, parts: Parts, hooks: HookHandle, scaler: Any = None) -> Any:
    """The run's observers (:func:`hookexp.telemetry.assemble.build_observers`), attached after the hook specs;
    ``scaler``: fp16's GradScaler (it skips overflowing steps itself, so the guard looks at the loss alone; the
    noise scale divides its scale out of the micro-batches' gradients)."""
    stats = typed(StatsConfig, cfg.stats, lambda name: f"stats.{name}")
    guard = typed(GuardConfig, cfg.guard, lambda name: f"guard.{name}")
    wiring = Wiring(hooks=hooks, meter=TrainMeter(parts.task, parts.device, parts.ranks), device=parts.device,
                    grads_scaled=scaler is not None, ranks=parts.ranks, accumulate=parts.accumulate,
                    clip=cfg.trainer.clip_grad_norm, grad_scale=(lambda: scaler._scale) if scaler is not None else None)
    return build_observers(parts.model, parts.optimizer, stats, guard, wiring)


class Trainer:
    """One run's training: the parts (:class:`~hookexp.run.build.Parts`), the hooks, the precision, the
    observers, the checkpointer, the sinks and the loop state. Built after the parts (and a resumed run's
    weights): it attaches the hook specs and the observers before DDP wrapping and compiling, so that targets
    keep their names. ``resumed``: the checkpoint's contents, or None; ``started``: when the run started
    (``time.perf_counter()``; None: now)."""

    def __init__(self, cfg: DictConfig, parts: Parts, ckpt: Checkpointer, resumed: dict[str, Any] | None,
                 started: float | None = None):
        self.cfg, self.parts, self.ckpt = cfg, parts, ckpt
        self.run_dir: Path = ckpt.run_dir
        self.started = started if started is not None else time.perf_counter()
        main = parts.ranks.is_main  # only rank 0 writes files and logs
        self.hooks: HookHandle = attach(parts.model, hook_specs(cfg), parts.optimizer, measure=False)
        self.observers = None
        try:
            self.amp = MixedPrecision(cfg.trainer.precision, parts.device, self.hooks)
            self.observers = trainer_observers(cfg, parts, self.hooks, self.amp.scaler)
            self.meter, self.guard, self.recorder = (self.observers.named[k] for k in ("meter", "guard", "spike"))
            self.forward = distributed.wrap(parts.model, cfg.trainer, parts.ranks, parts.device)
            for name in ("gns", "forensics"):  # what they keep per forward, kept outside the compiled graph
                if name in self.observers.named:
                    self.observers.named[name].count_calls_of(self.forward)
            self.records = Records(self.hooks, self.run_dir, enabled=main and cfg.trainer.save_records)
            self.local = LocalFiles(self.run_dir) if main else None
            ckpt.track(scheduler=parts.scheduler, scaler=self.amp, hooks=self.hooks, telemetry=self.observers,
                       files=self.local, records=self.records)
            self.loop = ckpt.restore(resumed) if resumed is not None else LoopState()
            if main:
                self.write_manifest(resumed)
            # rollback: host snapshots and the skip list (hookexp/run/rollback.py); it wraps the sinks so that
            # re-done steps are not logged twice
            self.rollback = Rollback(self, resumed)
            self.sinks = self.rollback.wrap(self.make_sinks(resumed))
            # after the restore: what the backends keep is read by make_sinks
            ckpt.track(sinks=self.sinks, rollback=self.rollback)
            if main and self.hooks.table():
                log.info("hooks:\n%s", hooks_summary(self.hooks.table()))
        except BaseException:
            self.hooks.remove()
            if self.observers is not None:
                self.observers.close()
            raise
        self.flight: tuple[int, Any, dict[str, Any], list[dict[str, Any]]] | None = None  # a log record on its way
        self.late = lands_late(parts, self.recorder, self.rollback)
        self.last_log_time = time.perf_counter()
        self.reached: int | None = None  # the step at which a logged value met trainer.stop_when
        self.stop_agreed = False  # several ranks, records landing late: a rank asked to stop (stop_requested)
        self.stopped_by = parts.limit  # what ended the run, for the summary and the final line
        self.first_step_s = 0.0  # the first step's seconds in this process: torch.compile's compile, lazy set-up
        # disable=None: a bar only when stderr is a terminal (never glued to redirected log lines)
        self.bar = tqdm(total=parts.total_steps, initial=self.loop.step, disable=None if cfg.trainer.progress else True,
                        desc="train", unit="step", leave=False)

    # -- the run ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``parts.total_steps``; returns the summary. A signal (SIGTERM/SIGINT) checkpoints and ends
        the run as "interrupted"; any exit goes through :meth:`close`."""
        status = "failed"
        with self.ckpt.stops.catching():
            try:
                status = self.run_steps()
            finally:
                summary = self.close(status)
        return summary

    def run_steps(self) -> str:
        """The loop: step, validate, checkpoint, until the last step, a signal or ``trainer.stop_when``; returns
        the run's status (finished or interrupted)."""
        loop, total, parts, bar = self.loop, self.parts.total_steps, self.parts, self.bar
        per_epoch, eval_every = parts.loaders.batches_per_epoch(), self.cfg.trainer.eval_every
        eval_epochs = self.cfg.trainer.eval_every_epochs  # 0: never at an epoch's end (full batch: one step an epoch)
        batches = None
        parts.model.train()
        while loop.step < total:
            started = time.perf_counter()
            if batches is None:  # this epoch's batches, from the loop's position in it (a resumed run starts mid-epoch)
                batches = parts.loaders.epoch(loop.epoch, loop.batch)
            log_now = loop.step % self.cfg.stats.every == 0 or loop.step == total - 1 or \
                self.recorder.logging_every_step(loop.step)
            self.rollback.before_step()  # rollback: a snapshot when one is due
            result = self.train_step(batches, per_epoch, log_now)
            taken = result.taken
            bar.update(bool(taken))
            step_s = time.perf_counter() - started
            self.first_step_s = self.first_step_s or step_s
            loop.train_s += step_s
            if taken and self.rollback.after_step(result.spike):  # rollback: restored a snapshot; reopen the batches
                batches = None
                continue
            epoch_done = (per_epoch is not None and loop.batch >= per_epoch) or taken < result.asked
            if epoch_done:
                loop.epoch, loop.batch, batches = loop.epoch + 1, 0, None
            epoch_eval = epoch_done and eval_epochs and loop.epoch % eval_epochs == 0
            if taken and (epoch_eval or (eval_every and loop.step % eval_every == 0) or loop.step == total):
                self.evaluate()
            stopping = self.stop_requested(log_now)
            self.maybe_checkpoint(result, stopping)
            stopping = stopping or self.stop_agreed  # (ranks, records landing late) a vote the checkpoint landed
            if stopping:
                log.warning("stopped by signal %s after step %d; checkpoint %s", self.ckpt.stops.signum, loop.step,
                            self.ckpt.path)
                bar.close()
                return "interrupted"
            if self.reached is not None:
                log.info("stopped after step %d: %s (trainer.stop_when)", self.reached, parts.goal)
                self.stopped_by = f"trainer.stop_when={parts.goal}"
                break
        bar.close()
        if loop.evaluated != loop.step - 1:  # resumed from the final checkpoint, before its validation ran
            self.evaluate()
        return "finished"

    def train_step(self, batches: Any, per_epoch: int | None, log_now: bool) -> StepResult:
        """One optimizer step over ``trainer.accumulate`` micro-batches (the epoch's last step takes those left)."""
        loop, parts, observers = self.loop, self.parts, self.observers
        task, optimizer, first_batch = parts.task, parts.optimizer, loop.batch
        observers.start(loop.step, log_now)
        optimizer.zero_grad(set_to_none=True)
        micro = parts.accumulate if per_epoch is None else min(parts.accumulate, per_epoch - loop.batch)
        taken, loss = 0, None
        for i in range(micro):
            batch = next(batches, None)
            if batch is None:  # an iterable data set ran out: the epoch ends here
                break
            batch = to_device(batch, parts.device)
            # DDP all-reduces the gradients on the last micro-batch only
            sync = self.forward.no_sync() if i < micro - 1 and hasattr(self.forward, "no_sync") else \
                contextlib.nullcontext()
            with sync, self.explaining():
                with self.amp.autocast():
                    output = task.forward(self.forward, batch)
                    loss = task.loss(output, batch)
                self.amp.backward(loss / micro if micro > 1 else loss)  # no division (2 ops) for one
            with torch.no_grad():  # the metric sums make no graph (Task.sums)
                self.meter.add(*task.sums(output, batch, loss))
            taken += 1
        if not taken and not loop.batch:
            raise no_batch()
        loop.batch += taken
        if not taken:
            return StepResult(taken, micro)
        self.amp.unscale(optimizer)  # pre_step specs, the guard and the statistics see true gradients
        if observers.allow_update(loss, loop.step):
            self.amp.step(optimizer)  # the pre_step specs, then the observers' before_update (statistics, clip)
        else:
            self.draw_forensics()  # the guard skipped a non-finite step: forensics says where it came from
        if parts.scheduler is not None:
            parts.scheduler.step()
        self.hooks.set_step(loop.step + 1)  # the step the specs' schedules look at next, also after a skipped update
        step, loop.step = loop.step, loop.step + 1
        loop.period.append({"step": step, "epoch": loop.epoch, "batches": list(range(first_batch, loop.batch))})
        spike = None
        if log_now or self.flight is not None:
            with profiler_range("hookexp/log_step"):  # a log step's ranges: benchmarks/profile_step.py
                self.land()  # the last step's log record, if still on its way: this step's work is queued behind it
                spike = self.log_step(step) if log_now else None
        observers.end(step)
        return StepResult(taken, micro, spike)

    def log_step(self, step: int) -> Any:
        """Every observer's values in one read-back, to the sinks; returns the spike this step starts, if any.
        Where :attr:`late`, the values are sent now and land with the next step (:meth:`land`), and None is
        returned."""
        now, loop = time.perf_counter(), self.loop
        extra = {"epoch": loop.epoch, "perf/step_time": (now - self.last_log_time) / max(
            loop.step - loop.last_log_step, 1)}
        self.last_log_time, loop.last_log_step = now, loop.step
        # ranks on CUDA: whether any was asked to stop travels with the values (no .item() to agree now); every
        # rank lands it at the same point and stops after that step
        votes = [(self.parts.ranks.vote(self.ckpt.stops.requested, self.parts.device), self.agree_to_stop)] \
            if self.late and self.parts.ranks.enabled else []
        self.flight = (step, self.observers.send(*votes), extra, loop.period)
        loop.period = []
        return None if self.late else self.land()

    def land(self) -> Any:
        """The log record on its way (:meth:`log_step`), if any, to the sinks; the spike it starts, if any."""
        if self.flight is None:
            return None
        (step, flight, extra, period), self.flight = self.flight, None
        with profiler_range("hookexp/land"):  # its read-back, then what the host does with it (profile_step.py)
            metrics, histograms = split_histograms(flight.land())
            metrics.update(extra)
            with profiler_range("hookexp/sinks"):
                self.sinks.log(metrics, step, histograms)
            self.check_goal(metrics, step)
            spike = self.observers.observe(metrics, step).get("spike")
            if spike is not None:
                log.warning("spike of %s at step %d: %.4g against a median of %.4g; logging every step for %d steps; "
                            "its row: %s%s", spike.metric, spike.step, spike.value, spike.median, self.recorder.steps,
                            self.run_dir / "spikes.jsonl", "" if self.observers.named.get("forensics") is None else
                            f", which layer went first: {self.run_dir / 'forensics' / f'step_{spike.step}.png'}")
                self.sinks.spike(spike.row(period))
                self.draw_forensics()
            if not self.bar.disable:
                self.bar.set_postfix({k.split("/")[1]: f"{v:.4g}" for k, v in metrics.items()
                                      if k.startswith("train/")})
        return spike

    def agree_to_stop(self, host: Any) -> dict[str, Any]:
        """The ranks' vote (:meth:`log_step`), landed: any rank asked to stop."""
        self.stop_agreed = self.stop_agreed or bool(host[0] > 0)
        return {}

    def settle(self) -> None:
        """Where the host syncs anyway (validation, a checkpoint, the run's end): the record on its way lands, and
        the observers act on what else is on its way (the guard's flags of the last steps)."""
        self.land()
        self.observers.settle()

    def draw_forensics(self) -> None:
        """Each new forensics report as ``forensics/step_<N>.png``, also to the backends (rank 0)."""
        forensics = self.observers.named.get("forensics")
        for report in forensics.take_reports() if forensics is not None else []:
            if self.local is not None and report.steps:
                path = draw(report, self.run_dir / "forensics" / f"step_{report.step}.png")
                self.sinks.image("forensics", path, report.step)

    def check_goal(self, metrics: dict[str, Any], step: int) -> None:
        goal = self.parts.goal
        if goal is not None and goal.holds(metrics.get(goal.metric, math.nan)):
            self.reached = step

    @torch.no_grad()
    def validation_metrics(self) -> dict[str, float]:
        """The task's metrics over the validation set (summed over ranks), as ``val/<metric>``."""
        parts = self.parts
        batches = parts.loaders.validation()
        if batches is None:
            return {}
        task, totals = parts.task, None
        parts.model.eval()
        try:
            for batch in batches:
                batch = to_device(batch, parts.device)
                with self.amp.autocast():
                    output = task.forward(self.forward, batch)
                    loss = task.loss(output, batch)
                sums, count = task.sums(output, batch, loss)
                row = torch.cat([sums.double(), count.double().reshape(1)])
                totals = row if totals is None else totals + row
        finally:
            parts.model.train()
        if totals is None:
            totals = torch.zeros(len(task.metric_names) + 1, dtype=torch.float64, device=parts.device)
        *sums_host, count = parts.ranks.sum(totals).tolist()
        means = {n: s / count if count else math.nan for n, s in zip(task.metric_names, sums_host, strict=True)}
        return {f"val/{k}": v for k, v in task.finish(means).items()}

    def evaluate(self) -> dict[str, float]:
        """Validate after the last step's update and log it under that step."""
        self.settle()
        val = self.validation_metrics()
        self.loop.evaluated = self.loop.step - 1
        if val:
            self.sinks.log({**val, "epoch": self.loop.epoch}, self.loop.step - 1)
            self.check_goal(val, self.loop.step - 1)
        return val

    def stop_requested(self, log_now: bool) -> bool:
        """Whether a signal asks the run to stop. Several ranks agree on log steps only, so no other step pays a
        collective; where records land late (CUDA), on the vote of the last log step, landed with its record."""
        ranks = self.parts.ranks
        if not ranks.enabled:
            return bool(self.ckpt.stops.requested)
        if self.late:
            return self.stop_agreed
        return bool(log_now and ranks.any(self.ckpt.stops.requested, self.parts.device))

    def maybe_checkpoint(self, result: StepResult, stopping: bool) -> None:
        """A checkpoint when one is due (every ``trainer.checkpoint_every`` steps, the last step, the step
        ``stop_when`` held, a spike, ``stopping``: a signal)."""
        loop, every = self.loop, self.cfg.trainer.checkpoint_every
        due = every and result.taken and (loop.step % every == 0 or loop.step == self.parts.total_steps
                                          or self.reached is not None)
        if stopping or due or (result.spike is not None and self.recorder.checkpoint):
            self.settle()  # the files the checkpoint's position covers are whole; no bad step unreported
            if self.ckpt.finite(self.parts.model):  # never a non-finite state: it would replace the last good one
                self.ckpt.save(loop)
            else:
                self.guard.refuse_checkpoint(loop.step, self.ckpt.saved_step)

    @contextlib.contextmanager
    def explaining(self) -> Any:
        """torch's errors around the hooks (an in-place op next to a full backward hook, a transform that cut the
        graph) as errors naming the spec."""
        try:
            yield
        except RuntimeError as e:
            better = self.hooks.explain(e)
            if better is None and self.cfg.trainer.compile:
                better = compile_failure(e)
            if better is None:
                raise
            raise better from e

    # -- files -----------------------------------------------------------------------------------------
    def config_as_run(self) -> dict[str, Any]:
        """The config with the model's arguments as built (``auto`` filled from the data)."""
        return {**OmegaConf.to_container(self.cfg, resolve=True), "model": self.parts.model_config}  # type: ignore

    def write_manifest(self, resumed: dict[str, Any] | None) -> None:
        """manifest.json first (so that even a failed run says what it was)."""
        manifest = {**build_manifest(self.config_as_run(), self.hooks.table(), self.cfg.seed, Path.cwd()),
                    "world_size": self.parts.ranks.world_size}
        if resumed is not None:
            manifest["resumed_from_step"] = int(resumed["loop"]["step"])
        write_json_atomic(self.run_dir / "manifest.json", manifest)

    def make_sinks(self, resumed: dict[str, Any] | None) -> Sinks | NullSinks:
        """The local files and the backend ``logger._target_`` names (rank 0; other ranks log nothing). A resumed
        run hands each backend what it kept in the checkpoint (W&B: its run id)."""
        if self.local is None:
            return NullSinks()
        target = self.cfg.logger.get("_target_")
        # a run continued in its own directory continues its backend's run (W&B: the same run id); one continued
        # into another directory (resume=PATH) starts a new one, so that the two never write into one
        same_dir = self.ckpt.source_run_dir is not None and \
            self.ckpt.source_run_dir.resolve() == self.run_dir.resolve()
        saved = resumed.get("sinks", {}) if resumed is not None and same_dir else {}
        kept = saved.get(target)
        run = RunInfo(self.run_dir, self.config_as_run(), self.hooks.table(),
                      int(resumed["loop"]["step"]) if resumed is not None else None, kept)
        backend = make_backend(self.cfg.logger, run)
        return Sinks(self.local, {target: backend} if backend is not None else None)

    def close(self, status: str) -> dict[str, Any]:
        """One cleanup path, run with signals held (see Checkpointer.signals): records, files, plot, summary, the
        logger backend.

        Each part runs even when one before it failed; the first failure is raised at the end unless an error
        from the loop is already on its way."""
        failures: list[BaseException] = []

        def attempt(fn: Any, *args: Any) -> Any:
            try:
                return fn(*args)
            except BaseException as e:
                failures.append(e)
                return None

        parts, loop, run_dir = self.parts, self.loop, self.run_dir
        attempt(self.settle)
        self.bar.close()
        self.observers.close()
        attempt(self.records.save)
        calls = {f"hook/{name}/calls": row["calls"] for name, row in self.hooks.stats(reset=False).items()}
        self.hooks.remove()
        if self.local is not None:
            attempt(self.local.close)
        if failures:  # the run's own files are incomplete: it did not finish, whatever the loop said
            status = "failed"
        summary = summarize(run_dir / "metrics.jsonl") if self.local is not None else {}
        summary.update({
            "status": status, "signal": self.ckpt.stops.signum, "trainer/steps": loop.step,
            "trainer/epochs": loop.epoch,
            "runtime_s": time.perf_counter() - self.started, "perf/train_loop_s": loop.train_s,
            "perf/first_step_s": self.first_step_s,
            "run_dir": str(run_dir), **self.observers.summary(), **calls,
            **self.rollback.summary(),  # rollback: what was rolled back and skipped
        })
        if status == "finished":
            summary["trainer/stopped_by"] = self.stopped_by  # e.g. trainer.max_steps=4000
        if parts.ranks.enabled and status != "failed":
            summary.update({"dist/world_size": parts.ranks.world_size, "dist/strategy": parts.ranks.strategy})
            if not parts.ranks.sharded:  # replicas: they must hold the same parameters (FSDP's ranks hold shards)
                summary["dist/params_in_sync"] = parts.ranks.params_in_sync(parts.model)
        if self.local is not None:
            plot = attempt(plot_grad_norms, self.local.metrics_path, run_dir / "plots" / "grad_norms.png")
            if plot is not None:
                attempt(self.sinks.image, "plots/grad_norms", plot, max(loop.step - 1, 0))
        attempt(self.draw_forensics)  # a report the guard made as it stopped the run
        summary["signal"] = self.ckpt.stops.signum  # also one that came during this shutdown (it did not cut it)
        attempt(self.sinks.finish, summary, status == "failed")
        attempt(distributed.teardown, parts.ranks, status != "failed")  # after a failure: no barrier
        if failures and sys.exc_info()[1] is None:
            raise failures[0]
        for e in failures:
            log.warning("during shutdown: %s: %s", type(e).__name__, e)
        return summary


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
