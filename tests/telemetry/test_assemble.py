"""One observer builder: the same stats and guard configuration gives the same observers (names, order,
settings) in the hookexp trainer, hookexp.watch(), the Lightning callback and the HF callback."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import has_module

import hookexp
from hookexp import ConfigError
from hookexp.config import GuardConfig, SpikeConfig, StatsConfig
from hookexp.engine import attach
from hookexp.run import compose
from hookexp.run.build import build
from hookexp.run.distributed import Dist
from hookexp.run.trainer import hook_specs, trainer_observers
from hookexp.telemetry.assemble import Wiring, build_observers

CPU = torch.device("cpu")
STATS = {"every": 2, "activations": "relu*", "params": "*", "updates": "*", "optimizer": "*",
         "group_by": r"re:^(conv|fc)\d", "hist_bins": 8, "hist_sample": 100, "gns": True, "gns_ema": 0.5}
SPIKE = {"metric": "grad/global_norm", "window": 5, "threshold": 4.0, "steps": 3}
FORENSICS = {"window": 16, "z": 6.0, "top": 5}
LOOP_OWNED = ("meter", "guard", "clip")  # what only the trainer's loop has: its task metrics, NaN guard and clip


def config():
    stats = [f"stats.{k}={v}" if k != "group_by" else f"stats.{k}='{v}'" for k, v in STATS.items()]
    guard = [f"guard.spike.{k}={v}" for k, v in SPIKE.items()] + [f"guard.forensics.{k}={v}"
                                                                   for k, v in FORENSICS.items()]
    return compose("logger=none", "trainer.progress=false", "trainer.max_steps=2", "trainer.accumulate=2",
                   "hooks=clamp_conv", *stats, *guard)


def described(observers: Any) -> list[tuple[str, Any]]:
    """Each observer's name and settings, in order."""
    out = []
    for name, o in observers.named.items():
        if name == "stats":
            settings: Any = ([k for k, _ in o.grads], [n for n, _ in o.params], [n for n, _ in o.updates],
                             [n for n, _ in o.opt_params], sorted(o._acts.names) if o._acts else None,
                             o.describer.hist_bins, o.describer.hist_sample, o._acts_sharded,
                             [o._group(k[5:]) for k, _ in o.grads])
        elif name == "gns":
            settings = (o.ema, o.groups, o.names, o.batch_size)
        elif name == "forensics":
            settings = (o.window, o.z, o.top, o.track_updates)
        elif name == "spike":
            settings = (o.metric, o.window, o.threshold, o.steps, o.min_value, o.record, o.checkpoint,
                        o.forensics is observers.named.get("forensics"))
        elif name == "hooks":
            settings = [row["spec"] for row in o.hooks.table()]
        else:
            settings = type(o).__name__
        out.append((name, settings))
    return out


@pytest.fixture(scope="module")
def trainer_observers_described() -> list[tuple[str, Any]]:
    cfg = config()
    parts = build(cfg, Dist(), CPU)
    hooks = attach(parts.model, hook_specs(cfg), parts.optimizer, measure=False)
    observers = trainer_observers(cfg, parts, hooks)
    try:
        assert list(observers.named) == ["meter", "hooks", "guard", "stats", "gns", "forensics", "spike"]
        return [(n, s) for n, s in described(observers) if n not in LOOP_OWNED]
    finally:
        observers.close()
        hooks.remove()


def model_and_optimizer():
    parts = build(config(), Dist(), CPU)
    return parts.model, parts.optimizer


def watch_keywords() -> dict[str, Any]:
    """The same configuration as hookexp.watch keywords (``optimizer_state``: stats.optimizer)."""
    keywords = {("optimizer_state" if k == "optimizer" else k): v for k, v in STATS.items()}
    return {**keywords, "spike": SPIKE, "forensics": FORENSICS, "hooks": hook_specs(config())}


def test_the_trainer_builds_every_observer_of_the_config(trainer_observers_described):
    names = [n for n, _ in trainer_observers_described]
    assert names == ["hooks", "stats", "gns", "forensics", "spike"]
    settings = dict(trainer_observers_described)
    assert settings["gns"][0] == 0.5 and settings["gns"][1] == ["conv1", "conv2", "fc1", "fc2"]
    assert settings["forensics"] == (16, 6.0, 5, False)
    assert settings["spike"] == ("grad/global_norm", 5, 4.0, 3, 0.0, (), True, True)
    assert settings["stats"][5:8] == (8, 100, False)
    assert settings["hooks"] == ["clamp_conv"]


def test_watch_builds_the_trainers_observers(trainer_observers_described):
    model, optimizer = model_and_optimizer()
    with hookexp.watch(model, optimizer, **watch_keywords()) as w:
        assert described(w.observers) == trainer_observers_described


def test_watch_takes_the_config_objects_too(trainer_observers_described):
    model, optimizer = model_and_optimizer()
    stats = StatsConfig(**STATS)
    with hookexp.watch(model, optimizer, stats=stats, spike=SPIKE, forensics=FORENSICS,
                       hooks=hook_specs(config())) as w:
        assert described(w.observers) == trainer_observers_described


@pytest.mark.skipif(not has_module("lightning"), reason="needs the extra .[lightning]")
def test_the_lightning_callback_builds_the_trainers_observers(trainer_observers_described, tmp_path: Path):
    from hookexp.integrations.lightning import HookexpCallback

    model, optimizer = model_and_optimizer()
    callback = HookexpCallback(hooks=hook_specs(config()), stats=STATS, guard={"spike": SPIKE, "forensics": FORENSICS})
    trainer = SimpleNamespace(optimizers=[optimizer], default_root_dir=str(tmp_path), precision_plugin=None,
                              global_step=0, loggers=[])
    callback.on_train_start(trainer, model)
    try:
        assert described(callback.watch.observers) == trainer_observers_described
    finally:
        callback.on_train_end(trainer, model)


@pytest.mark.skipif(not has_module("transformers"), reason="needs the extra .[hf]")
def test_the_hf_callback_builds_the_trainers_observers(trainer_observers_described, tmp_path: Path):
    from hookexp.integrations.hf import HookexpCallback

    model, optimizer = model_and_optimizer()
    callback = HookexpCallback(hooks=hook_specs(config()), stats=STATS, guard={"spike": SPIKE, "forensics": FORENSICS},
                               log=lambda metrics, step: None)
    args, state = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=0, log_history=[])
    callback.on_train_begin(args, state, None, model=model, optimizer=optimizer)
    try:
        assert described(callback.watch.observers) == trainer_observers_described
    finally:
        callback.on_train_end(args, state, None)


def test_a_failing_observer_closes_those_built_before_it():
    """The builder's ExitStack: the probes' and the noise scale's hooks are gone when a later observer is refused."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"^guard\.spike\.metric: 'no/such' is not a metric"):
        build_observers(model, optimizer, StatsConfig(activations="*", gns=True),
                        GuardConfig(spike=SpikeConfig(metric="no/such")), Wiring())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not any(p._backward_hooks for p in model.parameters())
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_stats_checks_name_the_trainers_key_or_watchs_keyword():
    with pytest.raises(ConfigError, match=r"^stats\.every: must be a whole number of at least 1, got 0\.$"):
        StatsConfig(every=0)
    with pytest.raises(ConfigError, match=r"^stats\.gns_ema: must be a number in \[0, 1\)"):
        StatsConfig(gns_ema=1.0)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"^watch\(every=\.\.\.\): must be a whole number of at least 1, got 'a'\."):
        hookexp.watch(model, optimizer, every="a")
    with pytest.raises(ConfigError, match=r"^watch\(optimizer_state=\.\.\.\): target 'nothing' matches no"):
        hookexp.watch(model, optimizer, optimizer_state="nothing")
