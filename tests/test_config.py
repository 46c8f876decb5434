"""The Hydra tree, through the compose API: every option of every group composes, builds and runs a
step; typos and wrong types fail at compose time."""

from __future__ import annotations

from importlib import resources

import pytest
import torch
from conftest import has_module
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from hookexp import validate
from hookexp.data import as_splits
from hookexp.train import fill_auto

GROUPS = ("model", "data", "optim", "trainer", "hooks", "stats", "logger", "experiment")


def options(group: str) -> list[str]:
    folder = resources.files("hookexp.conf") / group
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


@pytest.fixture(scope="module", autouse=True)
def hydra_conf():
    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        yield


def test_every_group_has_options():
    for group in GROUPS:
        assert options(group), group


def built(cfg):
    """The data and the model of ``cfg``, the model's ``auto`` arguments filled from the data."""
    splits = as_splits(instantiate(cfg.data.dataset))
    fill_auto(cfg.model, splits.info)
    return splits, instantiate(cfg.model)


# Token data and models (text_file, modular_addition, gpt, hf, ...): tests/test_data.py and tests/test_models.py.
@pytest.mark.parametrize("model", ["small_cnn", "mlp", "seed_net", "transformer"])
@pytest.mark.parametrize("data", ["digits", "synthetic"])
def test_every_image_model_with_every_image_data_builds_and_steps(model, data):
    cfg = compose("config", overrides=[f"model={model}", f"data={data}"])
    splits, net = built(cfg)
    opt = instantiate(cfg.optim)(params=net.parameters())
    x, y = next(iter(splits.loaders(cfg.data.batch_size, 0)[0]))
    info = splits.info
    assert x.shape[1:] == (info["in_channels"], info["image_size"], info["image_size"])
    logits = net(x)
    assert logits.shape == (len(y), info["num_classes"])
    torch.nn.functional.cross_entropy(logits, y).backward()
    opt.step()


@pytest.mark.parametrize("optim", options("optim"))
def test_every_optimizer(optim):
    cfg = compose("config", overrides=[f"optim={optim}"])
    opt = instantiate(cfg.optim)(params=built(cfg)[1].parameters())
    assert type(opt).__name__ == cfg.optim._target_.rsplit(".", 1)[1]


@pytest.mark.parametrize("hooks", options("hooks"))
def test_every_hook_set_passes_the_dry_run_on_the_default_model(hooks):
    cfg = compose("config", overrides=[f"hooks={hooks}"])
    net = built(cfg)[1]
    opt = instantiate(cfg.optim)(params=net.parameters())
    specs = OmegaConf.to_container(cfg.hooks, resolve=True)
    batch = (torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    report = validate(net, specs, batch, opt)
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


@pytest.mark.parametrize("group", ["trainer", "stats", "logger"])
def test_every_option_of_plain_groups_composes(group):
    for option in options(group):
        cfg = compose("config", overrides=[f"{group}={option}"])
        assert OmegaConf.to_container(cfg, resolve=True)[group]


def test_a_bad_logger_mode_composes_but_is_refused_before_anything_runs():
    from hookexp import ConfigError
    from hookexp.sinks import check_logger

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


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes_and_passes_the_dry_run(experiment):
    cfg = compose("config", overrides=[f"experiment={experiment}"])
    assert cfg.logger.group == experiment  # each study groups its W&B runs
    splits, net = built(cfg)
    opt = instantiate(cfg.optim)(params=net.parameters())
    train_loader, _ = splits.loaders(cfg.data.batch_size, 0)
    report = validate(net, OmegaConf.to_container(cfg.hooks, resolve=True), next(iter(train_loader)), opt)
    assert report.ok and report.rows, report.errors


def test_there_are_three_studies_with_their_results():
    from pathlib import Path

    root = Path(__file__).parents[1] / "experiments"
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
