"""The logger backends behind hookexp.run.sinks.Sink: TensorBoard's event files read back against the
local files, a missing tensorboard package, an unknown ``logger._target_``, and a resumed W&B run."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_jsonl

from hookexp import ConfigError, MissingExtraError
from hookexp.run import compose
from hookexp.run import train as run_train
from hookexp.run.rundir import results_in
from hookexp.run.sinks import RunInfo, TensorBoardSink, check_logger

MISSING = ("logger=tensorboard (hookexp.run.sinks.TensorBoardSink) needs tensorboard, which is not installed. "
           "Install the extra: pip install 'hookexp[tensorboard]'")


def number(value: float | str) -> float:
    return float(value)  # metrics.jsonl writes NaN and Inf as "nan", "inf"


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.grad_norm_plot
def test_tensorboard_holds_the_local_files_scalars_histograms_and_the_hooks_table(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator as ea

    cfg = compose("logger=tensorboard", "hooks=clamp_conv", "trainer.max_steps=5", "stats.every=2",
                  "stats.hist_bins=8", "trainer.eval_every=3", "trainer.progress=false")
    run = tmp_path / "run"
    run_train(cfg, run)
    acc = ea.EventAccumulator(str(run / "tensorboard"), size_guidance={ea.TENSORS: 0, ea.HISTOGRAMS: 0, ea.IMAGES: 0})
    acc.Reload()
    tags = acc.Tags()

    # every value of metrics.jsonl at its step, as the classic scalars every reader sees (float32), and nothing else
    expected = {(key, row["trainer/step"]): number(value) for row in read_jsonl(run / "metrics.jsonl")
                for key, value in row.items() if key != "trainer/step"}
    assert not [t for t in tags["tensors"] if not t.endswith("/text_summary")]  # no tensor summaries
    found = {(tag, e.step): e.value for tag in tags["scalars"] for e in acc.Scalars(tag)}
    assert {k for k, _ in expected} >= {"train/loss", "val/loss", "grad/conv1.weight/norm", "hook/clamp_conv/calls"}
    assert found.keys() == expected.keys()
    f32 = {k: float(np.float32(v)) for k, v in expected.items()}
    assert all(same(found[k], f32[k]) for k in expected), [k for k in expected if not same(found[k], f32[k])]
    assert [e.step for e in acc.Scalars("val/acc")] == [2, 4]

    # the histograms of histograms.jsonl: its edges as the bucket limits, its counts after an empty first bucket
    hist_rows = read_jsonl(run / "histograms.jsonl")
    assert [r["trainer/step"] for r in hist_rows] == [0, 2, 4]
    assert sorted(tags["histograms"]) == sorted(k for k in hist_rows[0] if k != "trainer/step")
    for tag in tags["histograms"]:
        events = acc.Histograms(tag)
        assert [e.step for e in events] == [0, 2, 4]
        for event, row in zip(events, hist_rows, strict=True):
            h = event.histogram_value
            assert list(h.bucket_limit) == row[tag]["bins"] and list(h.bucket) == [0.0, *row[tag]["values"]]
            assert h.num == sum(row[tag]["values"]) and (h.min, h.max) == (row[tag]["bins"][0], row[tag]["bins"][-1])

    # the hooks table and the config as text, the plot as an image
    (hooks,) = acc.Tensors("hooks/text_summary")
    text = hooks.tensor_proto.string_val[0].decode()
    assert text.splitlines()[0] == "| spec | kind | transform | args | enabled | targets |"
    assert text.splitlines()[2] == ('| clamp_conv | output_grad | clamp | {"min": -1e-05, "max": 1e-05} | True | '
                                    'conv1, conv2 |')
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config)["logger"]["_target_"] == "hookexp.run.sinks.TensorBoardSink"
    (image,) = acc.Images("plots/grad_norms")
    assert image.step == 4 and image.width > 100 and image.height > 100
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"
    assert not (run / "wandb").exists()
    (tmp_path / "only_events").mkdir()
    (run / "tensorboard").rename(tmp_path / "only_events" / "tensorboard")  # event files alone mark a run too
    assert results_in(tmp_path / "only_events") == ["tensorboard"]  # (+overwrite=true deletes them)


def test_a_missing_tensorboard_package_names_the_extra_before_the_run_starts(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    cfg = compose("logger=tensorboard", "trainer.max_steps=2", "trainer.progress=false")
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as Python marks a package that failed to import
    with pytest.raises(MissingExtraError) as e:
        check_logger(cfg.logger)
    assert e.value.extra == "tensorboard" and str(e.value).startswith(MISSING)
    with pytest.raises(MissingExtraError, match=r"^logger=tensorboard .* pip install 'hookexp\[tensorboard\]'"):
        run_train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything was built or written
    with pytest.raises(MissingExtraError, match=r"^logger=tensorboard "):
        TensorBoardSink(RunInfo(tmp_path))
    assert not (tmp_path / "tensorboard").exists()


def test_an_unknown_logger_target_is_refused_naming_the_key():
    cfg = compose("logger._target_=hookexp.sinks.Tensorboard")
    with pytest.raises(ConfigError) as e:
        check_logger(cfg.logger)
    assert e.value.key == "logger._target_"
    assert str(e.value).startswith("logger._target_: cannot import the logger backend 'hookexp.sinks.Tensorboard': "
                                   "module 'hookexp' has no attribute 'sinks'.")
    assert str(e.value).endswith("Use logger=wandb, logger=tensorboard or logger=none, or the import path of a class "
                                 "that implements hookexp.run.sinks.Sink (local files are always written).")
    with pytest.raises(ConfigError, match=r"^logger\._target_: 'os\.path\.join' is a function, not a class\. Use "):
        check_logger(compose("logger._target_=os.path.join").logger)


def wandb_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def run_id(run: Path) -> str:
    """The W&B run id of an offline run's directory, ``offline-run-<date>_<time>-<id>``; a second one started in
    the same second as the first gets a ``-1`` after it."""
    return re.fullmatch(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)(-\d+)?", run.name).group(1)


def wandb_rows(run: Path) -> list[dict]:
    out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(run)],
                         capture_output=True, text=True, timeout=120, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return [r["history"]["item"] for r in rows if r.get("type") == "history"]


def test_a_resumed_run_continues_its_wandb_run_and_histograms_share_their_steps_row(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch):
    """The checkpoint keeps the W&B run id, name and group (the sinks' resume state); the resumed run logs into the
    same W&B run, under the name and group its first part was given (a multirun job's, set as it started) where
    its config names none. A log step's histograms and scalars are one W&B history row, as they are one step of
    the local files."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")

    def cfg(steps: int, *named: str):
        return compose("logger=wandb", f"trainer.max_steps={steps}", "trainer.checkpoint_every=2", "stats.every=1",
                       "stats.hist_bins=4", "trainer.eval_every=0", "trainer.progress=false", *named)

    def identity(run: Path) -> tuple[str | None, str | None]:
        out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(run)],
                             capture_output=True, text=True, timeout=120, check=True)
        (record,) = [r["run"] for r in map(json.loads, filter(str.strip, out.stdout.splitlines()))
                     if r.get("type") == "run"]
        return record.get("display_name"), record.get("run_group")

    run = tmp_path / "run"
    run_train(cfg(2, "logger.name=job_seed1_lr0.1", "logger.group=sweep_a"), run)
    (first,) = wandb_runs(run)
    kept = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["sinks"]
    assert kept == {"hookexp.run.sinks.WandbSink": {"id": run_id(first), "name": "job_seed1_lr0.1",
                                                    "group": "sweep_a"}}
    assert identity(first) == ("job_seed1_lr0.1", "sweep_a")
    history = [r for r in wandb_rows(first) if "plots/grad_norms._type" not in r]
    local = read_jsonl(run / "metrics.jsonl")
    assert [r["trainer/step"] for r in history] == [r["trainer/step"] for r in local] == [0, 1, 1]  # the last: val
    assert [(r.get("grad/conv1.weight/hist._type"), "train/loss" in r) for r in history] == [
        ("histogram", True), ("histogram", True), (None, False)]

    run_train(cfg(4), run, resume=True)
    second = [p for p in wandb_runs(run) if p != first]
    assert [run_id(p) for p in second] == [run_id(first)]  # the same W&B run id
    assert identity(second[0]) == ("job_seed1_lr0.1", "sweep_a")
    steps = [r["trainer/step"] for r in wandb_rows(second[0]) if "plots/grad_norms._type" not in r]
    assert steps == [2, 3, 3]
