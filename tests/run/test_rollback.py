"""Roll back and skip (``guard.spike.action=rollback``, ``guard.nan_policy=rollback``) and replay.

The data: a user's stream of labelled vectors (tests/helpers/poisoned.py) whose batches 23 and 24 hold inputs
x1000; an MLP on it. The reference: the same stream without those two batches.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FORENSICS_ON, config, helpers_path, read_jsonl, run_cli

from hookexp.config import RollbackConfig
from hookexp.errors import ConfigError, RollbackLimitError
from hookexp.run.loop import run_job as train
from hookexp.run.replay import ReplayOptions, replay

DATA = [FORENSICS_ON, "model=mlp", "model.width=64", "model.input_dim=16", "model.output_dim=4",
        "data.dataset._target_=poisoned.make", "+data.dataset.poison=[23,24]", "~data.dataset.val_fraction",
        "~data.dataset.split_seed", "data.batch_size=32", "trainer.max_steps=60", "optim.lr=0.05"]
SPIKES = ["guard.spike.metric=train/loss", "stats.every=1"]
ROLLBACK = [*SPIKES, "guard.spike.action=rollback", "guard.rollback.every=1"]
POISONED = [[0, 23], [0, 24]]


def run(path: Path, *overrides: str) -> dict:
    overrides = (*DATA, *overrides)
    return train(config(*overrides), path, list(overrides))


def without_timing(path: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_jsonl(path)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The poisoned stream with action=rollback and with action=log, and the stream without the poisoned batches."""
    root = tmp_path_factory.mktemp("rollback")
    run(root / "rollback", *ROLLBACK)
    run(root / "log", *SPIKES)
    run(root / "clean", *SPIKES, "+data.dataset.drop=true")
    return {name: root / name for name in ("rollback", "log", "clean")}


def test_rollback_skips_the_poisoned_batches_and_ends_where_the_run_without_them_ends(runs):
    summary = json.loads((runs["rollback"] / "summary.json").read_text())
    clean = json.loads((runs["clean"] / "summary.json").read_text())
    logged = json.loads((runs["log"] / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["trainer/steps"] == 60
    assert summary["guard/skipped"] == POISONED and summary["guard/skipped_batches"] == 2
    assert summary["guard/rollbacks"] == 2
    assert [(r["step"], r["restored"], r["skipped"]) for r in summary["guard/rollback_events"]] == [
        (23, 23, [[0, 23]]), (23, 23, [[0, 24]])]  # the re-done step 23 met batch 24, the second poisoned one
    assert abs(summary["val/loss"] - clean["val/loss"]) <= 0.1 * clean["val/loss"]
    assert logged["val/loss"] > 10 * clean["val/loss"]  # what the poison does without a rollback
    rows = read_jsonl(runs["rollback"] / "spikes.jsonl")
    assert [(r["trainer/step"], r["action"], r["rolled_back"], r["restored_step"], r["skipped"],
             r["steps"][0]["batches"]) for r in rows] == [(23, "rollback", True, 23, [[0, 23]], [23]),
                                                          (23, "rollback", True, 23, [[0, 24]], [24])]
    assert (runs["rollback"] / "checkpoints" / "snapshot_21.pt").exists()  # the oldest kept before the onset
    steps = [r["trainer/step"] for r in read_jsonl(runs["rollback"] / "metrics.jsonl") if "train/loss" in r]
    assert steps == list(range(60))  # monotonic: the re-done step 23 is not logged again
    assert read_jsonl(runs["log"] / "spikes.jsonl")[0]["action"] == "log"


def test_the_run_after_the_skipped_batches_is_the_run_on_the_stream_without_them(runs):
    """The rolled-back run restored the exact state before step 23 and went on with batch 25: from step 23 on it
    trains on what the clean stream gives from its batch 23 on, so its logged losses are the clean run's."""
    a, b = ({r["trainer/step"]: r["train/loss"] for r in read_jsonl(runs[name] / "metrics.jsonl") if "train/loss" in r}
            for name in ("rollback", "clean"))
    assert [a[s] for s in range(60) if s != 23] == [b[s] for s in range(60) if s != 23]


def test_replay_of_the_spike_reproduces_its_logged_loss_bitwise_and_names_the_first_layer(runs, capsys):
    report = replay(runs["rollback"], 23)
    target = runs["rollback"] / "replay" / "step_23"
    assert report["reproduced"] and report["checkpoint_step"] == 21 and report["compared_through"] == 23
    logged = next(r for r in read_jsonl(runs["rollback"] / "metrics.jsonl") if r["trainer/step"] == 23)
    (value,) = [v for v in report["values"] if v["step"] == 23]
    assert value["logged"] == value["replayed"] == logged["train/loss"]
    assert report["first_layer"] in ("flatten", "fc1")  # the poisoned inputs enter there
    assert report["batches"] == [{"step": s, "epoch": 0, "batches": [s]} for s in range(21, 26)]
    assert json.loads((target / "report.json").read_text())["reproduced"] is True
    assert "reproduced exactly" in (target / "report.md").read_text()
    assert "reproduced exactly" in capsys.readouterr().out
    assert not (runs["rollback"] / "replay" / "step_23" / "checkpoints" / "last.pt").exists()
    done = subprocess.run([sys.executable, "-m", "hookexp.run.replay", str(runs["rollback"]), "--step", "23"],
                          capture_output=True, text=True, timeout=300, env={**os.environ,
                                                                           "PYTHONPATH": helpers_path()})
    assert done.returncode == 0, done.stderr
    assert "reproduced exactly" in done.stdout


def test_wandb_gets_the_same_monotonic_steps_as_metrics_jsonl(tmp_path):
    """W&B refuses a step that goes back: the re-done steps are logged to neither."""
    from conftest import wandb_history

    run(tmp_path, *ROLLBACK, "logger=wandb")
    logged = [r["trainer/step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    sent = [r["trainer/step"] for r in wandb_history(tmp_path) if "train/loss" in r]
    assert sent == logged == list(range(60))


def test_sigkill_after_a_rollback_then_resume_equals_the_uninterrupted_run(tmp_path):
    kill = "+hooks.stop={target:'',kind:forward,transform:{_target_:poisoned.kill_once,step:45,marker:'%s'}}"
    args = [*DATA, *ROLLBACK, "trainer.checkpoint_every=10", "logger=none"]
    (tmp_path / "never").touch()
    train(config(*args, kill % (tmp_path / "never")), tmp_path / "straight", args)
    cut = [*args, kill % (tmp_path / "killed")]
    killed = run_cli([*cut, f"hydra.run.dir={tmp_path / 'cut'}"], tmp_path)  # a real process: SIGKILL during step
    assert killed.returncode == -signal.SIGKILL  # 45, after the rollback at step 23
    assert "rolled back to the snapshot of step 23" in killed.stdout + killed.stderr
    assert not (tmp_path / "cut" / "summary.json").exists()
    assert (tmp_path / "killed").exists()  # the kill is spent: the resumed run passes step 45
    resumed = train(config(*cut, "resume=true"), tmp_path / "cut", cut)  # in process, from step 40's checkpoint
    assert resumed["status"] == "finished"
    a, b = tmp_path / "straight", tmp_path / "cut"
    assert without_timing(a / "metrics.jsonl") == without_timing(b / "metrics.jsonl")
    assert read_jsonl(a / "spikes.jsonl") == read_jsonl(b / "spikes.jsonl")
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (a, b))
    drop = ("perf/", "runtime_s", "run_dir")
    assert {k: v for k, v in sa.items() if not k.startswith(drop)} == {
        k: v for k, v in sb.items() if not k.startswith(drop)}
    assert sb["guard/skipped"] == POISONED


def test_a_loss_of_an_undone_step_landing_after_the_rollback_is_not_judged(runs, tmp_path, monkeypatch):
    """On CUDA a step's loss reaches the host a step later (here forced on the CPU): when the run rolls back, the
    loss of the last undone step is still on its way. It describes a step that no longer exists: dropped, the run
    rolls back as when read at once (before, it was judged after the restore, a second spike that rolled back again
    and skipped the clean batch 25)."""
    from hookexp.telemetry.spike import Deferred

    class Landed:  # a CUDA event whose copy is done once the next step's values were sent
        def __init__(self, deferred: Deferred):
            self.deferred, self.sent = deferred, deferred.sent

        def query(self) -> bool:
            return self.deferred.sent > self.sent

        def synchronize(self) -> None:
            pass

    def put(self, step, values):
        self.sent = getattr(self, "sent", 0) + 1
        self.waiting.append((step, values.detach().reshape(-1), Landed(self)))

    monkeypatch.setattr(Deferred, "put", put)
    summary = run(tmp_path / "late", *ROLLBACK)
    at_once = json.loads((runs["rollback"] / "summary.json").read_text())
    assert summary["guard/skipped"] == POISONED and summary["guard/rollbacks"] == 2
    assert summary["guard/rollback_events"] == at_once["guard/rollback_events"]
    assert summary["val/loss"] == at_once["val/loss"]


def test_a_non_finite_step_rolls_back_and_skips_its_batch(tmp_path):
    """Batch 30's inputs overflow to inf: the guard skips that update and the run rolls back to step 30's snapshot."""
    summary = run(tmp_path / "nan", "guard.nan_policy=rollback", "guard.rollback.every=5", "data.dataset.poison=[30]",
                  "+data.dataset.factor=1e39")
    assert summary["status"] == "finished" and summary["guard/rollbacks"] == 1
    (event,) = summary["guard/rollback_events"]
    assert (event["step"], event["reason"], event["restored"]) == (30, "non-finite", 30)
    assert summary["guard/skipped"] == [[0, 30]]
    steps = [r["trainer/step"] for r in read_jsonl(tmp_path / "nan" / "metrics.jsonl") if "train/loss" in r]
    assert steps == sorted(set(steps))


def test_skip_n_skips_that_many_batches_from_the_restored_snapshot(tmp_path):
    summary = run(tmp_path / "skip", *ROLLBACK, "guard.rollback.skip=3")
    assert summary["guard/rollbacks"] == 1 and summary["guard/skipped"] == [[0, 23], [0, 24], [0, 25]]
    assert summary["status"] == "finished" and summary["trainer/steps"] == 60


def test_max_rollbacks_stops_the_run_naming_the_steps(tmp_path):
    with pytest.raises(RollbackLimitError) as stopped:
        run(tmp_path / "max", *ROLLBACK, "guard.rollback.max=1")
    assert str(stopped.value).startswith("spike of train/loss at step 23, after 1 rollbacks (guard.rollback.max=1): "
                                         "step 23 (to 23). The run stops here")


def test_rollback_settings_are_checked_with_the_key_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as bad:
        RollbackConfig(every=0)
    assert str(bad.value) == "guard.rollback.every: must be a whole number of at least 1, got 0."
    with pytest.raises(ConfigError) as bad:
        RollbackConfig(skip=-2)
    assert str(bad.value).startswith("guard.rollback.skip: must be null (skip every batch from the restored snapshot")
    with pytest.raises(ConfigError) as bad:
        run(tmp_path / "a", "guard.spike.action=rewind", "guard.spike.metric=train/loss")
    assert str(bad.value).startswith("guard.spike.action: unknown action 'rewind'. Use one of: log, rollback")
    with pytest.raises(ConfigError) as bad:
        run(tmp_path / "b", "guard.spike.action=rollback")
    assert str(bad.value).startswith("guard.spike.action: rollback needs the spike recorder: set guard.spike.metric")
    with pytest.raises(ConfigError) as bad:
        run(tmp_path / "c", *ROLLBACK, "guard.rollback.keep=0")
    assert str(bad.value) == "guard.rollback.keep: must be a whole number of at least 1, got 0."


def test_rollback_at_the_default_cadence_skips_the_poisoned_batches(tmp_path):
    """stats.every=10 and guard.rollback's defaults: the spike at step 23 is seen at once, not at the log step."""
    summary = run(tmp_path / "default", "guard.spike.metric=train/loss", "guard.spike.action=rollback")
    assert summary["guard/rollbacks"] >= 1
    assert all(b in summary["guard/skipped"] for b in POISONED)
    assert all(i <= 24 for _, i in summary["guard/skipped"])


def test_under_ddp_every_rank_rolls_back_together_and_the_replicas_stay_in_sync(tmp_path):
    from test_distributed import torchrun

    done = torchrun([*DATA, *ROLLBACK, "logger=none", "hydra.run.dir=ddp"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["dist/world_size"] == 2 and summary["dist/params_in_sync"] is True
    assert summary["guard/skipped"] == POISONED and summary["guard/rollbacks"] == 2  # each rank streams every batch
    steps = [r["trainer/step"] for r in read_jsonl(tmp_path / "ddp" / "metrics.jsonl") if "train/loss" in r]
    assert steps == list(range(60))


def test_compiled_with_forensics_the_run_rolls_back_as_eager_with_no_break_nor_recompile_of_hookexps(runs, tmp_path):
    """trainer.compile with the eager backend (the same kernels: eager's values exactly), forensics on: the spikes,
    their forensics onsets and the rollbacks are the eager run's, with no graph break and no recompile from
    hookexp's hooks across the restores."""
    import torch._dynamo
    from torch._dynamo.utils import counters, guard_failures

    import hookexp

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    summary = run(tmp_path / "compiled", *ROLLBACK, "trainer.compile=true", "trainer.compile_backend=eager")
    eager = json.loads((runs["rollback"] / "summary.json").read_text())
    assert summary["guard/rollback_events"] == eager["guard/rollback_events"]
    assert summary["val/loss"] == eager["val/loss"]
    assert read_jsonl(tmp_path / "compiled" / "spikes.jsonl") == read_jsonl(runs["rollback"] / "spikes.jsonl")
    assert sum(counters["graph_break"].values()) == 0
    package = str(Path(hookexp.__file__).resolve().parent)
    assert [str(r) for failures in guard_failures.values() for r in failures if package in str(r)] == []


@pytest.mark.slow
def test_a_compiled_run_rolls_back_to_the_same_result_as_an_eager_one(runs, tmp_path):
    summary = run(tmp_path / "compiled", *ROLLBACK, "trainer.compile=true", "guard.forensics.window=0")
    eager = json.loads((runs["rollback"] / "summary.json").read_text())
    assert summary["guard/skipped"] == POISONED
    assert summary["val/loss"] == pytest.approx(eager["val/loss"], rel=1e-5)


def test_replay_at_the_runs_own_cadence_compares_its_multi_step_log_lines(tmp_path):
    """stats.every=10: the spike is judged at its own step, and its row goes out with the next log line, which
    describes several steps. A replay at stats.every=1 compares only the single-step lines after it; one at the
    run's cadence (every=None) compares that multi-step line too."""
    summary = run(tmp_path / "run", "guard.spike.metric=train/loss", "guard.spike.window=2")
    assert summary["guard/spikes"] >= 1
    (spike, *_) = read_jsonl(tmp_path / "run" / "spikes.jsonl")
    steps = [s["step"] for s in spike["steps"]]
    logged = steps[-1]  # the log step that wrote the spike's row: it describes all of these steps
    assert spike["trainer/step"] in steps and len(steps) > 1 and logged % 10 != 0  # judged between log steps
    fine = replay(tmp_path / "run", logged, ReplayOptions(out=tmp_path / "fine", quiet=True))
    assert fine["reproduced"] and {v["step"] for v in fine["values"]} == {logged + 1, logged + 2}
    assert {"step": logged, "steps": len(steps)} in fine["periods_not_compared"]
    same = replay(tmp_path / "run", logged, ReplayOptions(out=tmp_path / "same", every=None, quiet=True))
    assert same["reproduced"] and {v["step"] for v in same["values"]} >= {logged, logged + 1, logged + 2}
    (line,) = [v for v in same["values"] if v["step"] == logged]
    assert line["logged"] == line["replayed"]


def test_replay_main_exits_0_when_reproduced_and_2_with_one_paragraph_when_there_is_no_checkpoint(runs, capsys):
    from hookexp.run.replay import main

    assert main([str(runs["rollback"]), "--step", "23", "--after", "0"]) == 0
    assert "reproduced exactly" in capsys.readouterr().out
    assert main([str(runs["rollback"]), "--step", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hookexp replay: --step: no checkpoint of {runs['rollback']} is at or before step 5 (the "
                          "run has: snapshot_21.pt (step 21)). A spike writes the snapshot before it")
    assert main([str(runs["rollback"] / "nothing"), "--step", "5"]) == 2
    assert "is not a hookexp run directory (no metrics.jsonl)" in capsys.readouterr().err
    last = max(r["trainer/step"] for r in read_jsonl(runs["rollback"] / "metrics.jsonl"))
    assert main([str(runs["rollback"]), "--step", str(last + 440)]) == 2  # past the run: it replayed its end
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"hookexp replay: --step: step {last + 440} is past the run's last step: {runs['rollback']} logged steps up "
        f"to {last}. Give a step the run took (0 to {last}).")
    assert not (runs["rollback"] / "replay" / f"step_{last + 440}").exists()
