"""The settings the studies of experiments/ need, against hand-written torch: the official Grokfast code's
block layout, initialisation, warmup and optimizer; a split drawn from the run's seed; trainer.stop_when and
trainer.eval_every_epochs; every study config composes and trains a few steps; the
gradient_noise_scale study's table script on shortened runs."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import config, read_jsonl
from omegaconf import OmegaConf

from hookexp.errors import ConfigError
from hookexp.run.build import build
from hookexp.run.distributed import Dist
from hookexp.run.loop import run_job as train
from hookexp.workloads.models import GPT
from hookexp.workloads.schedules import constant


def test_normed_stream_layout_normalises_the_stream_before_attention():
    torch.manual_seed(0)
    model = GPT(vocab_size=11, block_size=5, n_layer=2, n_head=4, d_model=16, layout="normed_stream")
    ids = torch.randint(0, 11, (3, 4))
    x = model.embed(ids) + model.pos_embed(torch.arange(4))
    for block in model.blocks:  # the official code's Block.forward, written out
        x = block.ln1(x)
        x = x + block.attn(x)
        x = x + block.mlp(block.ln2(x))
    torch.testing.assert_close(model(ids), model.head(model.norm(x)), rtol=0, atol=0)
    pre = GPT(vocab_size=11, block_size=5, n_layer=2, n_head=4, d_model=16)
    pre.load_state_dict(model.state_dict())
    assert not torch.allclose(pre(ids), model(ids))  # the layouts differ on the same weights


def test_torch_init_keeps_pytorchs_module_defaults():
    torch.manual_seed(3)
    model = GPT(vocab_size=99, block_size=5, n_layer=2, n_head=4, d_model=128, init="torch")
    torch.manual_seed(3)
    embed, pos = torch.nn.Embedding(99, 128), torch.nn.Embedding(5, 128)  # built first, in this order
    torch.testing.assert_close(model.embed.weight, embed.weight, rtol=0, atol=0)
    torch.testing.assert_close(model.pos_embed.weight, pos.weight, rtol=0, atol=0)
    assert 0.95 < model.embed.weight.std().item() < 1.05  # N(0, 1), not GPT-2's N(0, 0.02)
    fc = model.blocks[0].mlp.fc
    bound = 1 / math.sqrt(fc.in_features)  # Linear's kaiming-uniform default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert fc.weight.abs().max().item() <= bound and fc.weight.abs().max().item() > 0.95 * bound
    assert fc.bias.abs().max().item() > 0.5 * bound  # biases are drawn too, not zeroed
    qkv, proj = model.blocks[1].attn.qkv, model.blocks[1].attn.proj  # as nn.MultiheadAttention initialises them
    xavier = math.sqrt(6 / (qkv.in_features + qkv.out_features))
    assert 0.95 * xavier < qkv.weight.abs().max().item() <= xavier
    assert not qkv.bias.any() and not proj.bias.any() and proj.weight.abs().max().item() <= 1 / math.sqrt(128)
    gpt2 = GPT(vocab_size=99, block_size=5, n_layer=2, n_head=4, d_model=128)
    assert gpt2.embed.weight.std().item() == pytest.approx(0.02, rel=0.05) and not gpt2.blocks[0].mlp.fc.bias.any()


def test_normal_init_draws_every_weight_from_one_std_and_zeroes_biases():
    std = 1 / math.sqrt(128)  # Nanda et al. 2023: every matrix N(0, 1/d_model)
    torch.manual_seed(5)
    model = GPT(vocab_size=113, block_size=4, n_layer=1, n_head=4, d_model=128, d_mlp=512, init="normal", init_std=std)
    torch.manual_seed(5)  # gpt2's init draws the same normals in the same order, at 0.02 (0.02/sqrt(2) on .proj)
    gpt2 = GPT(vocab_size=113, block_size=4, n_layer=1, n_head=4, d_model=128, d_mlp=512)
    for name, module in gpt2.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            drawn = 0.02 / math.sqrt(2) if name.endswith(".proj") else 0.02
            torch.testing.assert_close(model.get_submodule(name).weight / std, module.weight / drawn, msg=name)
    assert not model.blocks[0].mlp.fc.bias.any()
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(std, rel=0.05)
    with pytest.raises(ValueError, match=r"^init_std goes with init=normal.*model.init=normal model.init_std"):
        GPT(vocab_size=5, init_std=0.1)
    with pytest.raises(ValueError, match=r"^init_std goes with init=normal"):
        GPT(vocab_size=5, init="normal")
    with pytest.raises(ValueError, match=r"^init_std must be a positive number, got -1"):
        GPT(vocab_size=5, init="normal", init_std=-1)


@pytest.mark.parametrize(("kwargs", "message"), [({"init": "xavier"}, "init"), ({"layout": "post"}, "layout")])
def test_unknown_init_and_layout_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=rf"^{message}"):
        GPT(vocab_size=5, **kwargs)


def test_warmup_from_zero_is_the_official_lambda():
    lrs = {}
    for from_zero in (False, True):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=1.0)
        sched = constant(opt, total_steps=20, warmup_steps=10, warmup_from_zero=from_zero)
        lrs[from_zero] = []
        for _ in range(14):
            lrs[from_zero].append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    official = [1 if update > 10 else update / 10 for update in range(14)]  # Grokfast's main.py
    assert lrs[True] == pytest.approx(official, abs=1e-15)
    assert lrs[False] == pytest.approx([(t + 1) / 11 for t in range(10)] + [1.0] * 4, abs=1e-15)


def test_optim_adam_adds_l2_decay_to_the_gradient():
    cfg = config("experiment=grokfast", "data.p=11", "model.d_model=16")
    parts = build(cfg, Dist(), torch.device("cpu"))
    opt = parts.optimizer
    assert type(opt) is torch.optim.Adam
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["weight_decay"] == 0.005 and group["lr"] == 0.0  # warmup: 0 first
    # one Adam step by hand, with the decay added to the gradient (L2), against torch's
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    expect = p.detach().clone()
    g = p.grad + 0.005 * expect
    m, v = 0.1 * g, 0.02 * g * g
    expect -= 1e-3 * (m / 0.1) / ((v / 0.02).sqrt() + 1e-8)
    adam = torch.optim.Adam([p], lr=1e-3, betas=(0.9, 0.98), weight_decay=0.005)
    adam.step()
    torch.testing.assert_close(p.detach(), expect)


def test_grokfast_split_is_drawn_from_the_run_seed():
    for seed in (0, 1):
        assert config("experiment=grokfast", f"seed={seed}").data.split_seed == seed
    x = torch.arange(13)
    pairs = torch.cartesian_prod(x, torch.arange(1, 13))
    perm = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(1))
    from hookexp.workloads.data import modular_addition

    train_set = modular_addition(p=13, op="mul", train_fraction=0.5, split_seed=1).train
    assert torch.equal(train_set.x[:, [0, 2]], pairs[perm[: len(pairs) // 2]])
    assert not torch.equal(train_set.x, modular_addition(p=13, op="mul", train_fraction=0.5, split_seed=0).train.x)


@pytest.mark.parametrize("grokfast_filter", ["none", "ema", "ma"])
def test_grokfast_filters_compose_with_the_official_weight_decay(grokfast_filter):
    cfg = config("experiment=grokfast", f"grokfast_filter={grokfast_filter}")
    hooks = OmegaConf.to_container(cfg.hooks)
    decay = {"none": 0.0, "ema": 0.005, "ma": 0.01}[grokfast_filter]
    assert cfg.optim.weight_decay == decay and cfg.optim._target_ == "torch.optim.Adam"
    assert list(hooks) == ({"none": [], "ema": ["grokfast_ema"], "ma": ["grokfast_ma"]}[grokfast_filter])
    if grokfast_filter == "ema":
        assert hooks["grokfast_ema"]["args"] == {"alpha": 0.98, "lamb": 2.0}
    if grokfast_filter == "ma":
        assert hooks["grokfast_ma"]["args"] == {"window": 100, "lamb": 5.0}
    assert (cfg.model.init, cfg.model.layout, cfg.model.block_size) == ("torch", "normed_stream", 5)


def test_stop_when_stops_at_the_first_validation_that_reaches_it(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="hookexp.train")
    summary = train(config("trainer.stop_when='val/acc=0.5'", "trainer.epochs=10"), tmp_path)
    val = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "val/acc" in r]
    assert val[-1]["val/acc"] >= 0.5 and all(r["val/acc"] < 0.5 for r in val[:-1])
    assert summary["status"] == "finished" and summary["trainer/steps"] == val[-1]["trainer/step"] + 1 < 230
    assert f"stopped after step {val[-1]['trainer/step']}: val/acc>=0.5 (trainer.stop_when)" in caplog.text
    assert summary["trainer/stopped_by"] == "trainer.stop_when=val/acc>=0.5"


def test_stop_when_on_a_train_metric_and_a_bad_target(tmp_path: Path):
    summary = train(config("trainer.stop_when='train/loss<=1.5'", "stats.every=1"), tmp_path / "a")
    rows = [r for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "train/loss" in r]
    assert rows[-1]["train/loss"] <= 1.5 and all(r["train/loss"] > 1.5 for r in rows[:-1])
    assert summary["trainer/steps"] == rows[-1]["trainer/step"] + 1
    with pytest.raises(ConfigError, match=r"^trainer\.stop_when: 'val/acc>0\.9' is not a target"):
        train(config("trainer.stop_when='val/acc>0.9'"), tmp_path / "b")


def test_eval_every_epochs_zero_validates_only_every_eval_every_steps(tmp_path: Path):
    train(config("trainer.eval_every=20", "trainer.eval_every_epochs=0", "trainer.epochs=2"), tmp_path / "a")
    assert [r["trainer/step"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "val/acc" in r] == [19, 39, 45]
    train(config("trainer.eval_every_epochs=2", "trainer.epochs=4"), tmp_path / "b")
    assert [r["trainer/step"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "val/acc" in r] == [45, 91]


@pytest.mark.parametrize("overrides", [
    ["experiment=grokfast", "grokfast_filter=ma", "data.p=11", "trainer.max_steps=3"],
    ["experiment=grokking_weight_decay", "data.p=11", "data.batch_size=36", "trainer.max_steps=3",
     "trainer.eval_every=2", "stats.every=1"],
    ["experiment=gradient_noise_scale", "trainer.max_steps=3", "stats.every=1"],
    ["experiment=loss_spikes", "guard.spike.action=rollback", "trainer.max_steps=3", "trainer.eval_every=2"],
])
def test_study_configs_train_a_few_steps(overrides, tmp_path: Path):
    summary = train(config(*overrides), tmp_path)
    assert summary["status"] == "finished" and summary["trainer/steps"] == 3
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert any("val/acc" in r for r in rows)
    if "experiment=grokking_weight_decay" in overrides:
        logged = rows[0]
        assert "hook/dead_relu_probe/dead_frac" in logged and "param/group/blocks.0/norm" in logged
        block = [v for k, v in logged.items() if k.startswith("param/blocks.0.") and k.endswith("/norm")]
        assert len(block) >= 8  # the group's norm is the norm of all its weights together
        assert logged["param/group/blocks.0/norm"] == pytest.approx(math.sqrt(sum(v * v for v in block)), rel=1e-5)
    if "experiment=gradient_noise_scale" in overrides:  # every step: B_simple per layer and globally
        assert all({f"gns{g}/b_simple" for g in ("", "/conv1", "/conv2", "/fc1", "/fc2")} <= set(r)
                   for r in rows if "train/loss" in r)


def test_gns_table_of_a_shortened_run_has_the_steps_every_run_logged(tmp_path: Path):
    """experiments/gradient_noise_scale/table.py on runs shorter than the study's 300 steps (trainer.epochs=5)."""
    columns = ("train/loss", "gns/grad_sq", "gns/trace", "gns/b_simple", "gns/conv1/b_simple", "gns/conv2/b_simple",
               "gns/fc1/b_simple", "gns/fc2/b_simple")
    for seed, (last, scale) in enumerate([(70, 1.0), (40, 3.0)]):  # the second run stopped earlier
        (tmp_path / str(seed)).mkdir()
        lines = [{"trainer/step": step, **{c: scale * (step + 1) for c in columns}} for step in range(0, last + 1, 10)]
        lines.append({"trainer/step": last, "val/acc": 0.5})  # a validation row: no train/loss
        (tmp_path / str(seed) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    table = Path(__file__).resolve().parents[2] / "experiments" / "gradient_noise_scale" / "table.py"
    done = subprocess.run([sys.executable, str(table), str(tmp_path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ("table.py: steps 60, 100, 150, 200, 250, 299 are not logged in every run (a shorter run?); "
                           "the table has 0, 20, 40\n")
    body = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| step")]
    # mean and std of (step + 1) and 3 (step + 1): 2 (step + 1) and sqrt(2) (step + 1)
    assert body == [f"| {step} | {' | '.join([cell] * len(columns))} |"
                    for step, cell in [(0, "2 ± 1.4"), (20, "42 ± 30"), (40, "82 ± 58")]]
    assert done.stdout.endswith("2 seeds, mean ± std; B_simple in samples (the big batch: 128).\n")


def test_stop_when_on_a_metric_the_task_does_not_log_is_refused_before_training(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"^trainer\.stop_when: 'val/accuracy' is not a metric of this task\. "
                                          r"Did you mean 'val/acc'.*val/loss, val/acc, train/loss, train/acc\.$"):
        train(config("trainer.stop_when='val/accuracy=0.9'"), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_run_of_an_older_version_resumes_though_the_schema_gained_keys():
    """Keys added to a group since a run started are composed at their defaults on resume: not a change."""
    from hookexp.run.checkpoint import config_changes

    saved = {"trainer": {"epochs": 10}, "model": {"_target_": "hookexp.workloads.models.GPT", "n_layer": 2},
             "hooks": {"a": {"target": "fc", "kind": "grad"}}}
    current = {"trainer": {"epochs": 10, "eval_every_epochs": 1, "stop_when": None},
               "model": {"_target_": "hookexp.workloads.models.GPT", "n_layer": 2, "init": "gpt2"},
               "hooks": {"a": {"target": "fc", "kind": "grad", "optional": False}, "b": {"target": "fc"}}}
    assert config_changes(saved, current) == ["hooks.b: '<unset>' -> {'target': 'fc'}"]  # a new spec still counts
    assert config_changes(current, saved) == ["hooks.a.optional: False -> '<unset>'",
                                              "hooks.b: {'target': 'fc'} -> '<unset>'",
                                              "model.init: 'gpt2' -> '<unset>'",
                                              "trainer.eval_every_epochs: 1 -> '<unset>'"]  # stop_when may change
