"""On a CUDA GPU: the trainer never makes the host wait on a step that does not log, and a run logs the
statistics that the same run logs on the CPU. Skipped where there is no GPU (CI); on a GPU machine the
rest of the suite runs there too, since ``trainer.device=auto`` picks CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FORENSICS_ON, config, read_jsonl

from hookexp.engine import HookHandle
from hookexp.run.loop import run_job as train
from hookexp.run.sinks import Sinks
from hookexp.run.trainer import Trainer
from hookexp.telemetry import stats
from hookexp.telemetry.observer import Observers
from hookexp.telemetry.stats import ACTIVATION_STATS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_steps_that_do_not_log_never_sync_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """torch's sync debug mode set to "error" from the end of each log step (its record handed to the
    sinks) to the start of the next: any synchronising CUDA call on the steps between (an .item(), a
    blocking copy, a data-dependent shape) raises. Hooks of three stages and every statistic are on, the gradient
    noise scale (over two micro-batches), the forensics ring buffer, the guard's and the spike recorder's every-step
    judgements (their values reach the host through pinned memory) too. The debug mode does not see an event's
    wait: a rollback snapshot waits on one for the spike recorder's last value, which this cannot count."""
    start, log, evaluate = Observers.start, Sinks.log, Trainer.evaluate
    modes: dict[int, int] = {}

    def start_step(self: Observers, step: int, logging: bool) -> None:
        if logging:
            torch.cuda.set_sync_debug_mode(0)
        start(self, step, logging)

    def end_log_step(self: Sinks, *args, **kwargs) -> None:
        log(self, *args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")

    def evaluate_may_sync(*args, **kwargs):
        torch.cuda.set_sync_debug_mode(0)
        return evaluate(*args, **kwargs)

    set_step = HookHandle.set_step

    def note_mode(self: HookHandle, step: int) -> None:
        modes[step - 1] = torch.cuda.get_sync_debug_mode()
        set_step(self, step)

    monkeypatch.setattr(Observers, "start", start_step)
    monkeypatch.setattr(Sinks, "log", end_log_step)
    monkeypatch.setattr(Trainer, "evaluate", evaluate_may_sync)
    monkeypatch.setattr(HookHandle, "set_step", note_mode)
    hooks = ["hooks=[clamp_conv,dead_relu_probe]", "+hooks.clip={target:'*',kind:pre_step,transform:clamp,"
             "args:{min:-0.01,max:0.01}}"]
    try:
        summary = train(config(*hooks, FORENSICS_ON, "stats.every=7", "stats.activations=relu*", "stats.hist_bins=16",
                               "stats.params=*", "stats.updates=*", "stats.optimizer=*", r"stats.group_by='re:^conv\d'",
                               "trainer.max_steps=30", "guard.nan_policy=raise", "trainer.accumulate=2",
                               "stats.gns=true", "guard.spike.metric=train/loss", "guard.spike.threshold=1e3"),
                      tmp_path)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert summary["status"] == "finished" and summary["hook/clip/calls"] == 30 * 8
    log_steps = {0, 7, 14, 21, 28, 29}
    assert modes == {s: 0 if s in log_steps else 2 for s in range(30)}  # 2: "error"
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert {r["trainer/step"] for r in rows} == log_steps


def test_with_records_landing_late_no_step_syncs_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every statistic on every step (the benchmark's case c) with nothing that acts on the values at once: each
    step's record lands with the next step, so from the second step on no step makes the host wait, log steps
    included (validation and the final checkpoint read values back, as they may)."""
    start = Observers.start
    late: list[bool] = []

    def start_step(self: Observers, step: int, logging: bool) -> None:
        torch.cuda.set_sync_debug_mode("error" if step >= 1 else 0)
        start(self, step, logging)

    def may_sync(original):
        def wrapper(self, *args, **kwargs):
            late.append(self.late)
            torch.cuda.set_sync_debug_mode(0)
            return original(self, *args, **kwargs)
        return wrapper

    landed: list[tuple[int, int]] = []  # (the step a record describes, the trainer's step count as it lands)
    land = Trainer.land

    def landing(self: Trainer):
        if self.flight is not None:
            landed.append((self.flight[0], self.loop.step))
        return land(self)

    for name in ("evaluate", "maybe_checkpoint"):
        monkeypatch.setattr(Trainer, name, may_sync(getattr(Trainer, name)))
    monkeypatch.setattr(Trainer, "land", landing)
    monkeypatch.setattr(Observers, "start", start_step)
    calls = stats.ROW_KERNEL.calls
    try:  # 12 steps: within the first epoch (a smaller last batch would make the activations a new layout)
        summary = train(config("stats.every=1", "stats.grads=*", "stats.activations=relu*", "stats.hist_bins=16",
                               "trainer.max_steps=12"), tmp_path)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert summary["status"] == "finished" and all(late) and late
    # the statistics ran compiled (CUDA's default), compiled at step 0 (a compile under "error" would fall back)
    assert stats.ROW_KERNEL.failed is None and stats.ROW_KERNEL.calls > calls
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["trainer/step"] for r in rows] == list(range(12)) and all("act/relu1/std" in r for r in rows)
    # the sync debug mode cannot see an event's wait: that each record landed a step late is asserted here
    assert landed == [(s, s + 2) for s in range(11)] + [(11, 12)]  # the last before the final validation


def test_a_cuda_run_logs_the_statistics_a_cpu_run_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Same seed, same data, same initial weights (built on the CPU, then moved): the first step's every
    scalar statistic agrees to float32 reduction order, with TF32 off so that the convolutions match."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    common = ["hooks=clamp_conv", "trainer.max_steps=1", "stats.activations=relu*", "stats.hist_bins=8"]
    cpu = train(config(*common, "trainer.device=cpu"), tmp_path / "cpu")
    gpu = train(config(*common, "trainer.device=cuda"), tmp_path / "cuda")
    assert cpu["hook/clamp_conv/calls"] == gpu["hook/clamp_conv/calls"] == 2
    first_cpu, first_gpu = (read_jsonl(tmp_path / d / "metrics.jsonl")[0] for d in ("cpu", "cuda"))
    keys = [k for k, v in first_cpu.items() if isinstance(v, float) and not k.startswith("perf/")]
    assert sum(k.startswith("grad/") for k in keys) >= 8 * 7
    assert sum(k.startswith("act/") for k in keys) == 3 * len(ACTIVATION_STATS)  # relu1..3
    assert sum(k.startswith("hook/") for k in keys) >= 3
    assert set(first_gpu) == set(first_cpu)
    for key in keys:
        assert first_gpu[key] == pytest.approx(first_cpu[key], rel=1e-4, abs=1e-7), key
