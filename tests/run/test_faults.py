"""Faults a long run meets — signals, kills inside writes, corrupt checkpoints, full disks, NaN, changed configs —
each asserting that nothing earlier is lost and that a resumed run equals the uninterrupted one.

In-process runs stop at a known step through a transform that signals its own process
(``user_transforms.signal_at``); kills inside writes need a real process (``fault_runner.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FORENSICS_ON, HELPERS, config, helpers_path, read_jsonl, run_cli, wandb_summary

from hookexp.errors import CheckpointError, RunFilesError
from hookexp.run.loop import run_job as train

STOP = "+hooks.stop={target:'',kind:forward,transform:{_target_:user_transforms.signal_at,step:%d}}"
BASE = ["trainer.max_steps=40", "stats.every=3", "stats.hist_bins=4", "hooks=[grad_noise,record_activations]",
        "hooks.record_activations.every=7", "trainer.accumulate=2", "scheduler=cosine", "scheduler.warmup_steps=4"]


def without_timing(path: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_jsonl(path)]


def same_results(a: Path, b: Path) -> None:
    assert without_timing(a / "metrics.jsonl") == without_timing(b / "metrics.jsonl")
    if (a / "histograms.jsonl").exists():
        assert read_jsonl(a / "histograms.jsonl") == read_jsonl(b / "histograms.jsonl")
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (a, b))
    drop = ("perf/", "runtime_s", "run_dir")
    assert {k: v for k, v in sa.items() if not k.startswith(drop)} == {k: v for k, v in sb.items()
                                                                       if not k.startswith(drop)}


def interrupted_then_resumed(tmp_path: Path, stop_at: int, *overrides: str, base: list[str] = BASE
                             ) -> tuple[Path, Path]:
    """An uninterrupted run, and a run stopped by SIGTERM during step ``stop_at`` then resumed (in-process)."""
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train(config(*base, *overrides, STOP % 10_000), straight)  # the same hook set, never firing
    first = train(config(*base, *overrides, STOP % stop_at), cut)
    assert first["status"] == "interrupted" and first["trainer/steps"] == stop_at + 1
    assert (cut / "checkpoints" / "last.pt").exists()
    resumed = train(config(*base, *overrides, STOP % stop_at, "resume=true"), cut)
    assert resumed["status"] == "finished"
    return straight, cut


def test_sigterm_mid_epoch_then_resume_equals_the_uninterrupted_run_and_keeps_the_records(tmp_path):
    """Records and data workers: with 2 workers the data order after the checkpoint is the
    uninterrupted run's, and records made before the checkpoint survive."""
    straight, cut = interrupted_then_resumed(tmp_path, 16, "data.num_workers=2")  # 23 batches an epoch: mid-epoch
    same_results(straight, cut)
    a = torch.load(straight / "records" / "record_activations.pt", weights_only=True)
    b = torch.load(cut / "records" / "record_activations.pt", weights_only=True)
    assert [(r["target"], r["step"]) for r in a] == [(r["target"], r["step"]) for r in b]
    steps = [r["step"] for r in b]  # 3 ReLUs, each called once per micro-batch (accumulate=2)
    assert sorted(set(steps)) == [0, 7, 14, 21, 28, 35] and steps.count(7) == 6
    assert all(torch.equal(x["value"], y["value"]) for x, y in zip(a, b, strict=True))


def test_a_language_model_on_a_text_file_resumes_mid_epoch_exactly(tmp_path, monkeypatch):
    """SIGTERM mid-epoch, accumulate=2, a cosine schedule, causal_lm on the gpt model."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: hooks change what a network learns.\n" for i in range(60)))
    lm = ["task=causal_lm", "model=gpt", "model.n_layer=1", "model.d_model=32", "data=text_file",
          f"data.path={text}", "data.block_size=32", "data.batch_size=8", "trainer.accumulate=2", "scheduler=cosine",
          "scheduler.warmup_steps=3", "trainer.max_steps=24", "stats.every=4", "stats.hist_bins=4", "hooks=none"]
    straight, cut = interrupted_then_resumed(tmp_path, 7, base=lm)
    same_results(straight, cut)
    rows = read_jsonl(cut / "metrics.jsonl")
    assert {"train/ppl", "grad/blocks.0.attn.qkv.weight/norm"} <= set(rows[0])
    assert any("val/ppl" in r for r in rows)


def test_fp16_resume_keeps_the_grad_scaler_and_its_statistics(tmp_path):
    """The GradScaler's scale is part of the checkpoint."""
    straight, cut = interrupted_then_resumed(tmp_path, 5, "trainer.precision=fp16",
                                             base=["trainer.max_steps=9", "stats.every=2", "hooks=grad_noise"])
    same_results(straight, cut)


def test_a_nan_never_replaces_the_last_good_checkpoint(tmp_path):
    """Under warn, NaN weights from step 3 on are never checkpointed over step 3's state."""
    poison = "+hooks.poison={target:fc1.bias,kind:grad,transform:{_target_:user_transforms.nan_at,step:3}}"
    summary = train(config(poison, "guard.nan_policy=warn", "trainer.max_steps=8", "trainer.checkpoint_every=1"),
                    tmp_path)
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert saved["loop"]["step"] == 3 and all(torch.isfinite(v).all() for v in saved["model"].values())
    assert summary["guard/nonfinite_warnings"] >= 5  # step 3, then each refused checkpoint (steps 4..8)


def test_resuming_from_the_final_checkpoint_writes_the_final_summary(tmp_path):
    """Killed after the last checkpoint, during the shutdown: the resumed run neither drops the last
    validation line nor writes stale values."""
    # the fault runner trains with the default forensics: the in-process resume must too
    args = ["trainer.max_steps=12", "trainer.checkpoint_every=6", "stats.every=4", FORENSICS_ON]
    killed = fault(tmp_path, "kill_in_shutdown", *args, "logger=none", "hydra.run.dir=cut")
    assert killed.returncode == -9 and not (tmp_path / "cut" / "summary.json").exists()
    train(config(*args), tmp_path / "straight")
    assert train(config(*args, "resume=true"), tmp_path / "cut")["status"] == "finished"
    same_results(tmp_path / "straight", tmp_path / "cut")


def test_sigterm_during_shutdown_does_not_cut_it(tmp_path):
    """The summary is written, the run ends as finished, and its W&B run is finished with that
    summary (the signal comes while the plot is drawn, before W&B's finish)."""
    done = fault(tmp_path, "term_in_shutdown", "trainer.max_steps=5", "hydra.run.dir=run")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["signal"] == 15
    wandb = wandb_summary(tmp_path / "run")
    assert wandb["summary"]["status"] == "finished" and wandb["summary"]["signal"] == 15, wandb
    assert wandb["summary"]["val/acc"] == summary["val/acc"]


@pytest.mark.slow  # a child process, ~25 s on a loaded 2-core machine; SIGTERM in the shutdown stays fast
def test_sigterm_just_after_the_run_finished_exits_0(tmp_path):
    """The signal comes as the run logs "finished"; the run is finished and exits 0."""
    done = fault(tmp_path, "term_after_finish", "trainer.max_steps=3", "logger=none", "hydra.run.dir=run")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finished 3 steps (trainer.max_steps=3 reached) in " in done.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "finished"


def fault(cwd: Path, mode: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": helpers_path(), "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, str(HELPERS / "fault_runner.py"), mode, "trainer.progress=false", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_kill_inside_a_checkpoint_write_loses_nothing_and_its_temporary_file_is_removed(tmp_path):
    """The atomic write: the second checkpoint is torn by a kill; resume takes the first."""
    # the fault runner trains with the default forensics: the in-process resume must too
    args = ["trainer.max_steps=30", "trainer.checkpoint_every=10", "stats.every=5", FORENSICS_ON]
    killed = fault(tmp_path, "kill_in_checkpoint:2", *args, "logger=none", "hydra.run.dir=cut")
    assert killed.returncode == -9
    checkpoints = tmp_path / "cut" / "checkpoints"
    assert [p.name for p in checkpoints.glob(".*.tmp")], "the kill should leave a torn temporary file"
    assert torch.load(checkpoints / "last.pt", weights_only=True)["loop"]["step"] == 10
    train(config(*args), tmp_path / "straight")
    assert train(config(*args, "resume=true"), tmp_path / "cut")["status"] == "finished"
    assert not list(checkpoints.glob(".*.tmp"))
    same_results(tmp_path / "straight", tmp_path / "cut")


@pytest.mark.slow  # three runs, one a child; a kill inside a checkpoint write stays fast
def test_a_kill_inside_a_metrics_write_leaves_whole_lines_and_resume_cuts_back_to_the_checkpoint(tmp_path):
    # the fault runner trains with the default forensics: the in-process resume must too
    args = ["trainer.max_steps=30", "trainer.checkpoint_every=8", "stats.every=1", FORENSICS_ON]
    killed = fault(tmp_path, "kill_in_metrics:3", *args, "logger=none", "hydra.run.dir=cut")  # the 3rd flush
    assert killed.returncode == -9
    assert not (tmp_path / "cut" / "metrics.jsonl").read_bytes().endswith(b"\n")  # torn, as a kill leaves it
    train(config(*args), tmp_path / "straight")
    assert train(config(*args, "resume=true"), tmp_path / "cut")["status"] == "finished"
    same_results(tmp_path / "straight", tmp_path / "cut")


def test_a_full_disk_is_one_paragraph_and_leaves_whole_lines_and_a_valid_summary(tmp_path):
    """A full disk, with the file-size limit standing in for it."""
    done = fault(tmp_path, "fsize:60000", "trainer.max_steps=60", "stats.every=1", "logger=none",
                 "hydra.run.dir=run")
    assert done.returncode == 2, done.stderr[-3000:]
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("hookexp: error: cannot write ")
    assert "metrics.jsonl: the file size limit is reached" in error
    assert "Traceback" not in done.stderr
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()  # as many whole lines as fit, and no part of one
    assert 50_000 < len(metrics) <= 60_000 and metrics.endswith(b"\n")
    assert all(json.loads(line) for line in metrics.splitlines())
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_a_checkpoint_that_cannot_be_written_names_the_file_and_keeps_the_last_one(tmp_path, monkeypatch):
    import errno

    from hookexp.run.checkpoint import checkpointer

    train(config("trainer.max_steps=4", "trainer.checkpoint_every=2"), tmp_path)
    good = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    (tmp_path / "summary.json").unlink()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointer.torch, "save", full)
    with pytest.raises(RunFilesError, match=r"^cannot write .*checkpoints.*: the disk is full \(.* free there\)\. "
                                            r"Everything written before is intact"):
        train(config("trainer.max_steps=6", "trainer.checkpoint_every=2", "resume=true"), tmp_path)
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == good
    assert not list((tmp_path / "checkpoints").glob(".*.tmp"))


@pytest.mark.slow  # a child process; a full disk while writing metrics stays fast
def test_a_disk_full_inside_a_checkpoint_write_is_one_paragraph_and_keeps_the_last_checkpoint(tmp_path):
    """ENOSPC inside torch.save (torch wraps it in a RuntimeError) on the 2nd checkpoint (step 4)."""
    done = fault(tmp_path, "enospc_in_checkpoint:2", "trainer.max_steps=6", "trainer.checkpoint_every=2",
                 "logger=none", "hydra.run.dir=run")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "inline_container" not in done.stderr
    error = done.stderr.strip().splitlines()[-1]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert re.fullmatch(
        rf"hookexp: error: cannot write {re.escape(str(checkpoints / 'last.pt'))}: the disk is full \(\d+(\.\d)? "
        r"(B|KiB|MiB|GiB|TiB) free there\)\. Everything written before is intact .*", error), error
    assert torch.load(checkpoints / "last.pt", weights_only=True)["loop"]["step"] == 2  # the previous one, whole
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.pt"]  # no temporary file left


@pytest.mark.parametrize("damage", ["flip", "empty", "no_hooks"])
def test_a_damaged_checkpoint_is_refused_before_anything_is_touched(tmp_path, damage):
    """Flipped bytes (a CRC), an empty file, a checkpoint lacking the hooks' state."""
    train(config("trainer.max_steps=6", "trainer.checkpoint_every=3"), tmp_path)
    path = tmp_path / "checkpoints" / "last.pt"
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        expected = r"its entry '.*' fails its CRC check: the file is corrupt\. The checkpoint before it is"
    elif damage == "empty":
        path.write_bytes(b"")
        expected = r"it is not a readable checkpoint \(BadZipFile"
    else:
        saved = torch.load(path, weights_only=True)
        del saved["hooks"]
        torch.save(saved, path)
        expected = r"it lacks hooks: it is incomplete"
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(CheckpointError, match=r"^resume: cannot resume from .*last\.pt: " + expected):
        train(config("trainer.max_steps=6", "resume=true"), tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_a_finished_run_goes_on_from_its_last_step(tmp_path):
    """With trainer.checkpoint_every set, the final step is checkpointed too: a larger max_steps resumes from
    the end, not from the last multiple of checkpoint_every."""
    args = ["scheduler=constant", "trainer.checkpoint_every=3", "stats.every=1"]
    train(config(*args, "trainer.max_steps=5"), tmp_path / "cut")
    last = tmp_path / "cut" / "checkpoints" / "last.pt"
    assert torch.load(last, weights_only=False)["loop"]["step"] == 5
    train(config(*args, "trainer.max_steps=8", "resume=true"), tmp_path / "cut")
    train(config(*args, "trainer.max_steps=8"), tmp_path / "straight")
    assert torch.load(last, weights_only=False)["loop"]["step"] == 8
    rows = {run: [r for r in without_timing(tmp_path / run / "metrics.jsonl") if "train/loss" in r]
            for run in ("cut", "straight")}
    assert [r["trainer/step"] for r in rows["cut"]] == list(range(8))
    assert rows["cut"] == rows["straight"]  # the same 8 steps (the first run's end adds a validation line)


def test_resuming_with_another_config_lists_the_differences(tmp_path):
    """A changed lr or hook spec is refused; trainer.max_steps may change."""
    train(config("trainer.max_steps=4", "trainer.checkpoint_every=2"), tmp_path / "a")
    with pytest.raises(CheckpointError) as e:
        train(config("trainer.max_steps=4", "optim.lr=0.5", "hooks=clamp_conv", f"resume={tmp_path / 'a'}"),
              tmp_path / "b")
    message = str(e.value)
    assert message.startswith(f"resume: the checkpoint {tmp_path / 'a' / 'checkpoints' / 'last.pt'} was written with "
                              "another config; resuming would mix two runs. Differences: ")
    assert "hooks: {} -> {'clamp_conv': {" in message and "optim.lr: 0.1 -> 0.5" in message
    assert message.endswith("hydra.searchpath, logger.*, optimized_metric may change), or start a new run.")
    longer = train(config("trainer.max_steps=6", "trainer.checkpoint_every=2", f"resume={tmp_path / 'a'}"),
                   tmp_path / "c")
    assert longer["trainer/steps"] == 6
    assert [r["trainer/step"] for r in read_jsonl(tmp_path / "c" / "metrics.jsonl") if "train/loss" in r][:1] == [0]


def test_a_directory_where_the_checkpoint_goes_is_named_with_the_fix(tmp_path):
    """checkpoints/last.pt made a directory (by hand, or a tool): the error says so and how to fix it."""
    (tmp_path / "checkpoints" / "last.pt").mkdir(parents=True)
    with pytest.raises(RunFilesError) as e:
        train(config("trainer.max_steps=4", "trainer.checkpoint_every=2"), tmp_path)
    path = tmp_path / "checkpoints" / "last.pt"
    assert str(e.value) == (f"cannot write {path}: it is a directory, and hookexp writes a file there. Everything "
                            f"written before is intact. Move the directory away or delete it (rm -r {path}), then "
                            f"continue with resume=true hydra.run.dir={tmp_path} (from its last checkpoint).")
    assert path.is_dir() and not (tmp_path / "metrics.jsonl").exists()  # refused before training


def test_sigterm_during_start_up_is_one_line_and_the_requeued_command_starts_from_step_0(tmp_path):
    """A preemptible cluster's SIGTERM before the first step: rc 143 and one line (not rc -15 and nothing); the
    requeued command, resume=true, finds no checkpoint and starts from step 0, saying so."""
    args = ["trainer.max_steps=4", "trainer.checkpoint_every=2", "logger=none", "hydra.run.dir=run"]
    done = fault(tmp_path, "term_in_startup", *args)
    assert done.returncode == 143, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "hookexp: stopped by signal 15 during start-up, before the first step: nothing was trained. Run the same "
        f"command again (with resume=true hydra.run.dir={tmp_path / 'run'} it starts from step 0 if there is no "
        "checkpoint yet).")
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()
    again = run_cli([*args, "resume=true"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resume: {tmp_path / 'run'} holds no checkpoint: starting from step 0" in again.stdout + again.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["trainer/steps"] == 4


def test_resume_where_an_attempt_never_checkpointed_keeps_its_files_aside_and_starts_from_step_0(tmp_path):
    args = ["trainer.max_steps=12", "stats.every=1"]  # no trainer.checkpoint_every: no checkpoint
    killed = fault(tmp_path, "kill_in_metrics:1", *args, "logger=none", "hydra.run.dir=run")  # the first flush
    assert killed.returncode == -9 and not (tmp_path / "run" / "checkpoints" / "last.pt").exists()
    before = {name: (tmp_path / "run" / name).read_bytes() for name in ("metrics.jsonl", "manifest.json")}
    resumed = train(config(*args, "resume=true"), tmp_path / "run")
    assert resumed["status"] == "finished" and resumed["trainer/steps"] == 12
    assert {name: (tmp_path / "run" / "attempt-1" / name).read_bytes() for name in before} == before
    train(config(*args), tmp_path / "straight")
    same_results(tmp_path / "straight", tmp_path / "run")


def test_resume_of_a_finished_run_names_checkpoint_every_or_says_nothing_to_do(tmp_path, caplog):
    from hookexp.errors import RunDirError

    train(config("trainer.max_steps=3"), tmp_path / "plain")  # no checkpoint_every: no checkpoint
    with pytest.raises(RunDirError) as e:
        train(config("trainer.max_steps=6", "resume=true"), tmp_path / "plain")
    assert str(e.value) == (
        f"resume: {tmp_path / 'plain'} holds a run that finished at step 3 without a checkpoint to continue from "
        "(with trainer.checkpoint_every=0 a run checkpoints only when a signal stops it). Start a new run with "
        "trainer.checkpoint_every=N (its last step is checkpointed too, so it can be extended later), or run this "
        "one again with +overwrite=true.")
    train(config("trainer.max_steps=3", "trainer.checkpoint_every=2"), tmp_path / "kept")
    files = {p: p.read_bytes() for p in (tmp_path / "kept").rglob("*") if p.is_file()}
    with caplog.at_level("INFO", logger="hookexp"):
        again = train(config("trainer.max_steps=3", "trainer.checkpoint_every=2", "resume=true"), tmp_path / "kept")
    assert again["status"] == "finished" and again["trainer/steps"] == 3
    assert (f"nothing to do: the run in {tmp_path / 'kept'} finished at step 3; raise trainer.max_steps to "
            "continue") in caplog.text
    assert {p: p.read_bytes() for p in (tmp_path / "kept").rglob("*") if p.is_file()} == files


def test_a_full_disk_under_tensorboard_is_the_same_paragraph_and_keeps_what_was_written(tmp_path):
    """TensorBoard's writer thread hits the limit first (its event file grows faster than metrics.jsonl): one
    paragraph naming the event file, rc 2, no thread traceback; the events and lines before it read back."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator as ea

    done = fault(tmp_path, "fsize:60000", "trainer.max_steps=60", "stats.every=1", "logger=tensorboard",
                 "hydra.run.dir=run")
    assert done.returncode == 2, done.stderr[-3000:]
    (events,) = (tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*")
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"hookexp: error: cannot write {events}: the file size limit is reached. Everything written before is intact")
    assert "Traceback" not in done.stderr and "Error executing job" not in done.stderr
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    assert metrics.endswith(b"\n") and all(json.loads(line) for line in metrics.splitlines())
    acc = ea.EventAccumulator(str(events.parent))
    acc.Reload()
    logged = [r["train/loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    seen = [e.value for e in acc.Scalars("train/loss")]
    assert 5 < len(seen) <= len(logged) and seen == pytest.approx(logged[:len(seen)], rel=1e-6)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_a_full_disk_with_wandb_running_prints_only_hookexps_paragraph(tmp_path):
    """Every log file refuses writes (cli.log, W&B's debug log) and metrics.jsonl hits the limit: no logging
    tracebacks, nothing from W&B's console capture (its finished run's callback), only hookexp's lines."""
    done = fault(tmp_path, "full_disk:60000", "trainer.max_steps=60", "stats.every=1", "hydra.run.dir=run")
    assert done.returncode == 2, done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert "Traceback" not in out and "Logging error" not in out and "UsageError" not in out, out[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"hookexp: error: cannot write {tmp_path / 'run'}")
    assert all(line.startswith(("[", "hookexp: error: ")) for line in out.splitlines() if line.strip()), out[-3000:]
