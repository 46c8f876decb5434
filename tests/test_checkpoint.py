"""Checkpoints and resume: SIGTERM mid-run, resume, and the metrics equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TESTS, read_jsonl, run_cli

RUN = ["hooks=[grad_noise,zero_fc_bias]", "repro.deterministic=true", "trainer.max_steps=150", "stats.every=5",
       "stats.hist_bins=4",
       "+hooks.slow={target:fc2,kind:forward,transform:{_target_:user_transforms.slow}}",  # changes nothing
       "logger=none", "trainer.progress=false"]


def without_timing(path: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_jsonl(path)]


def test_sigterm_then_resume_equals_an_uninterrupted_run(workdir):
    done = run_cli([*RUN, "hydra.run.dir=straight"], workdir)
    assert done.returncode == 0, done.stderr[-2000:]

    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    proc = subprocess.Popen([sys.executable, "-m", "hookexp", *RUN, "hydra.run.dir=cut"], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = workdir / "cut" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:  # interrupt once step 40 has been logged
        if metrics.exists() and any(r.get("trainer/step", 0) >= 40 for r in read_jsonl(metrics)):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "hookexp: interrupted by signal 15 after step" in stderr and "resume=true" in stderr
    stopped_at = json.loads((workdir / "cut" / "summary.json").read_text())["trainer/steps"]
    assert 40 < stopped_at < 150
    assert (workdir / "cut" / "checkpoints" / "last.pt").exists()

    resumed = run_cli([*RUN, "hydra.run.dir=cut", "resume=true"], workdir)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert without_timing(workdir / "cut" / "metrics.jsonl") == without_timing(workdir / "straight" / "metrics.jsonl")
    hists = read_jsonl(workdir / "cut" / "histograms.jsonl")
    assert len(hists) == 31  # steps 0, 5, .., 145 and 149
    assert hists == read_jsonl(workdir / "straight" / "histograms.jsonl")
    final = json.loads((workdir / "cut" / "summary.json").read_text())
    straight = json.loads((workdir / "straight" / "summary.json").read_text())
    assert final["status"] == "finished" and final["val/acc"] == straight["val/acc"]
    assert final["hook/grad_noise/calls"] == straight["hook/grad_noise/calls"]


def test_checkpoints_are_atomic_and_bad_ones_are_clear_errors(workdir):
    from hookexp.errors import ConfigError
    from hookexp.run import checkpoint

    path = workdir / "checkpoints" / "last.pt"
    checkpoint.save(path, {"x": torch.ones(2)})
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temporary file left
    assert torch.equal(checkpoint.load(path)["x"], torch.ones(2))
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match=r"^resume: cannot read the checkpoint .* corrupt or was not written"):
        checkpoint.load(path)
    with pytest.raises(ConfigError, match=r"^resume: no checkpoint at .*hydra\.run\.dir"):
        checkpoint.load(workdir / "missing.pt")
    torch.save({"format": 99}, path)
    with pytest.raises(ConfigError, match="is not a hookexp checkpoint"):
        checkpoint.load(path)


def test_resume_with_another_model_is_refused(workdir):
    done = run_cli(["trainer.max_steps=4", "trainer.checkpoint_every=2", "logger=none", "hydra.run.dir=a"], workdir)
    assert done.returncode == 0, done.stderr[-2000:]
    other = run_cli(["model=mlp", "resume=a", "trainer.max_steps=6", "logger=none", "hydra.run.dir=b"], workdir)
    assert other.returncode == 2
    assert "hookexp: error: resume: the checkpoint a/checkpoints/last.pt does not fit this model" in other.stderr


def test_a_crash_while_saving_leaves_the_previous_checkpoint_intact(workdir, monkeypatch):
    from hookexp.run import checkpoint

    path = workdir / "last.pt"
    checkpoint.save(path, {"step": 1})

    def crash(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"half a chec")  # what a killed writer leaves
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, {"step": 2})
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 1
    assert [p.name for p in workdir.iterdir()] == ["last.pt"]  # and no half-written file is left
