"""hookexp.watch in a hand loop, the Lightning callback in a lightning.Trainer and the HF callback in a
transformers.Trainer log the same statistics as the hookexp trainer on the same model and data."""

from __future__ import annotations

import importlib
import itertools
from pathlib import Path

import pytest
import torch
from conftest import has_module, read_jsonl, wandb_history
from frameworks import capture_logger, hf_model, hf_trainer, lightning_module
from omegaconf import OmegaConf

import hookexp
from hookexp import ConfigError
from hookexp.run import compose
from hookexp.run.build import build
from hookexp.run.distributed import Dist
from hookexp.run.loaders import to_device
from hookexp.run.loop import run_job as train

STEPS, EVERY = 7, 2  # the last step (6) is a log step of both
STATS = ["stats.activations=relu*", "stats.params=*", "stats.updates=*", "stats.optimizer=*",
         r"stats.group_by='re:^(conv|fc)\d'"]
CPU = torch.device("cpu")


def hooks() -> dict:
    """The trainer's hook set, hooks=clamp_conv (an output_grad clamp on conv1 and conv2), as a mapping."""
    return OmegaConf.to_container(config().hooks, resolve=True)


def config():
    return compose("logger=none", "trainer.progress=false", f"trainer.max_steps={STEPS}", f"stats.every={EVERY}",
                   "hooks=clamp_conv", *STATS)


@pytest.fixture(scope="module")
def trainer_rows(tmp_path_factory) -> dict[int, dict]:
    """What the hookexp trainer logs: step -> its statistics (grad/, act/, param/, update/, opt/, hook/)."""
    run = tmp_path_factory.mktemp("trainer") / "run"
    train(config(), run)
    return {r["trainer/step"]: r for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r}


def statistics(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(("grad/", "act/", "param/", "update/", "opt/"))
            or (k.startswith("hook/") and not k.endswith(("/calls", "/calls_last_step")))}


def assert_same(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want) == list(range(0, STEPS, EVERY))
    for step in want:
        expected = statistics(want[step])
        assert len(expected) > 100  # 8 parameters x (7 + 4 + 1) statistics, 3 relus x 3, group norms, the clamp
        assert sorted(statistics(got[step])) == sorted(expected), step
        for key, value in expected.items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)


def the_same_model_and_batches():
    """The trainer's model (same seed, same init), optimizer, task and first batches."""
    parts = build(config(), Dist(), CPU)
    batches = [to_device(b, CPU) for b in itertools.islice(parts.loaders.epoch(0), STEPS)]
    return parts, batches


def watch_settings() -> dict:
    return {"every": EVERY, "activations": "relu*", "params": "*", "updates": "*", "optimizer_state": "*",
            "group_by": r"re:^(conv|fc)\d", "hist_bins": 0}


def callback_stats() -> dict:
    """The same, as the callbacks take them: the keys of the trainer's stats config."""
    stats = watch_settings()
    stats["optimizer"] = stats.pop("optimizer_state")
    return stats


def test_watch_in_a_hand_loop_logs_what_the_trainer_logs(trainer_rows):
    parts, batches = the_same_model_and_batches()
    model, optimizer, task = parts.model, parts.optimizer, parts.task
    got: dict[int, dict] = {}
    with hookexp.watch(model, optimizer, log=lambda metrics, step: got.__setitem__(step, metrics), hooks=hooks(),
                       **{k: v for k, v in watch_settings().items() if k != "every"}, every=EVERY) as w:
        model.train()
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            task.loss(task.forward(model, batch), batch).backward()
            optimizer.step()
    assert w.step == STEPS
    assert_same(got, trainer_rows)
    assert not model.conv1._forward_hooks and not optimizer._optimizer_step_post_hooks  # all removed


def test_watch_logs_to_a_wandb_run_with_histograms(tmp_path: Path):
    import wandb

    parts, batches = the_same_model_and_batches()
    model, optimizer, task = parts.model, parts.optimizer, parts.task
    run = wandb.init(mode="offline", dir=str(tmp_path), project="watch-test")
    try:
        with hookexp.watch(model, optimizer, every=3, log=run, hist_bins=8):
            for batch in batches:
                optimizer.zero_grad()
                task.loss(task.forward(model, batch), batch).backward()
                optimizer.step()
    finally:
        run.finish()
    rows = [r for r in wandb_history(tmp_path) if "trainer/step" in r]
    assert [r["trainer/step"] for r in rows] == [0, 3, 6]
    assert {"grad/conv1.weight/norm", "grad/global_norm", "grad/fc2.bias/hist.values"} <= set(rows[1])
    assert len(rows[1]["grad/fc2.bias/hist.values"]) == 8


def test_bad_watch_settings_are_refused_naming_them():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"^watch\(every=\.\.\.\): must be a whole number of at least 1, got 0\."):
        hookexp.watch(model, opt, every=0)
    with pytest.raises(ConfigError, match=r"^watch\(log=\.\.\.\): expected a W&B run"):
        hookexp.watch(model, opt, log=42)
    with pytest.raises(ConfigError, match=r"^watch\(grads=\.\.\.\): target 'weigth' matches no parameter.*Did you "
                                          r"mean 'weight'"):
        hookexp.watch(model, opt, grads="weigth")
    with pytest.raises(ConfigError, match=r"^watch\(hist_bin=\.\.\.\): unknown setting\. Did you mean 'hist_bins'"):
        hookexp.watch(model, opt, hist_bin=8)
    with pytest.raises(ConfigError, match=r"^watch\(step=\.\.\.\): expected a whole number of optimizer steps"):
        hookexp.watch(model, opt, step=-1)
    assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks
    if has_module("lightning"):
        from hookexp.integrations.lightning import HookexpCallback

        with pytest.raises(ConfigError, match=r"^stats\.activation: unknown setting\. Did you mean 'activations'"):
            HookexpCallback(stats={"activation": "relu*"})


@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_a_callbacks_hook_specs_are_checked_when_it_is_made(framework):
    """A misspelt kind or transform argument fails where the callback is made, not once the fit has set up and
    training starts; the targets, which need the model, are resolved then."""
    pytest.importorskip("lightning" if framework == "lightning" else "transformers")
    from hookexp.errors import SpecError, TransformArgsError

    callback = importlib.import_module(f"hookexp.integrations.{framework}").HookexpCallback
    with pytest.raises(SpecError, match=r"^hooks\.c\.kind: unknown kind 'output_grads'\. Did you mean 'output_grad'"):
        callback(hooks={"c": {"target": "net.0", "kind": "output_grads", "transform": "clamp", "args": {"min": 0}}})
    with pytest.raises(TransformArgsError, match=r"^hooks\.c\.args\.mn: transform 'clamp' has no argument 'mn'\. "
                                                 r"Did you mean 'min'\?"):
        callback(hooks={"c": {"target": "net.0", "kind": "output_grad", "transform": "clamp", "args": {"mn": 0}}})
    assert callback(hooks={"c": {"target": "no_such_module", "kind": "forward", "transform": "zero"}}).watch is None


def test_a_callbacks_errors_found_on_the_model_name_its_stats_key():
    """The callbacks check their ``stats`` mapping when made, and its targets at the fit's start, on the model:
    both errors name the mapping's key (``stats.activations``), not watch()'s keyword."""
    from hookexp.telemetry.watch import Watch, callback_settings

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats, guard, options = callback_settings({"activations": "relu9", "every": 2}, None)
    with pytest.raises(ConfigError, match=r"^stats\.activations: target 'relu9' matches no module of Sequential\."):
        Watch(model, opt, stats, guard, options)
    assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks


def test_a_watch_that_starts_at_step_k_counts_the_hook_schedules_from_k():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = {"late": {"target": "weight", "kind": "pre_step", "transform": "zero", "start_step": 50}}
    before = model.weight.detach().clone()
    with hookexp.watch(model, opt, hooks=spec, step=100, every=10) as w:
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        assert torch.equal(model.weight.detach(), before) and w.hooks.step == 101  # zeroed: step 100 >= start_step
        assert w.last["hook/late/calls"] == 1 and "grad/weight/norm" in w.last  # step 100 logs: 100 % 10 == 0
        w.sync(205)  # the loop says where it is (a step GradScaler skipped, a resumed loop)
        assert w.hooks.step == 205 and not w.probes.active


@pytest.mark.skipif(not has_module("lightning"), reason="needs the extra .[lightning]")
def test_the_lightning_callback_logs_what_the_trainer_logs(trainer_rows, tmp_path: Path):
    import lightning.pytorch as pl

    from hookexp.integrations.lightning import HookexpCallback

    parts, batches = the_same_model_and_batches()
    net, task = parts.model, parts.task
    module = lightning_module(net, lambda m, batch: task.loss(task.forward(m, batch), batch),
                              lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.0))
    logger = capture_logger()
    trainer = pl.Trainer(max_steps=STEPS, logger=logger,
                         callbacks=[HookexpCallback(hooks=hooks(), stats=callback_stats())],
                         accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert_same(logger.rows, trainer_rows)


@pytest.mark.skipif(not has_module("transformers") or not has_module("accelerate"), reason="needs the extra .[hf]")
def test_the_hf_callback_logs_what_the_trainer_logs(trainer_rows, tmp_path: Path):
    import transformers

    from hookexp.integrations.hf import HookexpCallback

    parts, batches = the_same_model_and_batches()
    net, task, optimizer = parts.model, parts.task, parts.optimizer
    model = hf_model(net, lambda out, x, labels: task.loss(out, (x, labels)))
    got: dict[int, dict] = {}
    callback = HookexpCallback(hooks=hooks(), stats=callback_stats(),
                               log=lambda metrics, step: got.__setitem__(step, metrics))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, max_grad_norm=0.0,
                                          lr_scheduler_type="constant", report_to=[], use_cpu=True,
                                          logging_strategy="no", save_strategy="no", disable_tqdm=True)
    trainer = hf_trainer(batches, model=model, args=args, optimizers=(optimizer, None), callbacks=[callback])
    trainer.train()
    assert_same(got, trainer_rows)
    logged = [r for r in trainer.state.log_history if "grad/global_norm" in r]
    assert [r["trainer/step"] for r in logged] == [0, 2, 4, 6] and [r["step"] for r in logged] == [1, 3, 5, 7]
    assert callback.watch is None and not optimizer._optimizer_step_post_hooks  # removed at the end


@pytest.mark.skipif(not has_module("transformers") or not has_module("accelerate"), reason="needs the extra .[hf]")
def test_under_the_hf_trainers_own_clip_the_statistics_describe_the_clipped_gradient(tmp_path: Path):
    """Documented difference: the Trainer clips (max_grad_norm) before any callback or optimizer hook runs."""
    import transformers

    from hookexp.integrations.hf import HookexpCallback

    parts, batches = the_same_model_and_batches()
    net, task = parts.model, parts.task

    got: dict[int, dict] = {}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, max_grad_norm=0.05,
                                          report_to=[], use_cpu=True, logging_strategy="no", save_strategy="no",
                                          disable_tqdm=True)
    callback = HookexpCallback(stats={"every": 1, "hist_bins": 0}, log=lambda m, s: got.__setitem__(s, m))
    model = hf_model(net, lambda out, x, labels: task.loss(out, (x, labels)))
    hf_trainer(batches, model=model, args=args, optimizers=(parts.optimizer, None), callbacks=[callback]).train()
    assert sorted(got) == [0, 1, 2]
    assert all(row["grad/global_norm"] == pytest.approx(0.05, rel=1e-5) for row in got.values())


@pytest.mark.skipif(not has_module("lightning"), reason="needs the extra .[lightning]")
def test_a_resumed_lightning_fit_logs_from_its_global_step(tmp_path: Path):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import Logger

    from hookexp.integrations.lightning import HookexpCallback

    parts, batches = the_same_model_and_batches()
    net, task = parts.model, parts.task

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, i):
            return task.loss(task.forward(self.net, batch), batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Capture(Logger):
        name, version = "capture", 0

        def __init__(self):
            super().__init__()
            self.steps: list[int] = []

        def log_metrics(self, metrics, step=None):
            if "trainer/step" in metrics:
                self.steps.append(step)

        def log_hyperparams(self, *args, **kwargs):
            pass

    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    common = dict(accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=str(tmp_path), enable_checkpointing=False)
    first, again = Capture(), Capture()
    trainer = pl.Trainer(max_steps=4, logger=first, callbacks=[HookexpCallback(stats={"every": 2})], **common)
    trainer.fit(Module(), loader)
    trainer.save_checkpoint(tmp_path / "at4.ckpt")
    pl.Trainer(max_steps=8, logger=again, callbacks=[HookexpCallback(stats={"every": 2})], **common).fit(
        Module(), loader, ckpt_path=tmp_path / "at4.ckpt")
    assert first.steps == [0, 2] and again.steps == [4, 6]
