"""guard.spike: a spike injected at a known step is logged every step after, recorded, checkpointed, and written
to spikes.jsonl with the steps and batches that led to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FORENSICS_ON, HELPERS, config, read_jsonl

from hookexp.config import SpikeConfig
from hookexp.errors import ConfigError
from hookexp.run.loop import run_job as train
from hookexp.telemetry.spike import SpikeRecorder

SPIKE = ["guard.spike.metric=train/loss", "guard.spike.window=2", "guard.spike.threshold=3", "guard.spike.steps=3",
         "guard.spike.record=[rec]", "+hooks.rec={target:fc2,kind:forward,transform:record}",
         "+hooks.boom={target:fc2,kind:forward,transform:{_target_:user_transforms.spike_at,step:13}}"]


SPECS = [{"spec": "rec", "transform": "record", "enabled": True},
         {"spec": "clamp", "transform": "clamp", "enabled": True}]  # the hook table's rows


@pytest.fixture(autouse=True)
def user_transforms(monkeypatch):
    monkeypatch.syspath_prepend(str(HELPERS))


def test_a_spike_is_seen_at_its_step_between_log_steps_then_logged_recorded_checkpointed_and_written(tmp_path: Path):
    """Noisy logits at step 13; log steps every 5: the recorder judges every step, so step 13 is the spike, and the
    steps after it log every step."""
    summary = train(config(*SPIKE, FORENSICS_ON, "stats.every=5", "trainer.max_steps=25", "trainer.accumulate=2",
                           "data.batch_size=32"), tmp_path)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["trainer/step"] for r in rows] == [0, 5, 10, 14, 15, 16, 20, 24]
    (spike,) = read_jsonl(tmp_path / "spikes.jsonl")
    assert spike["trainer/step"] == 13 and spike["metric"] == "train/loss" and spike["value"] > 3 * spike["median"]
    assert spike["median"] < 3 < 30 < spike["value"]  # the step's own loss, not a mean over the log period
    assert spike["onset"] == 13 and spike["first"][0]["target"] == "fc2"  # the noisy logits: fc2's output
    per_epoch = 46  # the training digits in batches of 32
    want = [{"step": s, "epoch": 2 * s // per_epoch, "batches": [2 * s % per_epoch, 2 * s % per_epoch + 1]}
            for s in range(11, 15)]
    assert spike["steps"] == want
    records = torch.load(tmp_path / "records" / "rec.pt", weights_only=True)
    assert sorted({r["step"] for r in records}) == [14, 15, 16]  # the record spec acts only in the spike's window
    ckpt = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)  # the spike's (none other was due)
    assert ckpt["loop"]["step"] == 15 and ckpt["telemetry"]["spike"]["until"] == 17
    assert summary["guard/spikes"] == 1 and summary["status"] == "finished"


def test_the_recorder_compares_with_the_median_of_its_window():
    rec = SpikeRecorder(SpikeConfig(metric="m", window=3, threshold=2.0, steps=2))
    assert [rec.observe({"m": v}, s) for s, v in enumerate([1.0, 5.0, 1.2])] == [None] * 3  # filling the window
    assert rec.observe({"m": 2.3}, 3) is None  # median 1.2: 2.3 < 2.4
    spike = rec.observe({"m": 9.0}, 4)
    assert (spike.step, spike.value, spike.median) == (4, 9.0, 2.3)  # the window is [5.0, 1.2, 2.3] now
    assert rec.logging_every_step(5) and rec.logging_every_step(6) and not rec.logging_every_step(7)
    assert list(rec.history) == [1.2, 2.3, 9.0]  # the spike's value enters the window
    assert rec.observe({"m": 100.0}, 6) is None  # inside the spike's steps: not compared, but remembered
    assert rec.observe({"m": float("nan")}, 7) is None and list(rec.history) == [2.3, 9.0, 100.0]


def test_a_lasting_rise_is_one_spike_and_the_median_follows_it():
    """A loss at 0.17 that jumps to 0.3-2.8 and stays there (a collapse to chance) is one spike; the
    median moves up to the new level with the values logged during and after the spike's steps."""
    rec = SpikeRecorder(SpikeConfig(metric="m", window=5, threshold=3.0, steps=3))
    before = [0.17, 0.18, 0.1746, 0.16, 0.19]
    after = [2.8, 2.1, 0.3, 1.9, 2.5, 1.7, 2.2, 0.9, 2.6, 2.0, 1.8, 2.4, 2.3, 1.1, 2.7]
    spikes = [rec.observe({"m": v}, s) for s, v in enumerate(before + after)]
    found = [(x.step, x.value, x.median) for x in spikes if x is not None]
    assert found == [(5, 2.8, 0.1746)] and rec.found == 1
    assert sorted(rec.history)[2] == 2.3  # the median of the last 5: [1.8, 2.4, 2.3, 1.1, 2.7]
    assert rec.observe({"m": 2.3 * 3.5}, len(before + after)) is not None  # a real spike on the new level still is


@pytest.mark.parametrize(("metric", "fix"), [
    ("train/los", "Did you mean 'train/loss'"),
    ("hook/rec/calls", "Use one of: train/loss, train/acc, grad/global_norm"),  # counted per rank: ranks would differ
])
def test_a_metric_the_run_does_not_log_alike_on_every_rank_is_refused(tmp_path: Path, metric: str, fix: str):
    with pytest.raises(ConfigError, match=rf"^guard\.spike\.metric: '{metric}' is not a metric every log step .*{fix}"):
        train(config(*SPIKE, f"guard.spike.metric={metric}", "trainer.max_steps=2"), tmp_path)
    with pytest.raises(ConfigError, match=r"^guard\.spike\.metric: 'grad/global_norm' is not a metric"):
        train(config(*SPIKE, "guard.spike.metric=grad/global_norm", "stats.grads=null", "trainer.max_steps=2"),
              tmp_path / "nograds")


def test_bad_spike_settings_name_their_key():
    with pytest.raises(ConfigError, match=r"^guard\.spike\.threshold: must be above 1"):
        SpikeConfig(metric="m", threshold=0.5)
    for window in (0, True):
        with pytest.raises(ConfigError, match=r"^guard\.spike\.window: must be a whole number of at least 1"):
            SpikeConfig(metric="m", window=window)
    with pytest.raises(ConfigError, match=r"^guard\.spike\.record: 'recc' cannot be recorded on a spike: it is not a "
                                          r"hook spec of this run.*Did you mean 'rec'"):
        SpikeRecorder(SpikeConfig(metric="m", record=["recc"]), specs=SPECS)
    with pytest.raises(ConfigError, match=r"'clamp' cannot be recorded on a spike: its transform is not 'record'"):
        SpikeRecorder(SpikeConfig(metric="m", record=["clamp"]), specs=SPECS)


def test_the_recorder_judges_from_its_fifth_value_not_a_full_window():
    rec = SpikeRecorder(SpikeConfig(metric="m"))  # window 20
    assert [rec.observe({"m": v}, s) for s, v in enumerate([2.0, 1.9, 1.8, 1.9, 1.7])] == [None] * 5
    spike = rec.observe({"m": 9.0}, 5)
    assert (spike.step, spike.value, spike.median, spike.onset) == (5, 9.0, 1.9, None)


def test_poisoned_inputs_early_in_a_run_are_a_spike_at_their_step(tmp_path: Path):
    """Two batches' inputs x1000 at steps 7-8 of an MLP, at the defaults (stats.every=10, window 20): the spike is
    the poisoned step, named by forensics, not a log step 20 steps later."""
    poison = "+hooks.poison={target: fc1, kind: forward_pre, transform: scale, args: {factor: 1000.0}, " \
             "start_step: 7, end_step: 9}"
    summary = train(config("model=mlp", FORENSICS_ON, "trainer.max_steps=12", "guard.spike.metric=train/loss", poison),
                    tmp_path)
    (spike,) = read_jsonl(tmp_path / "spikes.jsonl")
    assert spike["trainer/step"] == spike["onset"] == 7 and summary["guard/spikes"] == 1
    assert spike["first"][0]["target"] == "fc1" and spike["first"][0]["input"] == "abnormal"  # the data itself
