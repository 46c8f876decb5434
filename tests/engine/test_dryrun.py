"""check_on_batch() and +dry_run=true: what only a real batch can show, found before training."""

from __future__ import annotations

import copy
import json

import torch
from conftest import run_cli
from test_kinds import Probe
from torch import nn

from hookexp import check_on_batch


def batch():
    torch.manual_seed(0)
    return torch.randn(4, 6), torch.randint(0, 3, (4,))


def test_full_backward_hook_before_an_inplace_relu_is_refused_with_the_reason():
    model = Probe()
    report = check_on_batch(model, {"bw": {"target": "embed", "kind": "backward", "transform": "identity"}}, batch())
    assert not report.ok
    (error,) = report.errors
    assert error.startswith("hooks.bw.kind: an in-place op modified the output of 'embed' (kind 'backward') after "
                            "its forward")
    assert "Use kind 'output_grad' (or 'node') for this target" in error
    assert report.rows[0]["warnings"] == ["not reached: the batch stopped at an error below"]


def test_report_rows_calls_tied_windows_and_never_fired():
    model = Probe()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    specs = {
        "twice": {"target": "block", "kind": "forward", "transform": "identity"},
        "tied": {"target": "tied_b.weight", "kind": "grad", "transform": "clamp", "args": {"max": 1.0},
                 "start_step": 100},
        "ev": {"target": "head", "kind": "forward", "transform": "identity", "phase": "eval"},
        "ps": {"target": "*.bias", "kind": "pre_step", "transform": "clamp", "args": {"max": 1.0}},
        "off": {"target": "head", "kind": "forward", "transform": "zero", "enabled": False},
    }
    report = check_on_batch(model, specs, batch(), opt)
    assert report.ok, report.errors
    rows = {r["spec"]: r for r in report.rows}
    assert rows["twice"]["calls_per_step"] == 2
    assert rows["twice"]["warnings"] == ["fires several times per step (block x2)"]
    assert rows["tied"]["calls_per_step"] == 1
    assert rows["tied"]["warnings"] == ["shared/tied, hooked once: tied_a.weight = tied_b.weight",
                                        "acts on steps [100, end) every 1; checked here regardless"]
    assert rows["ev"]["calls_per_step"] == 1 and rows["ev"]["warnings"] == []
    assert rows["ps"]["calls_per_step"] == 5
    assert rows["off"]["warnings"] == ["disabled (enabled: false): resolved, not attached"]
    text = report.render()
    assert "twice" in text and "OK: every hook fired" in text


def test_never_fires_says_why():
    model = nn.Sequential(nn.Identity(), nn.Linear(6, 3))
    report = check_on_batch(model, {"n": {"target": "0", "kind": "node", "transform": "identity"}}, batch())
    assert report.rows[0]["warnings"] == ["never fired on this batch: output has no grad_fn"]


def test_transform_errors_are_reported_with_spec_and_target():
    spec = {"t": {"target": "head", "kind": "forward", "transform": {"_target_": "user_transforms.reshape"}}}
    report = check_on_batch(Probe(), spec, batch())
    (error,) = report.errors
    assert error.startswith("hooks.t.transform: transform 'user_transforms.reshape' changed the tensor on "
                            "target 'head' (kind 'forward'): expected shape (4, 3)")


def test_the_model_is_left_as_found():
    model = Probe()
    model.eval()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    check_on_batch(model, {"z": {"target": "*", "kind": "pre_step", "transform": "add", "args": {"value": 1.0}}},
             batch(), opt)
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not opt._optimizer_step_pre_hooks


def test_cli_dry_run_prints_the_table_and_trains_nothing(workdir):
    done = run_cli(["model=small_cnn", "hooks=[clamp_conv,zero_fc_bias]", "+dry_run=true", "hydra.run.dir=run"],
                   workdir)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hookexp dry run" in done.stdout
    assert "clamp_conv" in done.stdout and "conv1, conv2" in done.stdout and "fc1.bias, fc2.bias" in done.stdout
    assert not (workdir / "run" / "metrics.jsonl").exists()
    report = json.loads((workdir / "run" / "dry_run.json").read_text())
    assert report["ok"] and [r["calls_per_step"] for r in report["hooks"]] == [2, 2]


def test_cli_dry_run_fails_on_a_hook_that_breaks(workdir):
    done = run_cli(["hooks=clamp_conv", "hooks.clamp_conv.transform={_target_:user_transforms.reshape}",
                    "+dry_run=true", "hydra.run.dir=run"], workdir)
    assert done.returncode == 2
    assert "changed the tensor on target 'conv2'" in done.stdout  # backward reaches conv2 first
    assert "hookexp: error: the dry run found 1 error(s)" in done.stderr


def test_a_tasks_forward_and_loss_take_the_whole_batch():
    from engine_models import KwModel

    model = KwModel()
    batch = {"x": torch.randn(2, 5, 6), "labels": torch.randint(0, 3, (2, 5))}
    seen = []

    def forward(m, b):
        seen.append(sorted(b))
        return m(b["x"])

    def loss(out, b):
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), b["labels"].flatten())

    report = check_on_batch(model, {"f": {"target": "inner", "kind": "forward", "index": "pooled"}}, batch,
                      forward=forward, loss_fn=loss)
    assert report.ok, report.errors
    assert seen == [["labels", "x"]] and report.rows[0]["calls_per_step"] == 1
