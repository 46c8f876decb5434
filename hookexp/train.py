"""The training loop: build from the config, attach the hooks, train, evaluate, log.

Read it top to bottom: :func:`train` is the whole run. The loop does nothing extra on steps that do
not log: hook effects, gradient and activation statistics run, and the host syncs, only on every
``stats.every``-th step (and the last). ``trainer/step`` in every record is the 0-based index of
the optimizer step whose gradients are described; val metrics are measured after that step's update.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from hookexp import checkpoint, distributed
from hookexp.distributed import Dist
from hookexp.engine import HookHandle, attach, explain_torch_error, validate
from hookexp.errors import ConfigError, HookCheckError, did_you_mean
from hookexp.guard import NonFiniteGuard
from hookexp.guard import as_dict as guard_summary
from hookexp.manifest import build_manifest, write_json
from hookexp.meter import TrainMeter
from hookexp.plots import plot_grad_norms
from hookexp.sinks import LocalFiles, NullSinks, Sinks, WandbSink, check_logger
from hookexp.stats import StepStats

log = logging.getLogger("hookexp.train")


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch, and make torch pick deterministic algorithms only or not.

    The switch is set either way: Hydra's basic launcher runs a multirun's jobs in one process, so a
    job with ``repro.deterministic=false`` must not inherit the setting of the job before it.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(deterministic)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"{e}. Use auto, cpu, cuda, cuda:N or mps.", key="trainer.device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("CUDA is not available on this machine. Use trainer.device=auto or cpu.",
                          key="trainer.device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        have = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        raise ConfigError(f"there is no {device}: this machine has {len(have)} CUDA device(s) ({', '.join(have)}). "
                          f"Use trainer.device=auto, cuda or one of those.", key="trainer.device")
    return device


def build(node: DictConfig, key: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` with a one-paragraph error naming the key and the real parameters."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        target = node.get("_target_", "?")
        cause = e.__cause__ or e
        hint = ""
        try:
            params = [p for p in inspect.signature(get_class(target)).parameters if p not in ("self", "params")]
            bad = [k for k in node if not str(k).startswith("_") and k not in params]
            if bad:
                hint = f"{did_you_mean(str(bad[0]), params)} Its parameters: {', '.join(params)}."
        except Exception:
            pass
        raise ConfigError(f"could not build {target}: {type(cause).__name__}: {cause}.{hint}", key=key) from None


def evaluate(model: torch.nn.Module, loader: Any, device: torch.device) -> dict[str, float]:
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum")
            correct += (logits.argmax(dim=1) == y).sum()
            seen += len(y)
    model.train()
    loss, acc = torch.stack([loss_sum / seen, correct.float() / seen]).tolist()
    return {"val/loss": loss, "val/acc": acc}


@dataclass
class Run:
    """Everything a job builds from its config before training."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: Any
    val_loader: Any
    device: torch.device
    total_steps: int


def build_run(cfg: DictConfig, ranks: Dist | None = None, device: torch.device | None = None) -> Run:
    """Seed, then build data, model and optimizer from the config (``hydra.utils.instantiate``) on
    ``device`` (default: ``trainer.device``), or on this rank's own GPU of it under DDP."""
    ranks = ranks or Dist()
    seed_everything(cfg.seed, cfg.repro.deterministic)
    device = ranks.place(device or pick_device(cfg.trainer.device))
    splits = build(cfg.data.dataset, "data.dataset")
    train_loader, val_loader = splits.loaders(cfg.data.batch_size, cfg.seed, cfg.data.eval_batch_size,
                                              cfg.data.num_workers, ranks.rank, ranks.world_size)
    model = build(cfg.model, "model").to(device)
    optimizer = build(cfg.optim, "optim")(params=model.parameters())
    total_steps = cfg.trainer.epochs * len(train_loader)
    if cfg.trainer.max_steps is not None:
        total_steps = min(total_steps, cfg.trainer.max_steps)
    if total_steps < 1:
        raise ConfigError("the run would take no step; set trainer.epochs or trainer.max_steps to at least 1.",
                          key="trainer")
    return Run(model, optimizer, train_loader, val_loader, device, total_steps)


def dry_run(cfg: DictConfig, run_dir: Path) -> None:
    """``+dry_run=true``: validate the hooks on one training batch, print the table, train nothing.

    Writes ``dry_run.json`` (the table and errors) to the run directory; a failed check raises
    :class:`HookCheckError` so the command exits non-zero.
    """
    run = build_run(cfg)
    x, y = next(iter(run.train_loader))
    specs = OmegaConf.to_container(cfg.hooks, resolve=True)
    report = validate(run.model, specs, (x.to(run.device), y.to(run.device)), run.optimizer)
    print(report.render(), flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "dry_run.json", {"ok": report.ok, "hooks": report.rows, "errors": report.errors})
    if not report.ok:
        raise HookCheckError(f"the dry run found {len(report.errors)} error(s): {report.errors[0]}")


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Run one training job described by ``cfg`` and write its files into ``run_dir``.

    Returns the summary (final and best metrics).
    """
    check_logger(cfg.logger)
    ckpt_path = checkpoint.resolve(cfg.get("resume"), run_dir)
    resumed = checkpoint.load(ckpt_path) if ckpt_path is not None else None  # a bad checkpoint fails first
    device = pick_device(cfg.trainer.device)
    ranks = distributed.setup(device)
    main = ranks.is_main  # only rank 0 writes files and logs
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    run = build_run(cfg, ranks, device)
    model, optimizer, device, total_steps = run.model, run.optimizer, run.device, run.total_steps
    train_loader, val_loader = run.train_loader, run.val_loader

    # -- statistics and hooks: every spec is checked here, before any training -----------------------
    every, checkpoint_every = cfg.stats.every, cfg.trainer.checkpoint_every  # read once: a DictConfig read is slow
    if every < 1:
        raise ConfigError(f"must be at least 1, got {every}.", key="stats.every")
    step_stats = StepStats(model, cfg.stats.grads, cfg.stats.activations, cfg.stats.hist_bins, cfg.stats.hist_sample)
    step_stats.prepare(device)
    hook_specs = OmegaConf.to_container(cfg.hooks, resolve=True)
    hooks = attach(model, hook_specs, optimizer, measure=False)
    try:  # from here on a failure detaches the hooks again before it propagates
        amp = MixedPrecision(cfg.trainer.precision, device, hooks)
        # Wrapped and compiled after the hooks are attached: hook targets keep their names, grad-kind hooks
        # run before DDP's all-reduce, and torch ignores hooks added to a compiled module.
        forward: torch.nn.Module = model
        if ranks.enabled:
            forward = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if cfg.trainer.compile:
            forward = torch.compile(forward, backend=cfg.trainer.compile_backend)
        # under fp16 the GradScaler itself skips steps with overflowing gradients: the guard checks the loss
        guard = NonFiniteGuard(cfg.trainer.nan_policy, model, hooks, check_grads=amp.scaler is None)
        loop = LoopState()
        if resumed is not None:
            try:
                model.load_state_dict(resumed["model"])
                optimizer.load_state_dict(resumed["optimizer"])
            except (RuntimeError, ValueError, KeyError) as e:
                raise ConfigError(f"the checkpoint {ckpt_path} does not fit this model/optimizer ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0]}). Resume with the config it was written with.",
                                  key="resume") from None
            hooks.load_state_dict(resumed["hooks"])
            checkpoint.set_rng_state(resumed["rng"])
            loop = LoopState(**resumed["loop"])

        # -- outputs: manifest first, so that even a failed run says what it was --------------------------
        config = OmegaConf.to_container(cfg, resolve=True)
        table = hooks.table()
        if main:
            manifest = build_manifest(config, table, cfg.seed, Path.cwd())
            write_json(run_dir / "manifest.json", {**manifest, "world_size": ranks.world_size})
        if resumed is not None and main:  # keep exactly the lines written before the checkpoint
            # (checkpoints written before histograms.jsonl existed count metrics.jsonl's lines alone)
            lines = resumed.get("lines") or {"metrics.jsonl": resumed["metrics_lines"]}
            LocalFiles.keep(ckpt_path.parent.parent, run_dir, lines)
        local = LocalFiles(run_dir) if main else None
        wandb_sink = None
        if main and cfg.logger.backend == "wandb" and cfg.logger.mode != "disabled":
            tags = list(cfg.logger.tags) + [b.spec.name for b in hooks.bindings if b.spec.enabled]
            wandb_id = resumed.get("wandb_id") if resumed is not None else None
            wandb_sink = WandbSink(run_dir, cfg.logger, config, tags, table, run_id=wandb_id)
        sinks = Sinks(local, wandb_sink) if local is not None else NullSinks()
    except BaseException:
        hooks.remove()
        raise

    # Gradient statistics see the final .grad right before the update: registered after attach(), this
    # optimizer pre-hook runs after the pre_step specs. It works only on log steps (hooks.measuring).
    def capture_grad_stats(opt: Any, args: Any, kwargs: Any) -> None:
        if hooks.measuring:
            step_stats.capture_grads()

    stats_handle = optimizer.register_step_pre_hook(capture_grad_stats)

    summary: dict[str, Any] = dict(loop.summary)
    status = "failed"
    step, epoch, best_acc = loop.step, loop.epoch, loop.best_acc
    stop = StopSignal()

    def save_checkpoint() -> Path:
        path = run_dir / "checkpoints" / "last.pt"
        if local is not None:  # the checkpoint counts the lines written so far: they must be on disk
            local.flush()
        checkpoint.save(path, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "hooks": hooks.state_dict(),
            "rng": checkpoint.rng_state(), "lines": dict(local.lines) if local else {},
            "wandb_id": wandb_sink.run_id if wandb_sink else None,
            "loop": {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "epoch_rng": epoch_rng,
                     **meter.snapshot(), "last_log_step": last_log_step, "best_acc": best_acc, "summary": summary},
        })
        return path

    try:
        stop.install()
        meter = TrainMeter(device, loop.loss_sum, loop.correct, loop.seen, loop.batches, loop.last_log_step,
                           all_reduce=ranks.sum if ranks.enabled else None)
        last_log_time, last_log_step = time.perf_counter(), loop.last_log_step
        loop_started, eval_s = time.perf_counter(), 0.0
        bar = tqdm(total=total_steps, initial=step, disable=not cfg.trainer.progress, desc="train", unit="step",
                   leave=False)
        model.train()
        skip = loop.batch_in_epoch
        while step < total_steps and status != "interrupted":
            # The data order of an epoch follows from this generator state: a checkpoint keeps it.
            if loop.epoch_rng is not None and skip:
                train_loader.generator.set_state(loop.epoch_rng)
            epoch_rng = train_loader.generator.get_state()
            if isinstance(train_loader.sampler, DistributedSampler):
                train_loader.sampler.set_epoch(epoch)
            batch_in_epoch = 0
            for x, y in train_loader:
                if batch_in_epoch < skip:  # resuming mid-epoch: these batches were trained on already
                    batch_in_epoch += 1
                    continue
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                log_now = step % every == 0 or step == total_steps - 1
                hooks.measuring = log_now
                if log_now:
                    step_stats.begin()

                try:
                    with amp.autocast():
                        logits = forward(x)
                        loss = F.cross_entropy(logits, y)
                    optimizer.zero_grad(set_to_none=True)
                    amp.backward(loss)
                except RuntimeError as e:
                    raise (explain_torch_error(e, hooks) or e) from e
                amp.unscale(optimizer)  # pre_step hooks, the guard and the statistics see true gradients
                if guard.check(loss, step):
                    amp.step(optimizer)
                else:
                    optimizer.zero_grad(set_to_none=True)
                hooks.set_step(step + 1)  # also when a step was skipped (guard, or fp16 overflow)

                meter.add(step, loss, logits, y)
                if log_now:
                    # one device-to-host transfer: the statistics, the loss and accuracy (and the guard's
                    # view of every loss since the last log step), what the hooks did
                    hook_values, hook_stats = hooks.pending_stats(reset=True)
                    read = step_stats.finish(meter.pending(), hook_values)
                    loss_v, acc_v, first_bad = meter.read(read.extra[0])
                    guard.on_log_step(first_bad, loss, step)
                    now = time.perf_counter()
                    metrics = {"train/loss": loss_v, "train/acc": acc_v, "epoch": epoch,
                               "perf/step_time": (now - last_log_time) / max(step + 1 - last_log_step, 1),
                               **read.metrics()}
                    last_log_time, last_log_step = now, step + 1
                    for name, row in hook_stats(read.extra[1]).items():
                        metrics.update({f"hook/{name}/{k}": v for k, v in row.items() if k != "targets"})
                    sinks.log(metrics, step, read.histograms())
                    summary.update({k: metrics[k] for k in ("train/loss", "train/acc")})
                    if not bar.disable:
                        bar.set_postfix(loss=f"{loss_v:.4f}", acc=f"{acc_v:.3f}")
                bar.update(1)
                step += 1
                batch_in_epoch += 1
                stopping = stop.signum is not None
                if ranks.enabled:  # agree on log steps only, so that no other step pays a collective
                    stopping = log_now and ranks.any(stopping, device)
                if stopping:
                    stop.signum = stop.signum or signal.SIGTERM
                    path = save_checkpoint() if main else None
                    log.warning("stopped by signal %d after step %d; checkpoint %s; continue with resume=true "
                                "hydra.run.dir=%s", stop.signum, step, path, run_dir)
                    status = "interrupted"
                    break
                if main and checkpoint_every and step % checkpoint_every == 0:
                    save_checkpoint()
                if step >= total_steps:
                    break
            skip = 0
            if status == "interrupted":
                break
            epoch += 1
            eval_started = time.perf_counter()
            val = evaluate(forward, val_loader, device)
            eval_s += time.perf_counter() - eval_started
            best_acc = max(best_acc, val["val/acc"])
            sinks.log({**val, "epoch": epoch}, step - 1)
            summary.update(val)
        bar.close()
        summary["perf/train_loop_s"] = time.perf_counter() - loop_started - eval_s  # training steps only
        if ranks.enabled:
            summary.update({"dist/world_size": ranks.world_size, "dist/params_in_sync": ranks.params_in_sync(model)})
        if status != "interrupted":
            status = "finished"
    finally:
        stop.restore()
        stats_handle.remove()
        hooks.remove()
        summary.update({
            "val/acc_best": best_acc if best_acc > float("-inf") else None, "signal": stop.signum,
            "trainer/steps": step, "trainer/epochs": epoch if step else 0, "status": status,
            "runtime_s": time.perf_counter() - started, **guard_summary(guard),
            **{f"hook/{b.spec.name}/calls": b.calls for b in hooks.bindings},
        })
        if main and cfg.trainer.save_records:
            _save_records(hooks, run_dir)
        if local is not None:
            local.close()
            try:
                plot = plot_grad_norms(local.metrics_path, run_dir / "plots" / "grad_norms.png")
                if plot is not None and wandb_sink is not None:
                    wandb_sink.log_image("plots/grad_norms", plot)
            except Exception as e:
                log.warning("could not plot the gradient norms: %s: %s", type(e).__name__, e)
        sinks.finish(summary, status == "failed")
        if status != "failed":
            distributed.teardown(ranks)
    return summary


class MixedPrecision:
    """``trainer.precision``: autocast in bf16 or fp16; fp16 scales the loss with a GradScaler and
    unscales the gradients before ``optimizer.step()``, so that ``pre_step`` hooks and the statistics
    see true gradients. ``grad``-kind hooks run inside backward and see scaled ones: a value-dependent
    transform there gets a warning naming ``pre_step``."""

    def __init__(self, precision: str, device: torch.device, hooks: HookHandle):
        dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
        if precision not in dtypes:
            raise ConfigError(f"unknown precision {precision!r}. Use fp32, bf16 or fp16.", key="trainer.precision")
        self.device_type = device.type
        self.dtype = dtypes[precision]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        if self.scaler is not None:
            for b in hooks.bindings:
                if b.kind.stage == "backward" and b.transform.value_dependent:
                    log.warning("hooks.%s: with trainer.precision=fp16 the gradients a %r hook sees are multiplied "
                                "by the GradScaler's scale, so %r acts on scaled values. Use kind 'pre_step' to "
                                "act on the unscaled gradient.", b.spec.name, b.spec.kind, b.transform.name)

    def autocast(self) -> Any:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skips the update (and the hooks' step) when gradients overflowed
        self.scaler.update()


@dataclass
class LoopState:
    """Where the loop is: a new run starts at zero, a resumed one where its checkpoint stopped."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    epoch_rng: torch.Tensor | None = None
    loss_sum: float = 0.0
    correct: int = 0
    seen: int = 0
    batches: int = 0
    last_log_step: int = 0
    best_acc: float = float("-inf")
    summary: dict[str, Any] = field(default_factory=dict)


class StopSignal:
    """SIGTERM / SIGINT set a flag that the loop checks after each step: it saves a checkpoint and stops
    cleanly instead of dying mid-step. Installed only in the main thread (signals are delivered there)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _save_records(hooks: HookHandle, run_dir: Path) -> None:
    records = {name: recs for name, recs in hooks.records.items() if recs}
    if not records:
        return
    out = run_dir / "records"
    out.mkdir(exist_ok=True)
    for name, recs in records.items():
        safe = name.replace("/", "_").replace(":", "_")
        torch.save([{"target": r.target, "step": r.step, "value": r.value, "aux": r.aux} for r in recs],
                   out / f"{safe}.pt")
