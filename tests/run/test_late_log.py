"""A log step's record landed with the next step (CUDA's default where nothing acts on it at once), run on the CPU
by forcing it: the same records as read at once, in the same order, also across validation, checkpoints and a
resumed run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import config, read_jsonl

from hookexp.run import trainer as trainer_module
from hookexp.run.loop import run_job as train
from hookexp.run.sinks import LocalFiles

EVERY_STAT = ("stats.grads=*", "stats.activations=relu*", "stats.hist_bins=8", "trainer.eval_every=4",
              "trainer.checkpoint_every=5")


def records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl without its wall times, and histograms.jsonl."""
    metrics = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_jsonl(run_dir / "metrics.jsonl")]
    return metrics, read_jsonl(run_dir / "histograms.jsonl")


def run(tmp_path: Path, name: str, late: bool, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> Path:
    """One run in tmp_path/name; ``late``: log steps land with the next step, as on CUDA."""
    with monkeypatch.context() as m:
        m.setattr(trainer_module, "lands_late", lambda *args: late)
        train(config(*EVERY_STAT, *overrides), tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("every", [1, 3])
def test_records_landed_a_step_late_are_those_read_at_once(tmp_path, monkeypatch, every):
    landed: list[tuple[int, int]] = []  # (the step a record describes, the trainer's step count as it is written)
    log = LocalFiles.log

    def spy(self, metrics, step, histograms=None):
        if "train/loss" in metrics:
            landed.append((step, spy.trainer.loop.step))
        return log(self, metrics, step, histograms)

    init = trainer_module.Trainer.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        spy.trainer = self

    monkeypatch.setattr(trainer_module.Trainer, "__init__", keep)
    monkeypatch.setattr(LocalFiles, "log", spy)
    now = run(tmp_path, "now", False, monkeypatch, f"stats.every={every}", "trainer.max_steps=12")
    at_once, landed[:] = list(landed), []
    late = run(tmp_path, "late", True, monkeypatch, f"stats.every={every}", "trainer.max_steps=12")
    assert records(late) == records(now)
    steps = [s for s, _ in at_once]
    assert steps == [s for s, _ in landed] and steps[-1] == 11 and len(steps) == (12 if every == 1 else 5)
    assert all(count == s + 1 for s, count in at_once)  # read at once: within its own step
    # late: within the next step, or before the validation (steps 3, 7, 11) or checkpoint (4, 9) that follows it
    assert [count - s for s, count in landed] == [1 if s in (3, 4, 7, 9, 11) else 2 for s in steps]


@pytest.mark.parametrize("late", [False, True])
def test_a_resumed_run_lands_every_record_once(tmp_path, monkeypatch, late):
    """Stopped after step 5 (checkpoint at step 5) and resumed to 10: the records of the run read at once."""
    from hookexp.run import train as run_train

    def resumed(name: str, late: bool) -> Path:
        part = run(tmp_path, name, late, monkeypatch, "stats.every=2", "trainer.max_steps=6")
        with monkeypatch.context() as m:
            m.setattr(trainer_module, "lands_late", lambda *args: late)
            run_train(config(*EVERY_STAT, "stats.every=2", "trainer.max_steps=10"), part, resume=True)
        return part

    metrics, histograms = records(resumed("late" if late else "now", late))
    assert (metrics, histograms) == records(resumed("reference", False))
    steps = [r["trainer/step"] for r in metrics if "train/loss" in r]
    assert steps == [0, 2, 4, 5, 6, 8, 9]  # each once: step 5 ended the first run


@pytest.mark.parametrize(("change", "late"), [
    ({}, True), ({"device": torch.device("cpu")}, False), ({"enabled": True}, False), ({"goal": "val/acc>=0.9"}, False),
    ({"rollback": True}, False)])
def test_records_land_late_on_cuda_only_where_nothing_acts_on_them_at_once(change, late):
    parts = SimpleNamespace(device=change.get("device", torch.device("cuda")), goal=change.get("goal"))
    recorder = SimpleNamespace(enabled=change.get("enabled", False))
    rollback = SimpleNamespace(enabled=change.get("rollback", False))
    assert trainer_module.lands_late(parts, recorder, rollback) is late


@pytest.fixture
def flags_on_their_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard's flags as on a GPU (``raise``: read a step later), here read only when waited for."""
    from hookexp.telemetry.guard import NonFiniteGuard
    from hookexp.telemetry.spike import Deferred

    class OnItsWay:  # a CUDA event whose copy is not done until waited for
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            pass

    init = NonFiniteGuard.__init__

    def deferred(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.sync = False

    monkeypatch.setattr(NonFiniteGuard, "__init__", deferred)
    monkeypatch.setattr(Deferred, "put", lambda self, step, values: self.waiting.append(
        (step, values.detach().reshape(-1), OnItsWay())))


NAN_AT = "+hooks.poison={target:fc1.bias,kind:grad,transform:{_target_:user_transforms.nan_at,step:%d}}"
STOP_AT = "+hooks.stop={target:'',kind:forward,transform:{_target_:user_transforms.signal_at,step:%d}}"


@pytest.mark.parametrize("late", [False, True])
def test_a_non_finite_last_step_is_raised_as_when_read_at_once(tmp_path, monkeypatch, flags_on_their_way, late):
    """A NaN gradient at the last step fails the run, landed late or not: the flags on their way are read before
    the final validation."""
    from hookexp.errors import NonFiniteError

    with pytest.raises(NonFiniteError, match="at step 5"):
        run(tmp_path, "run", late, monkeypatch, NAN_AT % 5, "guard.nan_policy=raise", "stats.every=2",
            "trainer.max_steps=6", "trainer.checkpoint_every=0", "trainer.eval_every=0")


def test_a_signal_at_a_non_finite_step_reads_its_flag_before_the_checkpoint(tmp_path, monkeypatch, flags_on_their_way):
    """SIGTERM during the step whose gradient is NaN, no log step since: the flag on its way is read before the
    stop's checkpoint, so the run fails naming that step and the policy's fix, and writes no checkpoint."""
    from hookexp.errors import NonFiniteError

    with pytest.raises(NonFiniteError) as e:
        run(tmp_path, "run", True, monkeypatch, NAN_AT % 3, STOP_AT % 3, "guard.nan_policy=raise", "stats.every=100",
            "trainer.max_steps=12", "trainer.checkpoint_every=0", "trainer.eval_every=0")
    assert str(e.value).startswith("non-finite loss or gradient at step 3: ") and "guard.nan_policy=skip_step" in \
        str(e.value) and "No checkpoint was written" not in str(e.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(("late", "overrides", "steps"), [
    (False, (), 5), (True, (), 5), (True, ("trainer.checkpoint_every=0",), 6),
    (True, ("trainer.checkpoint_every=0", "trainer.eval_every=5"), 5)])
def test_ranks_agree_to_stop_on_a_vote_that_lands_with_the_log_steps_record(tmp_path, monkeypatch, late, overrides,
                                                                             steps):
    """Several ranks (a DDP group of one, counted as several) stop after the same step, with one checkpoint there.
    SIGTERM during step 3, log steps 0, 2, 4: read at once, the ranks agree at log step 4 (``Dist.any``, a sync);
    landing late, no rank reads anything at log step 4: the vote travels with its record and every rank stops
    after the step where it lands: step 4 where the checkpoint or the validation after it lands it, else step 5."""
    from hookexp.run.checkpoint import Checkpointer
    from hookexp.run.distributed import Dist

    monkeypatch.setattr(Dist, "enabled", property(lambda self: self.strategy != "single"))
    if late:
        monkeypatch.setattr(Dist, "any", lambda *args: pytest.fail("a log step read the ranks' vote at once"))
    saved: list[int] = []
    save = Checkpointer.save
    monkeypatch.setattr(Checkpointer, "save", lambda self, loop, *args: saved.append(loop.step) or save(
        self, loop, *args))
    with monkeypatch.context() as m:
        m.setattr(trainer_module, "lands_late", lambda *args: late)
        summary = train(config(*EVERY_STAT, STOP_AT % 3, "trainer.strategy=ddp", "stats.every=2",
                               "trainer.max_steps=12", *overrides), tmp_path)
    assert summary["status"] == "interrupted" and summary["trainer/steps"] == steps
    assert saved == [steps]  # the stop's checkpoint, written once (no step and no checkpoint after one due there)
    assert summary["dist/world_size"] == 1  # the group of one, counted as several ranks
    logged = [r["trainer/step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert logged == [0, 2, 4]
