"""The trainer in-process (compose API): work happens on log steps only; probes change nothing."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import read_jsonl
from hydra import compose, initialize_config_module

from hookexp.engine import HookHandle, SpecBinding
from hookexp.stats import Packed, StepStats
from hookexp.train import train


def config(*overrides: str):
    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        return compose("config", overrides=["logger=none", "trainer.progress=false", *overrides])


def test_statistics_run_on_log_steps_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    counts: Counter[str] = Counter()

    def counting(cls, name):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    counting(StepStats, "capture_grads")
    counting(Packed, "reduce")
    counting(StepStats, "begin")
    counting(SpecBinding, "measure")
    counting(HookHandle, "pending_stats")
    cfg = config("hooks=[clamp_conv,dead_relu_probe]", "stats.every=5", "trainer.max_steps=12",
                 "stats.activations=relu*")
    summary = train(cfg, tmp_path)
    log_steps = [0, 5, 10, 11]
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["trainer/step"] for r in rows] == log_steps
    assert counts["capture_grads"] == counts["begin"] == counts["pending_stats"] == counts["reduce"] == len(log_steps)
    # clamp_conv measures 2 tensors a log step, dead_relu_probe 3 (relu1..3)
    assert counts["measure"] == (2 + 3) * len(log_steps)
    assert summary["hook/clamp_conv/calls"] == 2 * 12
    assert all("act/relu2/frac_zero" in r and "hook/dead_relu_probe/dead_frac" in r for r in rows)


def test_the_statistics_kernels_are_loaded_before_the_training_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from hookexp import fused

    events: list[str] = []
    usable, begin = fused.usable, StepStats.begin
    monkeypatch.setattr(fused, "usable", lambda device_type: events.append("load") or usable(device_type))
    monkeypatch.setattr(StepStats, "begin", lambda self: events.append("log step") or begin(self))
    train(config("trainer.max_steps=2", "stats.every=1"), tmp_path)
    assert events[:2] == ["load", "log step"]  # not inside the first log step (its perf/step_time)


def test_hooks_that_change_nothing_leave_training_bit_identical(tmp_path: Path):
    # deterministic algorithms: on CUDA some backward kernels add in a varying order (on the CPU it changes nothing)
    common = ["trainer.max_steps=30", "repro.deterministic=true"]
    try:
        base = train(config("hooks=none", *common), tmp_path / "none")
        probed = train(config("hooks=[dead_relu_probe,record_activations]", *common), tmp_path / "probe")
    finally:
        torch.use_deterministic_algorithms(False)
    assert base["train/loss"] == probed["train/loss"] and base["val/loss"] == probed["val/loss"]
    a = [{k: v for k, v in r.items() if k.startswith(("train/", "val/", "grad/"))}
         for r in read_jsonl(tmp_path / "none" / "metrics.jsonl")]
    b = [{k: v for k, v in r.items() if k.startswith(("train/", "val/", "grad/"))}
         for r in read_jsonl(tmp_path / "probe" / "metrics.jsonl")]
    assert a == b
    records = (tmp_path / "probe" / "records" / "record_activations.pt")
    assert records.exists()


def test_a_hook_changes_training(tmp_path: Path):
    base = train(config("hooks=none", "trainer.max_steps=20"), tmp_path / "none")
    hooked = train(config("hooks=zero_fc_bias", "trainer.max_steps=20"), tmp_path / "zero")
    assert base["train/loss"] != hooked["train/loss"]
    rows = read_jsonl(tmp_path / "zero" / "metrics.jsonl")
    assert all(r["grad/fc1.bias/norm"] == 0.0 and r["grad/fc1.bias/frac_zero"] == 1.0
               for r in rows if "grad/fc1.bias/norm" in r)


def test_plot_and_histograms_reach_the_files_and_wandb(tmp_path: Path):
    from conftest import wandb_history, wandb_summary

    cfg = config("trainer.max_steps=15", "stats.hist_bins=8", "stats.activations=relu1", "logger=wandb")
    train(cfg, tmp_path)
    png = tmp_path / "plots" / "grad_norms.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = wandb_summary(tmp_path)
    assert run["state"] == "finished" and "plots/grad_norms" in run["summary"]
    hist = [r for r in wandb_history(tmp_path) if "grad/conv1.weight/hist.values" in r]
    assert len(hist) == 3  # steps 0, 10, 14
    assert hist[0]["grad/conv1.weight/hist._type"] == "histogram"
    assert sum(hist[0]["grad/conv1.weight/hist.values"]) == 16 * 1 * 3 * 3  # every element in a bin
    assert len(hist[0]["grad/conv1.weight/hist.bins"]) == 8 + 1
    assert sum(hist[0]["act/relu1/hist.values"]) == 64 * 16 * 8 * 8
    # histograms.jsonl holds the same numbers, step by step: counts, and edges over each tensor's [min, max]
    local = read_jsonl(tmp_path / "histograms.jsonl")
    assert [r["trainer/step"] for r in local] == [r["trainer/step"] for r in hist] == [0, 10, 14]
    metrics = {r["trainer/step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if "grad/global_norm" in r}
    for row, wandb_row in zip(local, hist, strict=True):
        assert sorted(row) == ["act/relu1/hist", "grad/conv1.bias/hist", "grad/conv1.weight/hist",
                               "grad/conv2.bias/hist", "grad/conv2.weight/hist", "grad/fc1.bias/hist",
                               "grad/fc1.weight/hist", "grad/fc2.bias/hist", "grad/fc2.weight/hist", "trainer/step"]
        for key, h in row.items():
            if key == "trainer/step":
                continue
            assert h["values"] == wandb_row[f"{key}.values"] and h["bins"] == wandb_row[f"{key}.bins"], key
            assert len(h["bins"]) == 9
            if key.startswith("grad/"):
                assert h["bins"][0] == metrics[row["trainer/step"]][key[:-4] + "min"]
                assert h["bins"][-1] == metrics[row["trainer/step"]][key[:-4] + "max"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["perf/train_loop_s"] > 0


NAN_AT_3 = ["hooks=zero_fc_bias", "hooks.zero_fc_bias.transform={_target_:user_transforms.make_nan}",
            "hooks.zero_fc_bias.start_step=3", "hooks.zero_fc_bias.end_step=4", "trainer.max_steps=8"]


def test_nan_policy_raise_names_step_parameters_and_hooks(tmp_path: Path):
    from hookexp.guard import NonFiniteError

    with pytest.raises(NonFiniteError) as e:
        train(config(*NAN_AT_3), tmp_path)
    message = str(e.value)
    # NaN gradients at step 3 become NaN biases, the loss of step 4 is NaN, and the log step 7 (no host
    # sync before it) reports it; by then the NaN has spread to every parameter
    assert message.startswith("first non-finite loss at step 4: loss nan at step 7; parameters: conv1.weight "
                              "(value and gradient)")
    assert "hooks touching them: zero_fc_bias (grad user_transforms.make_nan on fc1.bias)" in message
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_nan_policy_skip_step_skips_and_goes_on(tmp_path: Path, caplog):
    with caplog.at_level("WARNING"):
        summary = train(config(*NAN_AT_3, "trainer.nan_policy=skip_step"), tmp_path)
    (warning,) = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    # checked every step: the exact step and the parameters the hook made NaN, nothing else
    assert warning.startswith("non-finite values at step 3: loss ")
    assert "parameters: fc1.bias (gradient), fc2.bias (gradient); hooks touching them: zero_fc_bias" in warning
    assert summary["status"] == "finished" and summary["guard/skipped_steps"] == 1
    assert summary["trainer/steps"] == 8
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert all(isinstance(r["train/loss"], float) for r in rows)  # finite: "nan" would be a string


def test_nan_policy_unknown_is_refused(tmp_path: Path):
    from hookexp import ConfigError

    with pytest.raises(ConfigError, match=r"^trainer\.nan_policy: unknown policy 'skip'\. Use one of: raise"):
        train(config("trainer.nan_policy=skip", "trainer.max_steps=2"), tmp_path)


def test_hist_sample_below_one_is_refused(tmp_path: Path):
    from hookexp import ConfigError

    with pytest.raises(ConfigError, match=r"^stats\.hist_sample: must be at least 1 \(or null: count every element\), "
                                          r"got 0\."):
        train(config("stats.hist_sample=0", "trainer.max_steps=2"), tmp_path)


def test_bf16_autocast_trains_small_cnn_with_clamp_conv(tmp_path: Path):
    summary = train(config("hooks=clamp_conv", "trainer.precision=bf16"), tmp_path)
    assert summary["status"] == "finished" and summary["val/acc"] > 0.85


def test_fp16_grad_scaler_pre_step_and_statistics_see_unscaled_gradients(tmp_path: Path, caplog):
    import torch

    record = ["+hooks.seen={target:fc2.bias,kind:pre_step,transform:record}", "trainer.max_steps=1",
              "+hooks.flip={target:fc1.weight,kind:grad,transform:negate}"]  # sign flips: scale-free
    with caplog.at_level("WARNING"):
        train(config("hooks=clamp_conv", "trainer.precision=fp16", *record), tmp_path / "fp16")
    train(config("hooks=clamp_conv", *record), tmp_path / "fp32")
    warned = [r.getMessage() for r in caplog.records if "trainer.precision=fp16" in r.getMessage()]
    assert len(warned) == 1  # clamp (value-dependent, backward stage) warns; negate does not
    assert warned[0].startswith("hooks.clamp_conv: with trainer.precision=fp16") and "Use kind 'pre_step'" in warned[0]
    fp16 = torch.load(tmp_path / "fp16" / "records" / "seen.pt", weights_only=True)[0]["value"]
    fp32 = torch.load(tmp_path / "fp32" / "records" / "seen.pt", weights_only=True)[0]["value"]
    assert torch.allclose(fp16, fp32, rtol=2e-2, atol=1e-4)  # not multiplied by the scale (65536)
    (row16,) = [r for r in read_jsonl(tmp_path / "fp16" / "metrics.jsonl") if "grad/fc2.bias/norm" in r]
    (row32,) = [r for r in read_jsonl(tmp_path / "fp32" / "metrics.jsonl") if "grad/fc2.bias/norm" in r]
    assert row16["grad/fc2.bias/norm"] == pytest.approx(row32["grad/fc2.bias/norm"], rel=2e-2)


def test_unknown_precision_is_refused(tmp_path: Path):
    from hookexp import ConfigError

    with pytest.raises(ConfigError, match=r"^trainer\.precision: unknown precision 'fp8'\. Use fp32, bf16 or fp16\."):
        train(config("trainer.precision=fp8", "trainer.max_steps=2"), tmp_path)


def test_compiled_and_eager_runs_give_equal_first_step_gradients(tmp_path: Path):
    """torch.compile (inductor) after the hooks are attached: the step-0 gradient statistics of every
    parameter equal eager's to 1e-5 relative or 1e-7 absolute (float32 kernels fused differently; a mean
    that is analytically zero, like fc2.bias's, differs at 1e-9), and the hooks fired as often."""
    common = ["hooks=clamp_conv", "trainer.max_steps=3", "stats.every=1"]
    eager = train(config(*common), tmp_path / "eager")
    compiled = train(config(*common, "trainer.compile=true"), tmp_path / "compiled")
    assert compiled["hook/clamp_conv/calls"] == eager["hook/clamp_conv/calls"] == 6
    first_eager = read_jsonl(tmp_path / "eager" / "metrics.jsonl")[0]
    first_compiled = read_jsonl(tmp_path / "compiled" / "metrics.jsonl")[0]
    grads = [k for k in first_eager if k.startswith("grad/") and k.endswith(("/norm", "/mean", "/max"))]
    assert len(grads) == 3 * 8
    for key in grads:
        assert first_compiled[key] == pytest.approx(first_eager[key], rel=1e-5, abs=1e-7), key


def test_nan_policy_raise_names_the_step_past_a_fold_of_the_meter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The meter folds its kept losses on the device every FOLD steps; the first bad step survives the fold."""
    from hookexp.guard import NonFiniteError
    from hookexp.meter import TrainMeter

    monkeypatch.setattr(TrainMeter, "FOLD", 2)
    with pytest.raises(NonFiniteError, match=r"^first non-finite loss at step 4: loss nan at step 7;"):
        train(config(*NAN_AT_3, "stats.every=100"), tmp_path)


def test_meter_reads_loss_accuracy_and_first_bad_step_across_folds(monkeypatch: pytest.MonkeyPatch):
    from hookexp.meter import TrainMeter

    for fold in (2, 3, 100):
        monkeypatch.setattr(TrainMeter, "FOLD", fold)
        summed: list[list[float]] = []  # what the ranks' all-reduce sees (one rank here: the identity)
        meter = TrainMeter(torch.device("cpu"), all_reduce=lambda t, summed=summed: summed.append(t.tolist()) or t)
        losses = [1.0, 2.0, 3.0, float("inf"), 5.0, float("nan"), 7.0]
        logits = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
        for i, v in enumerate(losses):
            meter.add(10 + i, torch.tensor(v), logits, torch.tensor([1, i % 2]))  # 2 right, then 1
        loss, acc, first_bad = meter.read(meter.pending().tolist())
        assert math.isnan(loss) and first_bad == 13, fold
        assert acc == (7 + 4) / 14
        for i, v in enumerate([1.0, 2.0, 4.0]):
            meter.add(20 + i, torch.tensor(v), logits, torch.tensor([1, 0]))
        assert meter.read(meter.pending().tolist()) == (7 / 3, 1.0, None)
        totals = summed[-1]
        assert totals == [7.0, 6.0, 3.0, 6.0]


def test_a_config_error_after_the_hooks_are_attached_detaches_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from hookexp import ConfigError

    removed: list[int] = []
    original = HookHandle.remove
    monkeypatch.setattr(HookHandle, "remove", lambda self: (removed.append(len(self.bindings)), original(self))[1])
    with pytest.raises(ConfigError, match=r"^trainer\.precision: unknown precision 'fp8'"):
        train(config("hooks=clamp_conv", "trainer.precision=fp8", "trainer.max_steps=2"), tmp_path)
    assert removed == [1]


def test_a_cuda_index_the_machine_lacks_is_refused_with_the_devices_it_has(monkeypatch: pytest.MonkeyPatch):
    from hookexp import ConfigError
    from hookexp.train import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError) as e:
        pick_device("cuda:7")
    assert str(e.value) == ("trainer.device: there is no cuda:7: this machine has 2 CUDA device(s) (cuda:0, cuda:1). "
                            "Use trainer.device=auto, cuda or one of those.")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^trainer\.device: CUDA is not available on this machine\. Use trainer"):
        pick_device("cuda")


def test_repro_deterministic_is_set_for_each_run_not_kept_from_the_last():
    """Hydra's basic launcher runs a multirun's jobs in one process."""
    from hookexp.train import build_run

    try:
        build_run(config("repro.deterministic=true"))
        assert torch.are_deterministic_algorithms_enabled()
        build_run(config("repro.deterministic=false"))
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
