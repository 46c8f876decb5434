"""The import paths issue 26.5 moved still work: ``hookexp.tasks``, ``hookexp.models``, ``hookexp.data``,
``hookexp.schedules``, ``hookexp.report``, ``hookexp.ablate``, ``hookexp.plots`` and ``hookexp.sinks`` are the
moved modules themselves, a ``_target_`` naming an old path builds the same object, and ``python -m`` on the old
paths runs the moved command."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from hydra.utils import instantiate

MOVED = {
    "hookexp.tasks": "hookexp.workloads.tasks",
    "hookexp.models": "hookexp.workloads.models",
    "hookexp.data": "hookexp.workloads.data",
    "hookexp.schedules": "hookexp.workloads.schedules",
    "hookexp.report": "hookexp.analysis.report",
    "hookexp.ablate": "hookexp.analysis.ablate",
    "hookexp.plots": "hookexp.analysis.plots",
    "hookexp.sinks": "hookexp.run.sinks",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_moved_module(old):
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_names_the_readme_imports_come_from_the_old_paths():
    from hookexp.data import Splits, as_splits, digits, hf_disk, pad_collate
    from hookexp.models import GPT, MLP
    from hookexp.run import sinks
    from hookexp.sinks import Sink, WandbSink
    from hookexp.tasks import CausalLM, Classification
    from hookexp.workloads import data, models, tasks

    assert (Classification, CausalLM) == (tasks.Classification, tasks.CausalLM)
    assert (GPT, MLP) == (models.GPT, models.MLP) and MLP.__module__ == "hookexp.workloads.models"
    assert (Splits, as_splits, digits, hf_disk, pad_collate) == (data.Splits, data.as_splits, data.digits,
                                                                  data.hf_disk, data.pad_collate)
    assert (Sink, WandbSink) == (sinks.Sink, sinks.WandbSink)


def test_an_old_target_builds_what_the_new_one_builds():
    from hookexp.run.sinks import TensorBoardSink, backend_class
    from hookexp.workloads.data.splits import Splits
    from hookexp.workloads.models import SmallCNN

    torch.manual_seed(0)
    old = instantiate({"_target_": "hookexp.models.SmallCNN", "num_classes": 3, "width": 4})
    torch.manual_seed(0)
    new = instantiate({"_target_": "hookexp.workloads.models.SmallCNN", "num_classes": 3, "width": 4})
    assert type(old) is SmallCNN and old.fc2.out_features == 3
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values(), strict=True))
    splits = instantiate({"_target_": "hookexp.data.digits", "val_fraction": 0.25})
    assert type(splits) is Splits and (len(splits.train), len(splits.val)) == (1348, 449)
    assert backend_class({"_target_": "hookexp.sinks.TensorBoardSink"}) is TensorBoardSink


@pytest.mark.parametrize("old", ["hookexp.report", "hookexp.ablate"])
def test_python_dash_m_on_an_old_path_runs_the_moved_command(old):
    done = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    if old == "hookexp.report":
        assert done.stdout.startswith("usage: python -m hookexp.report [-h] [--out OUT]")
    else:
        assert done.stdout.startswith("``python -m hookexp.ablate hooks=[a,b,c] seed=0,1,2 [overrides]``")


def test_a_checkpoint_written_before_the_move_resumes(tmp_path):
    """A run checkpointed before the move names hookexp.models.SmallCNN (...) in its saved config; resuming it
    continues the run instead of refusing a checkpoint "written with another config"."""
    from conftest import config, read_jsonl

    from hookexp.run.checkpoint import atomic_save, config_changes, read_checked
    from hookexp.run.loop import run_job as train

    train(config("trainer.max_steps=2", "trainer.checkpoint_every=2"), tmp_path)
    last = tmp_path / "checkpoints" / "last.pt"
    data = read_checked(last)
    saved = data["config"]
    assert (saved["model"]["_target_"], saved["task"]["_target_"], saved["data"]["dataset"]["_target_"]) == (
        "hookexp.workloads.models.SmallCNN", "hookexp.workloads.tasks.Classification", "hookexp.workloads.data.digits")
    saved["model"]["_target_"], saved["task"]["_target_"] = "hookexp.models.SmallCNN", "hookexp.tasks.Classification"
    saved["data"]["dataset"]["_target_"] = "hookexp.data.digits"  # as written before the move
    atomic_save(data, last)
    (tmp_path / "summary.json").unlink()
    train(config("trainer.max_steps=4", "trainer.checkpoint_every=2", "resume=true"), tmp_path)
    assert read_checked(last)["loop"]["step"] == 4
    assert [r["trainer/step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r] == [0, 1, 3]
    # a target that really differs is still a difference
    assert config_changes({"model": {"_target_": "hookexp.models.MLP"}},
                          {"model": {"_target_": "hookexp.workloads.models.SmallCNN"}}) == [
        "model._target_: 'hookexp.models.MLP' -> 'hookexp.workloads.models.SmallCNN'"]
