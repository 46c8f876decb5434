"""The Hydra tree, through the compose API: every option of every group composes, builds and runs a
step; typos and wrong types fail at compose time."""

from __future__ import annotations

from importlib import resources

import pytest
import torch
from conftest import has_module, options
from hydra import compose
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from hookexp.run.build import build
from hookexp.run.distributed import Dist
from hookexp.run.loaders import to_device
from hookexp.run.loop import check_hooks

GROUPS = ("task", "model", "data", "optim", "scheduler", "trainer", "guard", "hooks", "stats", "logger", "experiment")
CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("hydra_conf")  # conftest's: every test here composes


def test_every_group_has_options():
    for group in GROUPS:
        assert options(group), group


def one_step(*overrides: str) -> float:
    """Build the job the overrides describe and train one step of it; returns the loss."""
    cfg = compose("config", overrides=["trainer.max_steps=1", *overrides])
    parts = build(cfg, Dist(), CPU)
    batch = to_device(next(parts.loaders.epoch(0)), CPU)
    loss = parts.task.loss(parts.task.forward(parts.model, batch), batch)
    loss.backward()
    parts.optimizer.step()
    if parts.scheduler is not None:
        parts.scheduler.step()
    assert torch.isfinite(loss)
    return loss.item()


# Every task with every model and data it fits. torchvision and hf_disk need their packages and local files:
# tests/test_data.py covers them.
TEXT = ["data=text_file", "data.path=${oc.env:HOOKEXP_TEST_TEXT}", "data.block_size=16"]
JOBS = {
    **{f"classification-{m}-{d}": [f"model={m}", f"data={d}"]
       for m in ("small_cnn", "mlp", "seed_net", "transformer") for d in ("digits", "synthetic")},
    "classification-gpt-modular_addition": ["model=gpt", "data=modular_addition", "data.p=11"],
    "causal_lm-gpt-text_file": ["task=causal_lm", "model=gpt", *TEXT],
    "causal_lm-hf-text_file": ["task=causal_lm", "model=hf", *TEXT],
    "regression-mlp-synthetic_regression": ["task=regression", "model=mlp", "data=synthetic_regression"],
}


@pytest.mark.parametrize("job", list(JOBS))
def test_every_task_with_every_model_and_data_it_fits_builds_and_steps(job, tmp_path, monkeypatch):
    if "-hf-" in job:
        pytest.importorskip("transformers")
    text = tmp_path / "text.txt"
    text.write_text("hookexp trains what researchers study. " * 20)
    monkeypatch.setenv("HOOKEXP_TEST_TEXT", str(text))
    one_step(*JOBS[job])


def test_every_model_and_data_option_is_in_a_job():
    used = {o.split("=")[1] for job in JOBS.values() for o in job if o.startswith(("model=", "data=", "task="))}
    assert set(options("model")) <= used and set(options("task")) - used == {"classification"}  # the default
    assert set(options("data")) - used == {"torchvision", "hf_disk"}


@pytest.mark.parametrize("optim", options("optim"))
@pytest.mark.parametrize("scheduler", options("scheduler"))
def test_every_optimizer_with_every_schedule(optim, scheduler):
    one_step(f"optim={optim}", f"scheduler={scheduler}")


FOR_GPT = ["model=gpt", "data=modular_addition", "data.p=11"]  # hook sets written for the gpt model's blocks
HOOK_JOBS = {"ablate_attn_eval": FOR_GPT}


@pytest.mark.parametrize("hooks", options("hooks"))
def test_every_hook_set_passes_the_dry_run_on_a_model_it_fits(hooks):
    cfg = compose("config", overrides=[f"hooks={hooks}", *HOOK_JOBS.get(hooks, [])])
    specs = OmegaConf.to_container(cfg.hooks, resolve=True)
    report = check_hooks(build(cfg, Dist(), CPU), specs)
    assert report.ok, report.errors
    assert [r["spec"] for r in report.rows] == list(specs)
    assert all(r["targets"] and r["calls_per_step"] > 0 for r in report.rows), report.rows
    assert (hooks == "none") == (not specs)


def test_hook_sets_merge_and_tune():
    cfg = compose("config", overrides=["hooks=[clamp_conv,zero_fc_bias]", "hooks.clamp_conv.args.min=-1",
                                       "hooks.zero_fc_bias.enabled=false"])
    assert list(cfg.hooks) == ["clamp_conv", "zero_fc_bias"]
    assert cfg.hooks.clamp_conv.args.min == -1 and cfg.hooks.zero_fc_bias.enabled is False
    cfg = compose("config", overrides=["hooks=[clamp_conv,zero_fc_bias]", "~hooks.clamp_conv"])
    assert list(cfg.hooks) == ["zero_fc_bias"]


@pytest.mark.parametrize("group", ["trainer", "stats", "logger", "guard"])
def test_every_option_of_plain_groups_composes(group):
    for option in options(group):
        cfg = compose("config", overrides=[f"{group}={option}"])
        assert OmegaConf.to_container(cfg, resolve=True)[group]


# The typed keys of every composed config as they were when the defaults were still repeated in conf/trainer,
# conf/stats and conf/guard: written out here so that moving a default (into hookexp/config.py or
# anywhere else) cannot silently change it. DEFAULTS: what the main config has; CHANGED: what an option changes.
DEFAULTS = {
    "seed": 0, "resume": None, "optimized_metric": None, "repro.deterministic": False,
    "trainer.epochs": None, "trainer.max_steps": None, "trainer.accumulate": 1, "trainer.clip_grad_norm": None,
    "trainer.eval_every": None, "trainer.eval_every_epochs": 1, "trainer.stop_when": None, "trainer.device": "auto",
    "trainer.num_threads": 1, "trainer.progress": True, "trainer.save_records": True, "trainer.precision": "fp32",
    "trainer.compile": False, "trainer.compile_backend": "inductor", "trainer.checkpoint_every": None,
    "trainer.strategy": "auto", "trainer.fsdp.wrap": "@blocks", "trainer.fsdp.reshard_after_forward": True,
    "guard.nan_policy": "raise", "guard.spike.metric": None, "guard.spike.window": 20, "guard.spike.threshold": 3.0,
    "guard.spike.min_value": 0.0, "guard.spike.steps": 10, "guard.spike.record": [], "guard.spike.checkpoint": True,
    "guard.spike.action": "log", "guard.rollback.every": 10, "guard.rollback.keep": 3, "guard.rollback.skip": None,
    "guard.rollback.max": 5,
    "guard.forensics.window": 32, "guard.forensics.z": 8.0, "guard.forensics.top": 10, "guard.forensics.updates": False,
    "stats.every": 10, "stats.grads": "*", "stats.activations": None, "stats.hist_bins": 0, "stats.hist_sample": 4096,
    "stats.params": None, "stats.updates": None, "stats.optimizer": None, "stats.group_by": None,
    "stats.gns": False, "stats.gns_ema": 0.95, "stats.compile": None,
    "logger._target_": "hookexp.run.sinks.WandbSink", "logger.mode": "offline", "logger.project": "hookexp",
    "logger.entity": None,
    "logger.group": None, "logger.job_type": "train", "logger.name": None, "logger.tags": [],
    "logger.init_timeout": 30.0, "logger.quiet": True,
}
CHANGED = {
    "logger=none": {"logger._target_": None, "logger.mode": "disabled"},
    "logger=tensorboard": {"logger._target_": "hookexp.run.sinks.TensorBoardSink"},
    "experiment=coord_check": {
        "trainer.max_steps": 4, "trainer.progress": False, "stats.every": 1, "stats.grads": None,
        "stats.activations": r"re:^(fc\d+|embed|blocks\.\d+|blocks\.\d+\.attn|blocks\.\d+\.mlp|head)$",
        "logger._target_": None, "logger.mode": "disabled", "logger.group": "coord_check"},
    "experiment=dead_relu_clamp": {"stats.every": 5, "logger.group": "dead_relu_clamp", "logger.tags": ["study"]},
    "experiment=grad_noise_deep_mlp": {"trainer.epochs": 20, "logger.group": "grad_noise_deep_mlp",
                                       "logger.tags": ["study"]},
    "experiment=grokfast": {"trainer.epochs": 1000, "trainer.stop_when": "val/acc=0.95", "trainer.progress": False,
                            "logger.group": "grokfast", "logger.tags": ["study"]},
    "experiment=grokking_weight_decay": {
        "trainer.epochs": 15000, "trainer.eval_every": 100, "trainer.eval_every_epochs": 0, "trainer.progress": False,
        "stats.every": 100, "stats.params": "*", "stats.group_by": r"re:^(blocks\.\d+|embed|pos_embed|head)",
        "logger.group": "grokking_weight_decay", "logger.tags": ["study"]},
    "experiment=seed_hooks": {"logger.group": "seed_hooks", "logger.tags": ["study"]},
    "experiment=gradient_noise_scale": {
        "trainer.epochs": 25, "trainer.accumulate": 4, "trainer.progress": False, "stats.grads": None,
        "stats.gns": True, "stats.group_by": r"re:^(conv\d|fc\d)", "logger.group": "gradient_noise_scale",
        "logger.tags": ["study"]},
    "experiment=loss_spikes": {
        "trainer.max_steps": 1000, "trainer.eval_every": 100, "trainer.eval_every_epochs": 0, "trainer.progress": False,
        "stats.every": 1, "stats.grads": None, "guard.spike.metric": "train/loss", "guard.spike.threshold": 2.5,
        "guard.rollback.max": 100, "logger.group": "loss_spikes", "logger.tags": ["study"]},
    "sweep=optuna_lr": {"trainer.epochs": 5},
}
TOP_LEVEL = ["seed", "model", "task", "data", "optim", "scheduler", "trainer", "guard", "hooks", "stats", "logger",
             "repro", "resume", "optimized_metric"]


def flatten(node: dict, prefix: str = "") -> dict:
    """A nested mapping as ``{dotted.key: value}``; an empty mapping is a value."""
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def typed_values(cfg) -> dict:
    """The composed config's typed keys (DEFAULTS' keys), flattened."""
    container = OmegaConf.to_container(cfg)
    return flatten({key: container[key] for key in ("seed", "resume", "optimized_metric", "repro", "trainer", "guard",
                                                    "stats", "logger")})


ALL_OPTIONS = ["", *(f"{g}={o}" for g in (*GROUPS, "sweep") for o in options(g)),
               *(f"+{g}={o}" for g in ("grokfast_filter", "parametrization") for o in options(g))]


@pytest.mark.parametrize("override", ALL_OPTIONS)
def test_every_option_of_every_group_composes_to_the_values_it_had(override):
    if override.startswith("sweep=") and not has_module("hydra_plugins.hydra_optuna_sweeper"):
        pytest.skip("extra .[sweeps] not installed")
    cfg = compose("config", overrides=[override] if override else [])
    assert list(cfg) == TOP_LEVEL  # --cfg job prints the keys in this order
    assert typed_values(cfg) == {**DEFAULTS, **CHANGED.get(override, {})}


def test_the_fixture_names_only_options_that_exist():
    assert set(CHANGED) <= set(ALL_OPTIONS)


@pytest.mark.parametrize("path", ["config.yaml", *(f"{g}/{o}.yaml" for g in ("trainer", "stats", "guard")
                                                  for o in options(g))])
def test_typed_options_hold_only_what_differs_from_the_schema(path):
    """Defaults live in hookexp/config.py: a yaml option that repeats one (or its comment) is a second copy."""
    import yaml

    written = yaml.safe_load((resources.files("hookexp.conf") / path).read_text()) or {}
    written = {k: v for k, v in written.items() if k not in ("defaults", "hydra")}
    repeated = {key: value for key, value in flatten(written, path.split("/")[0] + "." if "/" in path else "").items()
                if key in DEFAULTS and value == DEFAULTS[key]}
    assert not repeated, f"{path} repeats defaults of hookexp/config.py: {repeated}"


def test_a_bad_logger_mode_composes_but_is_refused_before_anything_runs():
    from hookexp import ConfigError
    from hookexp.run.sinks import check_logger

    cfg = compose("config", overrides=["logger.mode=1.5"])  # a str field takes it
    with pytest.raises(ConfigError, match=r"^logger\.mode: unknown W&B mode '1\.5'\. Use offline, online or disabled"):
        check_logger(cfg.logger)


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("trainer.epoch=3", "Key 'epoch' not in 'TrainerConfig'"),
        ("trainer.epochs=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
        ("hooks.clamp_conv.enabld=false", "Could not override 'hooks.clamp_conv.enabld'"),
        ("stats.evry=5", "Key 'evry' not in 'StatsConfig'"),
        ("hooks=does_not_exist", "Could not find 'hooks/does_not_exist'"),
    ],
)
def test_typos_fail_at_compose(override, pattern):
    overrides = ["hooks=clamp_conv", override] if override.startswith("hooks.") else [override]
    with pytest.raises(ConfigCompositionException) as e:
        compose("config", overrides=overrides)
    assert pattern in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize(("override", "message"), [
    ("hooks.clamp_conv.types=Conv2d", "hooks.clamp_conv.types: 'Conv2d' is not a list. hooks.clamp_conv.types "
     "takes a list, e.g. hooks.clamp_conv.types=[Conv2d] (hooks.clamp_conv.types=[] for none)."),
    ("logger.tags=x", "logger.tags: 'x' is not a list. logger.tags takes a list, e.g. logger.tags=[x] (logger.tags=[] "
     "for none)."),
    ("hooks.clamp_conv.args=5", "hooks.clamp_conv.args: 5 is not a mapping. hooks.clamp_conv.args takes a mapping, "
     "e.g. hooks.clamp_conv.args={name:value} (python -m hookexp --cfg job shows the config)."),
])
def test_a_value_where_a_list_or_mapping_goes_is_named_with_the_syntax(override, message):
    """Not OmegaConf's "Invalid value assigned: str is not a ListConfig, list or tuple.." and its type names."""
    from hookexp.run.hydra_api import explain_hydra_error

    with pytest.raises(ConfigCompositionException) as e:
        compose("config", overrides=["hooks=clamp_conv", override])
    assert str(explain_hydra_error(e.value)) == message


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes_and_passes_the_dry_run(experiment):
    cfg = compose("config", overrides=[f"experiment={experiment}"])
    assert cfg.logger.group == experiment  # each study groups its W&B runs
    report = check_hooks(build(cfg, Dist(), CPU), OmegaConf.to_container(cfg.hooks, resolve=True))
    assert report.ok and (report.rows or not cfg.hooks), report.errors  # coord_check: statistics, no hooks


def test_there_are_three_studies_with_their_results():
    from pathlib import Path

    root = Path(__file__).parents[2] / "experiments"
    for study in options("experiment"):
        readme = (root / study / "README.md").read_text()
        assert "**Question.**" in readme and "**Reproduce**" in readme and f"experiment={study}" in readme
        table = [line for line in (root / study / "report.md").read_text().splitlines() if line.startswith("| ")]
        assert all(line in readme for line in table)  # the README shows the report's table verbatim
        assert (root / study / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert len(options("experiment")) >= 3


@pytest.mark.skipif(not has_module("hydra_plugins.hydra_optuna_sweeper"), reason="extra .[sweeps] not installed")
@pytest.mark.parametrize("sweep", options("sweep"))
def test_every_sweep_composes(sweep):
    cfg = compose("config", overrides=[f"sweep={sweep}"], return_hydra_config=True)
    assert cfg.hydra.sweeper.params


def test_every_package_and_config_folder_ships_in_the_wheel():
    """pyproject.toml lists its packages: a new package or config group missing there works in an editable
    install and is absent from a wheel."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    code = {".".join(p.parent.relative_to(root).parts) for p in (root / "hookexp").rglob("__init__.py")}
    conf = {".".join(("hookexp", "conf", *p.parent.relative_to(root / "conf").parts))
            for p in (root / "conf").rglob("*.yaml")}
    assert code | conf <= listed, sorted((code | conf) - listed)


def test_a_users_model_gets_no_key_of_the_default_model_config(tmp_path, monkeypatch, caplog):
    """model._target_=tiny.Tiny over small_cnn: Tiny takes `hidden` too, but small_cnn's hidden: 64 is not the
    user's value. Only the keys set on the command line (and `auto` ones, from the data) are passed."""
    (tmp_path / "tiny.py").write_text(
        "import torch\n\n"
        "class Tiny(torch.nn.Module):\n"
        "    def __init__(self, hidden=16, num_classes=10, width=3):\n"
        "        super().__init__()\n        self.hidden, self.width = hidden, width\n"
        "        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, hidden), torch.nn.ReLU(),\n"
        "                                       torch.nn.Linear(hidden, num_classes))\n\n"
        "    def forward(self, x):\n        return self.net(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = ["model._target_=tiny.Tiny", "model.width=5"]
    with caplog.at_level("INFO", logger="hookexp.build"):
        parts = build(compose("config", overrides=overrides), Dist(), CPU, overrides)
    assert parts.model.hidden == 16 and parts.model.width == 5
    assert parts.model_config == {"_target_": "tiny.Tiny", "num_classes": 10, "width": 5}
    assert ("model: tiny.Tiny gets only the keys set for it: hidden=64 of the default model config not passed "
            "(set one with ++model.hidden=...)") in caplog.text


def test_a_target_that_does_not_import_says_which_part_is_missing(tmp_path, monkeypatch, caplog):
    """A misspelt class in the user's module is not "no module named 'mine.Nett'": the module imported, the name
    is missing, with the close names; an error inside the user's module names that module and its cause. Nothing
    is logged besides the error (Hydra's get_object logs one of its own)."""
    from hookexp import ConfigError
    from hookexp.run.instantiate import target_of

    (tmp_path / "mine.py").write_text("class Net:\n    pass\n")
    (tmp_path / "mine_broken.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fix = " Give the full dotted path of something importable; your own modules are found from the current directory"
    cases = {
        "mine.Nett": "module 'mine' has no attribute 'Nett'. Did you mean 'Net'?",
        "mine_missing.Net": "no module named 'mine_missing'.",
        "mine_broken.Net": "importing 'mine_broken' raised ModuleNotFoundError: No module named 'no_such_dependency'.",
        "torch.optim.SDG": "module 'torch.optim' has no attribute 'SDG'. Did you mean 'SGD' or 'ASGD'?",
        "mine..Net": "'mine..Net' is not a dotted path (pkg.module.name).",
    }
    with caplog.at_level("DEBUG"):
        for path, why in cases.items():
            with pytest.raises(ConfigError) as e:
                target_of({"_target_": path}, "model")
            assert str(e.value).startswith(f"model._target_: cannot import {path!r}: {why}{fix}"), str(e.value)
    assert caplog.records == []
    assert target_of({"_target_": "mine.Net"}, "model").__name__ == "Net"
    assert target_of({"_target_": "xml.dom.minidom.parseString"}, "model").__name__ == "parseString"  # a submodule
