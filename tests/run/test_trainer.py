"""The training loop in-process (compose API): work on log steps only, probes that change nothing, the
non-finite guard, precisions, compile, gradient accumulation, clipping, schedules and validation cadence."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import FORENSICS_ON, config, read_jsonl
from torch.utils.data import TensorDataset

from hookexp.engine import HookHandle, SpecBinding
from hookexp.errors import ConfigError, NonFiniteError
from hookexp.run.loop import run_job as train
from hookexp.telemetry.probes import Probes
from hookexp.telemetry.stats import TensorStats


def rows_with(path: Path, key: str) -> list[dict]:
    return [r for r in read_jsonl(path) if key in r]


def test_statistics_run_on_log_steps_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    counts: Counter[str] = Counter()

    def counting(cls, name):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    counting(TensorStats, "describe")
    keep = Probes._keep_activation

    def keep_activation(self, x, ctx):  # the engine passes ctx to transforms whose signature asks for it
        counts["_keep_activation"] += 1
        return keep(self, x, ctx)

    monkeypatch.setattr(Probes, "_keep_activation", keep_activation)
    counting(SpecBinding, "measure")
    counting(HookHandle, "pending_stats")
    cfg = config("hooks=[clamp_conv,dead_relu_probe]", "stats.every=5", "trainer.max_steps=12",
                 "stats.activations=relu*")
    summary = train(cfg, tmp_path)
    log_steps = [0, 5, 10, 11]
    rows = rows_with(tmp_path / "metrics.jsonl", "train/loss")
    assert [r["trainer/step"] for r in rows] == log_steps
    assert counts["describe"] == len(log_steps)  # gradients and activations together, in one call
    assert counts["_keep_activation"] == 3 * len(log_steps)  # relu1..relu3, on log steps only
    assert counts["pending_stats"] == len(log_steps) + 1  # and once at the end, for the summary's call counts
    assert counts["measure"] == (2 + 3) * len(log_steps)  # clamp_conv: 2 tensors a log step, dead_relu_probe 3
    assert summary["hook/clamp_conv/calls"] == 2 * 12
    assert all("act/relu2/frac_zero" in r and "hook/dead_relu_probe/dead_frac" in r for r in rows)


def test_hooks_that_change_nothing_leave_training_bit_identical(tmp_path: Path):
    common = ["trainer.max_steps=30", "repro.deterministic=true"]
    try:
        base = train(config("hooks=none", *common), tmp_path / "none")
        probed = train(config("hooks=[dead_relu_probe,record_activations]", *common), tmp_path / "probe")
    finally:
        torch.use_deterministic_algorithms(False)
    assert base["train/loss"] == probed["train/loss"] and base["val/loss"] == probed["val/loss"]

    def kept(path: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k.startswith(("train/", "val/", "grad/"))} for r in read_jsonl(path)]

    assert kept(tmp_path / "none" / "metrics.jsonl") == kept(tmp_path / "probe" / "metrics.jsonl")
    records = torch.load(tmp_path / "probe" / "records" / "record_activations.pt", weights_only=True)
    assert [r["step"] for r in records] == [0] * 3  # every 50 steps: step 0 of a 30-step run, relu1..relu3


def test_a_hook_changes_training(tmp_path: Path):
    base = train(config("hooks=none", "trainer.max_steps=20"), tmp_path / "none")
    hooked = train(config("hooks=zero_fc_bias", "trainer.max_steps=20"), tmp_path / "zero")
    assert base["train/loss"] != hooked["train/loss"]
    rows = rows_with(tmp_path / "zero" / "metrics.jsonl", "grad/fc1.bias/norm")
    assert rows and all(r["grad/fc1.bias/norm"] == 0.0 and r["grad/fc1.bias/frac_zero"] == 1.0 for r in rows)


@pytest.mark.grad_norm_plot
def test_plot_and_histograms_reach_the_files_and_wandb(tmp_path: Path):
    from conftest import wandb_history, wandb_summary

    cfg = config("trainer.max_steps=15", "stats.hist_bins=8", "stats.activations=relu1", "logger=wandb")
    train(cfg, tmp_path)
    png = tmp_path / "plots" / "grad_norms.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = wandb_summary(tmp_path)
    assert run["state"] == "finished" and "plots/grad_norms" in run["summary"]
    hist = [r for r in wandb_history(tmp_path) if "grad/conv1.weight/hist.values" in r]
    assert [r["trainer/step"] for r in hist] == [0, 10, 14]
    assert hist[0]["grad/conv1.weight/hist._type"] == "histogram"
    assert sum(hist[0]["grad/conv1.weight/hist.values"]) == 16 * 1 * 3 * 3  # every element in a bin
    assert len(hist[0]["grad/conv1.weight/hist.bins"]) == 8 + 1
    assert sum(hist[0]["act/relu1/hist.values"]) == 64 * 16 * 8 * 8
    local = read_jsonl(tmp_path / "histograms.jsonl")
    assert [r["trainer/step"] for r in local] == [0, 10, 14]
    metrics = {r["trainer/step"]: r for r in rows_with(tmp_path / "metrics.jsonl", "grad/global_norm")}
    for row, wandb_row in zip(local, hist, strict=True):
        for key, h in row.items():
            if key == "trainer/step":
                continue
            assert h["values"] == wandb_row[f"{key}.values"] and h["bins"] == wandb_row[f"{key}.bins"], key
            if key.startswith("grad/"):
                assert h["bins"][0] == metrics[row["trainer/step"]][key[:-4] + "min"]
                assert h["bins"][-1] == metrics[row["trainer/step"]][key[:-4] + "max"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["perf/train_loop_s"] > 0 and summary["status"] == "finished"
    assert 0 < summary["perf/first_step_s"] < summary["perf/train_loop_s"]  # one step of the run's several


NAN_AT_3 = ["+hooks.poison={target:fc1.bias,kind:grad,transform:{_target_:user_transforms.nan_at,step:3}}",
            "trainer.max_steps=8"]


def test_nan_policy_raise_stops_before_the_nan_reaches_the_weights_naming_step_parameters_and_hooks(tmp_path):
    with pytest.raises(NonFiniteError) as e:
        train(config(*NAN_AT_3, "trainer.checkpoint_every=1"), tmp_path)
    message = str(e.value)
    # on the CPU the guard reads every step: the exact step, and only the gradients the hook made NaN
    assert message.startswith("non-finite loss or gradient at step 3: loss ")
    assert "; parameters: fc1.bias (gradient); hooks touching them:" in message  # caught before it spread
    assert "hooks touching them: poison (grad user_transforms.nan_at on fc1.bias)" in message
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert saved["loop"]["step"] == 3 and all(torch.isfinite(v).all() for v in saved["model"].values())


def test_nan_policy_skip_step_skips_that_update_and_goes_on(tmp_path: Path, caplog):
    with caplog.at_level("WARNING"):
        summary = train(config(*NAN_AT_3, "guard.nan_policy=skip_step"), tmp_path)
    (warning,) = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert warning.startswith("non-finite loss or gradient at step 3: loss ")
    assert summary["status"] == "finished" and summary["guard/skipped_steps"] == 1 and summary["trainer/steps"] == 8
    assert all(isinstance(r["train/loss"], float) for r in rows_with(tmp_path / "metrics.jsonl", "train/loss"))


def test_finite_gradients_whose_norm_overflows_are_not_skipped(tmp_path: Path):
    """``optim.lr=1e10``-style magnitudes: a float32 sum of squares overflows, the gradients are finite."""
    summary = train(config("+hooks.big={target:fc2.weight,kind:grad,transform:{_target_:user_transforms.huge}}",
                           "guard.nan_policy=skip_step", "trainer.max_steps=3", "optim.lr=1e-35"), tmp_path)
    assert summary["guard/skipped_steps"] == 0


def test_on_a_gpu_raise_costs_no_sync_and_names_the_bad_step_as_its_flag_arrives(tmp_path, monkeypatch):
    """The deferred path a GPU takes (here forced on the CPU, where the flag arrives at once): each step's flag goes
    to the host without a sync and is read at the step's end, so the run stops at the bad step (a step later on a
    GPU), long before the log step, and no checkpoint is written from the non-finite state."""
    from hookexp.telemetry.guard import NonFiniteGuard

    init = NonFiniteGuard.__init__
    monkeypatch.setattr(NonFiniteGuard, "__init__", lambda self, *a, **k: (init(self, *a, **k),
                                                                           setattr(self, "sync", False))[0])
    with pytest.raises(NonFiniteError) as e:
        train(config(*NAN_AT_3, "stats.every=100", "trainer.checkpoint_every=5"), tmp_path)
    assert str(e.value).startswith("non-finite loss or gradient at step 3: parameters (now): fc1.bias (value and "
                                   "gradient)")
    assert not (tmp_path / "checkpoints" / "last.pt").exists()


def test_on_a_gpu_warn_reports_a_deferred_bad_step_once_a_log_period(tmp_path, monkeypatch, caplog):
    """The deferred path (forced on the CPU): after the NaN at step 3 every step is non-finite (warn goes on), and
    each period between log steps (0, 10, 20, 24) is warned of once, at its first bad step's end."""
    from hookexp.telemetry.guard import NonFiniteGuard

    init = NonFiniteGuard.__init__
    monkeypatch.setattr(NonFiniteGuard, "__init__", lambda self, *a, **k: (init(self, *a, **k),
                                                                           setattr(self, "sync", False))[0])
    with caplog.at_level("WARNING", logger="hookexp"):
        summary = train(config(*NAN_AT_3, "guard.nan_policy=warn", "stats.every=10", "trainer.max_steps=25"),
                        tmp_path)
    warned = [r.getMessage() for r in caplog.records if "Going on (guard.nan_policy=warn)" in r.getMessage()]
    assert [m.split(":")[0] for m in warned] == ["non-finite loss or gradient at step 3",
                                                 "non-finite loss or gradient at step 11",
                                                 "non-finite loss or gradient at step 21"]
    assert summary["guard/nonfinite_warnings"] == 3


def test_unknown_nan_policy_and_precision_are_refused_and_detach_the_hooks(tmp_path, monkeypatch):
    removed: list[int] = []
    original = HookHandle.remove
    monkeypatch.setattr(HookHandle, "remove", lambda self: (removed.append(len(self.bindings)), original(self))[1])
    with pytest.raises(ConfigError, match=r"^guard\.nan_policy: unknown policy 'skip'\. Use one of: raise"):
        train(config("guard.nan_policy=skip", "trainer.max_steps=2", "hooks=clamp_conv"), tmp_path / "a")
    with pytest.raises(ConfigError, match=r"^trainer\.precision: unknown precision 'fp8'\. Did you mean 'fp32' or "):
        train(config("trainer.precision=fp8", "trainer.max_steps=2", "hooks=clamp_conv"), tmp_path / "b")
    assert removed == [1, 1]


@pytest.mark.parametrize(("override", "message"), [
    ("stats.hist_sample=0", r"^stats\.hist_sample: must be at least 1 \(or null: count every element\), got 0\."),
    ("stats.hist_bins=-3", r"^stats\.hist_bins: must be 0 \(no histograms\) or more, got -3\."),
    ("stats.every=0", r"^stats\.every: must be a whole number of at least 1, got 0\."),
    ("trainer.accumulate=0", r"^trainer\.accumulate: must be a whole number of at least 1, got 0\."),
    ("trainer.clip_grad_norm=-1", r"^trainer\.clip_grad_norm: must be a positive norm"),
    ("trainer.num_threads=0", r"^trainer\.num_threads: must be at least 1"),
    ("optim.lr=-1", r"^optim\.lr: SGD refused its arguments: ValueError: Invalid learning rate: -1\. Fix optim\.lr"),
    ("+optim.momentm=0.9", r"^optim\.momentm: SGD has no parameter 'momentm'\. Did you mean 'momentum'\?"),
    ("model.width=0", r"^model\.width: SmallCNN refused its arguments: ValueError: width must be at least 1, got 0"),
    ("data.batch_size=0", r"^data\.batch_size: expected an integer >= 1, got 0\."),
    ("data.val_fraction=1.5", r"^data\.val_fraction: expected a fraction in \[0, 1\)"),
    ("data.dataset._target_=collections.OrderedDict", r"^data\.dataset: returned a mapping with keys "),
    ("model.in_channels=abc", r"^model\.in_channels: .*abc"),
    ("stats.grads='re:(['", r"^stats\.grads: invalid regular expression '\(\[': unterminated character set"),
    ("+hooks.c={target:fc1,kind:output_grad,transform:clamp,args:{min:abc}}",
     r"^hooks\.c\.args\.min: transform 'clamp' takes a number for 'min', got 'abc'\."),
])
def test_bad_settings_are_refused_before_training(tmp_path: Path, override: str, message: str):
    from hookexp.errors import HookexpError

    with pytest.raises(HookexpError, match=message):
        train(config(override, "trainer.max_steps=2"), tmp_path)


def test_bf16_autocast_trains_small_cnn_with_clamp_conv(tmp_path: Path):
    summary = train(config("hooks=clamp_conv", "trainer.precision=bf16", "trainer.epochs=4"), tmp_path)
    assert summary["status"] == "finished" and summary["val/acc"] > 0.8


def test_fp16_grad_scaler_pre_step_and_statistics_see_unscaled_gradients(tmp_path: Path, caplog):
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


@pytest.mark.slow  # torch.compile; ./scripts/test.sh -m slow
def test_compiled_and_eager_runs_log_the_same_statistics_every_log_step(tmp_path: Path):
    """The probes are attached before compiling: activation statistics do not vanish after step 0 under compile."""
    common = ["hooks=clamp_conv", "trainer.max_steps=7", "stats.every=3", "stats.activations=relu*"]
    eager = train(config(*common), tmp_path / "eager")
    compiled = train(config(*common, "trainer.compile=true"), tmp_path / "compiled")
    assert compiled["hook/clamp_conv/calls"] == eager["hook/clamp_conv/calls"] == 14
    rows_eager = rows_with(tmp_path / "eager" / "metrics.jsonl", "train/loss")
    rows_compiled = rows_with(tmp_path / "compiled" / "metrics.jsonl", "train/loss")
    assert [r["trainer/step"] for r in rows_compiled] == [r["trainer/step"] for r in rows_eager] == [0, 3, 6]
    for e, c in zip(rows_eager, rows_compiled, strict=True):
        assert sorted(c) == sorted(e)
        assert {k for k in c if k.startswith("act/")} == {f"act/relu{i}/{s}" for i in (1, 2, 3)
                                                          for s in ("mean", "std", "abs_mean", "kurtosis", "frac_zero")}
    grads = [k for k in rows_eager[0] if k.startswith("grad/") and k.endswith(("/norm", "/mean", "/max"))]
    assert len(grads) == 3 * 8
    for e, c in zip(rows_eager, rows_compiled, strict=True):  # the values of every log step, not only the first
        for key in grads + [k for k in e if k.startswith("act/")]:
            assert c[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), (e["trainer/step"], key)


def test_accumulating_two_half_batches_gives_the_gradient_of_the_whole_batch(tmp_path: Path):
    """The first step's examples are the same either way (the epoch's order does not depend on the batch size)."""
    train(config("data.batch_size=64", "trainer.max_steps=1", "stats.every=1"), tmp_path / "whole")
    train(config("data.batch_size=32", "trainer.accumulate=2", "trainer.max_steps=1", "stats.every=1"),
          tmp_path / "halves")
    whole, halves = (read_jsonl(tmp_path / name / "metrics.jsonl")[0] for name in ("whole", "halves"))
    for key in [k for k in whole if k.startswith("grad/") and k.endswith(("/norm", "/mean"))]:
        assert halves[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-9), key
    assert halves["train/loss"] == pytest.approx(whole["train/loss"], rel=1e-6)


def test_an_epoch_ends_with_the_micro_batches_left(tmp_path: Path):
    """digits: 23 batches an epoch; accumulate=5 takes 5 steps an epoch, the last of 3 micro-batches."""
    summary = train(config("trainer.accumulate=5", "trainer.epochs=2"), tmp_path)
    assert summary["trainer/steps"] == 10 and summary["trainer/epochs"] == 2
    val = rows_with(tmp_path / "metrics.jsonl", "val/acc")
    assert [r["trainer/step"] for r in val] == [4, 9]


def test_clip_grad_norm_clips_after_the_pre_step_specs_and_logs_the_pre_clip_norm(tmp_path: Path):
    common = ["trainer.max_steps=4", "stats.every=1", "trainer.clip_grad_norm=0.01",
              "+hooks.boost={target:'*',kind:pre_step,transform:scale,args:{factor:1000.0}}"]
    summary = train(config(*common), tmp_path)
    rows = rows_with(tmp_path / "metrics.jsonl", "grad/pre_clip_norm")
    assert len(rows) == 4 and all(r["grad/clipped"] == 1.0 for r in rows)
    for r in rows:  # the statistics see the gradient after pre_step (x1000), before the clip
        assert r["grad/pre_clip_norm"] == pytest.approx(r["grad/global_norm"], rel=1e-5)
    unclipped = train(config(*common[:2], common[3]), tmp_path / "free")
    assert summary["train/loss"] != unclipped["train/loss"]


def test_a_cosine_schedule_with_warmup_follows_the_formula(tmp_path: Path):
    from hookexp.workloads.schedules import cosine

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = cosine(opt, total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expect = [0.5 / 3, 0.5 * 2 / 3] + [0.5 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / 8))) for t in range(8)]
    assert lrs == pytest.approx(expect, rel=1e-12)
    summary = train(config("scheduler=cosine", "scheduler.warmup_steps=3", "trainer.max_steps=6"), tmp_path)
    assert summary["status"] == "finished"


def test_eval_every_adds_validation_between_epochs(tmp_path: Path):
    train(config("trainer.eval_every=10", "trainer.epochs=2"), tmp_path)
    assert [r["trainer/step"] for r in rows_with(tmp_path / "metrics.jsonl", "val/acc")] == [9, 19, 22, 29, 39, 45]


@pytest.mark.parametrize(("name", "hint"), [("gpu", " (a GPU is cuda here)."),
                                            ("cdua", ". Did you mean 'cuda' or 'cpu'?")])
def test_a_device_torch_does_not_know_is_named_with_the_one_meant(name, hint):
    """torch's own message lists twenty device types (ipu, fpga, ...); hookexp names the one a user meant."""
    from hookexp.run.build import pick_device

    with pytest.raises(ConfigError) as e:
        pick_device(name)
    assert str(e.value) == (f"trainer.device: '{name}' is not a device hookexp trains on{hint} Use auto, cpu, "
                            "cuda, cuda:N or mps.")


def test_a_cuda_index_the_machine_lacks_is_refused_with_the_devices_it_has(monkeypatch: pytest.MonkeyPatch):
    from hookexp.run.build import pick_device

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
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^trainer\.device: MPS \(Apple's GPU backend\) is not available"):
        pick_device("mps")


def test_repro_deterministic_is_set_for_each_run_not_kept_from_the_last():
    """Hydra's basic launcher runs a multirun's jobs in one process."""
    from hookexp.run.build import seed_everything

    try:
        seed_everything(0, True)
        assert torch.are_deterministic_algorithms_enabled()
        seed_everything(0, False)
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


class Empty(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


def empty_data():
    return Empty(), Empty()


def test_an_iterable_data_set_that_yields_nothing_is_an_error_not_a_hang(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"^data\.dataset: the training set gave no batch in a whole epoch"):
        train(config("data.dataset._target_=test_trainer.empty_data", "~data.dataset.val_fraction",
                     "~data.dataset.split_seed", "trainer.max_steps=3", "model=mlp", "model.input_dim=4",
                     "model.output_dim=2"), tmp_path)


@pytest.mark.parametrize(("transform", "message"), [
    ("reshape", r"^hooks\.t\.transform: transform 'user_transforms\.reshape' changed the tensor on target 'fc1' at "
                r"step 2 \(kind 'forward'\)"),
    ("in_place", r"^hooks\.t\.transform: transform 'user_transforms\.in_place' modified its input in place on "
                 r"target 'fc1' at step 2\."),
])
def test_a_broken_transform_names_the_spec_the_target_and_the_step(tmp_path: Path, transform: str, message: str):
    from hookexp.errors import TransformOutputError

    spec = f"+hooks.t={{target:fc1,kind:forward,transform:{{_target_:user_transforms.{transform}}},start_step:2}}"
    with pytest.raises(TransformOutputError, match=message):
        train(config(spec, "trainer.max_steps=4"), tmp_path)


def test_a_transform_that_cuts_the_graph_warns_and_is_named_when_backward_finds_no_graph(tmp_path: Path):
    from hookexp.errors import HookWarning, TransformOutputError

    with pytest.warns(HookWarning, match=r"hooks\.cut: transform 'user_transforms\.detached' returned a tensor cut "
                                         r"from the autograd graph at target 'fc1'"):
        train(config("+hooks.cut={target:fc1,kind:forward,transform:{_target_:user_transforms.detached}}",
                     "trainer.max_steps=2"), tmp_path / "middle")  # trains: fc2 still learns
    with pytest.raises(TransformOutputError, match=r"^hooks\.cut\.transform: the loss does not require grad: the "
                                                   r"transform cut the output from the autograd graph at 'fc2'"):
        train(config("+hooks.cut={target:fc2,kind:forward,transform:{_target_:user_transforms.detached}}",
                     "trainer.max_steps=2"), tmp_path / "last")


def test_a_transform_that_starts_cutting_the_graph_at_a_later_step_is_named_with_that_step(tmp_path: Path):
    """The graph is whole until step 3, where the spec's window starts."""
    from hookexp.errors import HookWarning, TransformOutputError

    spec = "+hooks.cut={target:fc2,kind:forward,transform:{_target_:user_transforms.detached},start_step:3}"
    cut = r"hooks\.cut: .* cut from the autograd graph at target 'fc2' at step 3 "
    with pytest.warns(HookWarning, match=cut), pytest.raises(TransformOutputError) as raised:
        train(config(spec, "trainer.max_steps=6"), tmp_path)
    assert str(raised.value).startswith("hooks.cut.transform: the loss does not require grad: the transform cut the "
                                        "output from the autograd graph at 'fc2' (cut, at step 3) ")


def test_the_python_api_stays_the_same_functions_after_a_run(tmp_path: Path):
    """hookexp.run.train is a function; the loop's module has another name, so importing it cannot replace it."""
    from hookexp.run import compose
    from hookexp.run import train as run_train

    summary = run_train(compose("trainer.max_steps=2", "logger=none", "trainer.progress=false"), tmp_path / "a")
    assert summary["trainer/steps"] == 2
    from hookexp.run import train as again

    assert again is run_train
    with pytest.raises(Exception, match="already holds a run"):
        run_train(compose("trainer.max_steps=2", "logger=none"), tmp_path / "a")


class Classifier(torch.nn.Module):
    def __init__(self, num_classes: int, in_features: int = 4):
        super().__init__()
        self.fc = torch.nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def tensor_pair(iterable: bool = False):
    """A user's plain TensorDataset pair: labels 0..3 in training, 0..4 in validation (5 classes)."""
    gen = torch.Generator().manual_seed(0)
    train_set = TensorDataset(torch.randn(40, 4, generator=gen), torch.arange(40) % 4)
    val_set = TensorDataset(torch.randn(10, 4, generator=gen), torch.arange(10) % 5)
    if iterable:
        return Stream(train_set), Stream(val_set)
    return train_set, val_set


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


USERS_DATA = ("~data.dataset.val_fraction", "~data.dataset.split_seed", "trainer.max_steps=2", "data.batch_size=8")


def built_on(run: Path, factory: str, caplog, *overrides: str) -> dict:
    """Train 2 steps on ``test_trainer.<factory>``'s pair with the build's log captured; the model's config as
    built (``auto`` filled)."""
    overrides = (f"data.dataset._target_=test_trainer.{factory}", *USERS_DATA, *overrides)
    with caplog.at_level("INFO", logger="hookexp.build"):
        assert train(config(*overrides), run, list(overrides))["status"] == "finished"
    return json.loads((run / "manifest.json").read_text())["config"]["model"]


def test_num_classes_auto_is_read_from_a_map_style_sets_labels_and_refused_for_a_stream(tmp_path: Path, caplog):
    """Max label + 1 over training and validation, said in the log; an iterable set cannot say it."""
    mine = ("model._target_=test_trainer.Classifier", "model.num_classes=auto")
    built = built_on(tmp_path / "map", "tensor_pair", caplog, *mine)
    assert "model.num_classes=auto: 5, the largest label of the training and validation sets + 1" in caplog.text
    assert built == {"_target_": "test_trainer.Classifier", "num_classes": 5}
    streamed = ["data.dataset._target_=test_trainer.tensor_pair", *USERS_DATA, *mine, "+data.dataset.iterable=true"]
    with pytest.raises(ConfigError) as refused:
        train(config(*streamed), tmp_path / "stream", streamed)
    assert str(refused.value) == (
        "model.num_classes: is 'auto', but the data does not say it (the data gives: nothing). Its labels cannot be "
        "read: the data set is iterable (it streams) or its examples carry no integer class labels. Set it: "
        "model.num_classes=<value>.")


# a spec of every kind on a user's model (tests/helpers/user_models.py), each changing nothing (scale by 1)
USER_MODEL_KINDS = {"forward_pre": "blocks.0", "forward": "blocks.1.lin", "output_grad": "blocks.0.act",
                    "backward_pre": "norm", "backward": "blocks.1.lin", "backward_legacy": "head", "node": "embed",
                    "node_pre": "blocks.0.lin", "grad": "embed.weight", "post_accumulate": "head.weight",
                    "pre_step": "norm.weight"}


def test_a_users_model_takes_a_spec_of_every_kind_and_trains_as_without_them(tmp_path: Path):
    """model._target_=user_models.Net (a ModuleList of blocks called with a keyword argument) at the defaults
    (stats.every=10, forensics on): every kind attaches by the user's module and parameter names, acts on each step
    and logs its effects on the log steps, and, changing nothing, leaves training as it is without hooks."""
    from conftest import FORENSICS_ON

    common = ["model._target_=user_models.Net", FORENSICS_ON, "trainer.max_steps=12", "stats.activations=blocks.*",
              "stats.params=*", "guard.spike.metric=train/loss"]
    specs = [f"+hooks.{kind}={{target:{target},kind:{kind},transform:scale,args:{{factor:1.0}}}}"
             for kind, target in USER_MODEL_KINDS.items()]
    bare = train(config(*common), tmp_path / "bare", common)
    with pytest.warns(FutureWarning, match="kind .backward_legacy. uses the deprecated"):
        hooked = train(config(*common, *specs), tmp_path / "hooked", [*common, *specs])
    assert hooked["status"] == "finished"
    assert {kind: hooked[f"hook/{kind}/calls"] for kind in USER_MODEL_KINDS} == dict.fromkeys(USER_MODEL_KINDS, 12)
    logged = rows_with(tmp_path / "hooked" / "metrics.jsonl", "train/loss")
    assert [r["trainer/step"] for r in logged] == [0, 10, 11]
    assert all(r[f"hook/{kind}/change_norm"] == 0.0 and r[f"hook/{kind}/cosine"] == pytest.approx(1.0)
               for r in logged for kind in USER_MODEL_KINDS)
    assert {"act/blocks.0/std", "act/blocks.1.act/frac_zero", "param/blocks.1.lin.weight/norm"} <= set(logged[0])

    def kept(path: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k.startswith(("train/", "val/", "grad/", "act/", "param/"))}
                for r in read_jsonl(path)]

    assert kept(tmp_path / "hooked" / "metrics.jsonl") == kept(tmp_path / "bare" / "metrics.jsonl")
    assert hooked["val/loss"] == bare["val/loss"]


def test_the_shipped_mlp_takes_its_auto_sizes_from_a_users_tensor_pair(tmp_path: Path, caplog):
    """model=mlp (input_dim, output_dim: auto): one example's input gives input_dim, the labels
    output_dim, said in the log; the built model is the one those sizes make."""
    built = built_on(tmp_path / "mlp", "tensor_pair", caplog, "model=mlp")
    assert "model.input_dim=auto: 4, the number of elements of one training example's input" in caplog.text
    assert "model.output_dim=auto: 5, the largest label of the training and validation sets + 1" in caplog.text
    assert (built["input_dim"], built["output_dim"]) == (4, 5)


def image_pair(size: int = 6, width: int | None = None, last: bool = False):
    """A user's image TensorDataset pair: 3 x size x width inputs (``last``: size x size x 3), labels 0..4."""
    gen = torch.Generator().manual_seed(0)
    shape = (size, size, 3) if last else (3, size, width or size)
    return (TensorDataset(torch.randn(40, *shape, generator=gen), torch.arange(40) % 5),
            TensorDataset(torch.randn(10, *shape, generator=gen), torch.arange(10) % 5))


class LabelHead(torch.nn.Module):
    """A model taking a HF-style ``num_labels``."""

    def __init__(self, num_labels: int):
        super().__init__()
        self.fc = torch.nn.Linear(4, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_the_shipped_cnn_takes_channels_and_image_size_from_a_users_image_pair(tmp_path: Path, caplog):
    """model=small_cnn (in_channels, image_size, num_classes: auto) on [3, 6, 6] images: the sizes come from one
    example, said in the log; a non-square image cannot say its image_size, and the error says what it saw."""
    built = built_on(tmp_path / "cnn", "image_pair", caplog)
    assert "model.in_channels=auto: 3, the first dimension of one training example's [C, H, W] input" in caplog.text
    assert "model.image_size=auto: 6, the height (= width) of one training example's [C, H, W] input" in caplog.text
    assert (built["in_channels"], built["image_size"], built["num_classes"]) == (3, 6, 5)
    overrides = ["data.dataset._target_=test_trainer.image_pair", *USERS_DATA]
    oblong = [*overrides, "+data.dataset.width=8"]
    with pytest.raises(ConfigError) as refused:
        train(config(*oblong), tmp_path / "oblong", oblong)
    assert str(refused.value) == (
        "model.image_size: is 'auto', but the data does not say it (the data gives: nothing). One training "
        "example's input has shape [3, 6, 8], not a square image [channels, size, size]. Set it: "
        "model.image_size=<value>.")
    channels_last = [*overrides, "+data.dataset.last=true"]
    with pytest.raises(ConfigError) as refused:
        train(config(*channels_last), tmp_path / "last", channels_last)
    assert str(refused.value).startswith("model.in_channels: ")
    assert "One training example's input has shape [6, 6, 3], not a square image [channels, size, size]. It " \
           "looks channels-last [size, size, channels]: permute it to [channels, size, size] (torch's layout), or " \
           "set the model's sizes." in str(refused.value)


def test_num_labels_auto_is_the_number_of_classes(tmp_path: Path, caplog):
    """A HF-style model's num_labels: auto takes what num_classes would (the labels' largest + 1)."""
    built = built_on(tmp_path / "labels", "tensor_pair", caplog, "model._target_=test_trainer.LabelHead",
                     "+model.num_labels=auto")
    assert built["num_labels"] == 5
    assert "model.num_labels=auto: 5, the largest label of the training and validation sets + 1" in caplog.text


@pytest.mark.grad_norm_plot  # the refusal lists the run's files, plots/ among them
def test_the_python_api_takes_resume_and_overwrite_and_its_errors_name_them(tmp_path: Path):
    """A script calling hookexp.run.train twice into one directory: train() takes resume= and overwrite=, and
    its errors name them (not the command line's +overwrite=true)."""
    from hookexp import CheckpointError, RunDirError
    from hookexp.run import compose
    from hookexp.run import train as run_train

    def cfg(steps: int):
        return compose(f"trainer.max_steps={steps}", "trainer.checkpoint_every=2", "logger=none",
                       "trainer.progress=false")

    run = tmp_path / "mine"
    assert run_train(cfg(2), run)["trainer/steps"] == 2
    with pytest.raises(RunDirError) as e:
        run_train(cfg(2), run)
    assert str(e.value) == (
        f"train(run_dir=...): {run.absolute()} already holds a run (metrics.jsonl, summary.json, manifest.json, "
        "checkpoints, plots); a new run there would mix its results with that one's. Continue that run with "
        "train(cfg, run_dir, resume=True), start it over with train(cfg, run_dir, overwrite=True) (deletes its "
        "results), or pass another run_dir.")
    missing = tmp_path / "other" / "checkpoints" / "last.pt"
    with pytest.raises(CheckpointError) as e:
        run_train(cfg(2), tmp_path / "third", resume=str(missing))
    assert str(e.value) == (
        f"train(resume=...): there is no checkpoint at {missing}. train(cfg, "
        "run_dir, resume=True) continues the run in run_dir (pass the interrupted run's directory); resume=PATH names "
        "a checkpoint or run directory.")
    assert run_train(cfg(2), tmp_path / "other", resume=True)["trainer/steps"] == 2  # no checkpoint yet: step 0 on
    resumed = run_train(cfg(4), run, resume=True)  # continues from step 2
    assert resumed["trainer/steps"] == 4
    steps = [r["trainer/step"] for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert steps[-1] == 3 and len(steps) == len(set(steps))
    fresh = run_train(cfg(2), run, overwrite=True)
    assert fresh["trainer/steps"] == 2
    assert [r["trainer/step"] for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r][-1] == 1
    (run / "checkpoints" / "last.pt").write_bytes(b"not a checkpoint")  # a corrupt checkpoint names train()'s fixes
    with pytest.raises(CheckpointError) as e:
        run_train(cfg(4), run, resume=True)
    assert str(e.value).startswith(f"train(resume=...): cannot resume from {run / 'checkpoints' / 'last.pt'}: it is "
                                   "not a readable checkpoint")
    assert str(e.value).endswith("Or start again with train(cfg, run_dir, overwrite=True).")


def test_the_spike_warning_names_spikes_jsonl_and_the_heatmap(tmp_path: Path, caplog):
    at = 30  # as tests/telemetry/test_forensics.py: an output scaled x50 at one step
    scale = f"+hooks.boom={{target: fc2, kind: forward, transform: scale, args: {{factor: 50.0}}, start_step: {at}, " \
            f"end_step: {at + 1}}}"
    with caplog.at_level("WARNING", logger="hookexp.train"):
        train(config(FORENSICS_ON, "model=mlp", "model.depth=4", "model.width=32", f"trainer.max_steps={at + 2}",
                     "stats.every=1", "guard.spike.metric=train/loss", "guard.spike.window=8",
                     "guard.spike.threshold=2", "guard.spike.checkpoint=false", scale), tmp_path)
    (warning,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("spike of ")]
    heatmap = tmp_path / "forensics" / f"step_{at}.png"
    assert warning.endswith(f"; its row: {tmp_path / 'spikes.jsonl'}, which layer went first: {heatmap}"), warning
    assert (tmp_path / "spikes.jsonl").exists() and heatmap.exists()


@pytest.mark.slow  # torch.compile with inductor; ./scripts/test.sh -m slow
def test_compiled_run_with_deterministic_algorithms_logs_eager_values_across_the_epochs_smaller_batch(
        tmp_path: Path):
    """docs/training.md's workaround for torch 2.13's inductor on a CPU, which zeroes the gradients behind the
    MaxPool2d in the graph of the epoch's smaller last batch (step 5: 157 examples): eager's values every step."""
    common = ["data.batch_size=256", "trainer.max_steps=8", "stats.every=1", "repro.deterministic=true",
              "trainer.eval_every_epochs=0"]
    train(config(*common), tmp_path / "eager")
    train(config(*common, "trainer.compile=true"), tmp_path / "compiled")
    rows_eager, rows_compiled = (rows_with(tmp_path / name / "metrics.jsonl", "train/loss")
                                 for name in ("eager", "compiled"))
    assert [r["trainer/step"] for r in rows_compiled] == [r["trainer/step"] for r in rows_eager] == list(range(8))
    assert [r["epoch"] for r in rows_eager] == [0] * 6 + [1] * 2  # step 5 ends the first epoch
    for e, c in zip(rows_eager, rows_compiled, strict=True):
        for key in ("train/loss", "grad/global_norm", "grad/conv1.weight/norm", "grad/conv2.weight/norm"):
            assert c[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), (e["trainer/step"], key)


@pytest.mark.parametrize(("model", "key", "context"), [
    (["model=gpt", "model.block_size=16", "model.d_model=16", "model.n_layer=1", "model.n_head=2"], "model.block_size",
     16),
    (["model=hf", "model.config.n_positions=16", "model.config.n_layer=1"], "model.config.n_positions", 16)])
def test_windows_longer_than_the_models_context_are_refused_naming_both_keys(tmp_path, model, key, context):
    """Without the check, the package GPT's forward raised a ValueError and a transformers GPT-2 an IndexError from
    its position embedding, deep in the first step."""
    if model[0] == "model=hf":
        pytest.importorskip("transformers")
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    data = ["task=causal_lm", "data=text_file", f"data.path={tmp_path / 'text.txt'}", "trainer.max_steps=1"]
    with pytest.raises(ConfigError) as e:
        train(config(*data, *model, "data.block_size=32"), tmp_path / "long")
    assert e.value.key == "data.block_size" and str(e.value) == (
        f"data.block_size: the data's windows have 32 tokens, more than the model takes ({key}={context}). Give "
        f"data.block_size={context} or less, or the model a longer context ({key}=32).")
    assert train(config(*data, *model, f"data.block_size={context}"), tmp_path / "fits")["status"] == "finished"


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.epoch=3", r"^trainer\.epoch: unknown setting\. Did you mean 'epochs'\?"),
    ("model.hiden=3", r"^model\.hiden: SmallCNN has no parameter 'hiden'\. Did you mean 'hidden'\?"),
    ("hooks=clamp_cnv", r"^hooks: no option 'clamp_cnv' \(hooks/clamp_cnv\.yaml is in no config folder\)\. Did you "
                        r"mean 'clamp_conv'\?"),
    ("trainer.epochs=abc", r"^trainer\.epochs: 'abc' is not a whole number \(int\)\.")])
def test_from_python_compose_and_train_answer_a_typo_as_the_command_line_does(tmp_path, override, message):
    """hookexp.run.compose let Hydra's own exceptions through (ConfigCompositionException advising '+key=...',
    MissingConfigException): now a misspelt key reaches train()'s checks, and the rest is a ConfigError."""
    from hookexp.run import compose
    from hookexp.run import train as run_train

    with pytest.raises(ConfigError, match=message):
        run_train(compose(override, "logger=none", "trainer.max_steps=1", "trainer.progress=false"), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()
