"""The µP coordinate check: the models' µP option against plain torch and mup's own functions, the slope and
``--max-slope`` of ``hookexp report --coord`` on a hand-made sweep of known power laws, and
experiment=coord_check run for a few steps at tiny widths."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import has_module, run_cli

from hookexp.analysis.report import coord_check, log_slope, main
from hookexp.workloads.models import GPT, MLP

needs_mup = pytest.mark.skipif(not has_module("mup"), reason="extra .[mup] not installed")

# -- the models' µP option ------------------------------------------------------------------------------------


@needs_mup
def test_mlp_mup_is_sp_at_the_base_width_and_mup_scaled_when_wider():
    torch.manual_seed(0)
    sp = MLP(input_dim=8, output_dim=3, depth=3, width=16)
    torch.manual_seed(0)
    mu = MLP(input_dim=8, output_dim=3, depth=3, width=16, parametrization="mup", base_width=16)
    x = torch.randn(5, 8)
    assert torch.equal(sp(x), mu(x))  # width multiplier 1: nothing rescaled

    torch.manual_seed(0)
    sp = MLP(input_dim=8, output_dim=3, depth=3, width=64)
    torch.manual_seed(0)
    mu = MLP(input_dim=8, output_dim=3, depth=3, width=64, parametrization="mup", base_width=16)
    assert type(mu.fc3).__name__ == "MuReadout" and mu.fc2.weight.infshape.width_mult() == 4
    # mup.set_base_shapes on torch's init: readout weights x sqrt(4), hidden biases x sqrt(4); the readout's
    # input divided by 4
    assert torch.equal(mu.fc3.weight, sp.fc3.weight * 2) and torch.equal(mu.fc2.bias, sp.fc2.bias * 2)
    assert torch.equal(mu.fc2.weight, sp.fc2.weight) and torch.equal(mu.fc1.weight, sp.fc1.weight)
    hidden = torch.relu(mu.fc2(torch.relu(mu.fc1(x))))
    assert torch.allclose(mu(x), F.linear(hidden / 4, mu.fc3.weight, mu.fc3.bias), atol=1e-6)


@needs_mup
def test_gpt_mup_is_sp_at_the_base_width_and_scales_init_and_attention_when_wider():
    torch.manual_seed(0)
    sp = GPT(vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=16)
    torch.manual_seed(0)
    mu = GPT(vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=16, parametrization="mup", base_width=16)
    ids = torch.randint(0, 11, (3, 6))
    assert torch.equal(sp(ids), mu(ids))

    torch.manual_seed(0)
    mu = GPT(vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=256, parametrization="mup", base_width=16)
    attn = mu.blocks[0].attn
    assert attn.scale == math.sqrt(16 / 2) / (256 / 2)  # 1/head_dim, x sqrt(base head_dim)
    assert mu.blocks[0].mlp.fc.weight.shape == (1024, 256)  # d_mlp = 4 d_model, and infinite in mup's eyes
    assert mu.blocks[0].mlp.fc.weight.infshape.width_mult() == 16
    # mup.init.normal_: matrices' std shrinks by sqrt(width multiplier 16); embeddings and readout keep 0.02
    assert attn.qkv.weight.std().item() == pytest.approx(0.02 / 4, rel=0.02)
    assert mu.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert mu.head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    # the attention as a hand-written softmax(q k^T * scale) v
    x = torch.randn(2, 6, 256)
    q, k, v = (z.view(2, 6, 2, 128).transpose(1, 2) for z in attn.qkv(x).split(256, dim=2))
    scores = (q @ k.transpose(-1, -2) * attn.scale).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -math.inf)
    want = attn.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 256))
    assert torch.allclose(attn(x), want, atol=1e-5)


@needs_mup
def test_mup_optimizers_divide_the_matrix_learning_rates_by_the_width_multiplier():
    import mup

    model = MLP(input_dim=8, output_dim=3, depth=3, width=64, parametrization="mup", base_width=16)
    opt = mup.MuAdam(model.parameters(), lr=0.01)
    lr = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert lr[id(model.fc2.weight)] == 0.01 / 4  # hidden: both dimensions grow
    assert lr[id(model.fc1.weight)] == lr[id(model.fc3.weight)] == lr[id(model.fc2.bias)] == 0.01


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"parametrization": "mup"}, "base_width must be set with parametrization=mup"),
    ({"parametrization": "mup", "base_width": 8, "init_std": 0.1}, "init_std must be null with parametrization=mup"),
    ({"parametrization": "mu"}, "parametrization must be one of sp, mup"),
])
def test_bad_mup_arguments_start_with_the_parameter_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MLP(input_dim=8, output_dim=3, width=16, **kwargs)
    if "init_std" not in kwargs:
        with pytest.raises(ValueError, match=message):
            GPT(vocab_size=11, block_size=6, d_model=16, **kwargs)
    with pytest.raises(ValueError, match="base_width must be divisible by n_head"):
        GPT(vocab_size=11, block_size=6, d_model=16, n_head=4, parametrization="mup", base_width=6)
    with pytest.raises(ValueError, match="tie_weights must be false with parametrization=mup"):
        GPT(vocab_size=11, block_size=6, d_model=16, parametrization="mup", base_width=8, tie_weights=True)


def test_mup_without_the_package_names_the_extra(monkeypatch):
    from hookexp.errors import ConfigError

    monkeypatch.setitem(sys.modules, "mup", None)  # import mup raises ImportError
    with pytest.raises(ConfigError, match=r"model.parametrization: parametrization=mup needs the mup package.*"
                                          r"pip install --no-deps 'mup>=1\.0'"):
        MLP(input_dim=8, output_dim=3, width=16, parametrization="mup", base_width=16)


# -- the report: slopes and --max-slope on a hand-made sweep ----------------------------------------------------

WIDTHS = [32, 64, 128, 256]
# group -> layer -> (power of width, constant): mean |x| = constant * width**power at every step
LAWS = {"+parametrization=sp": {"fc1": (0.0, 0.3), "fc2": (0.5, 0.02), "fc3": (1.0, 0.001)},
        "+parametrization=mup": {"fc1": (0.0, 0.3), "fc2": (0.05, 0.2), "fc3": (-0.1, 0.4)}}
SEED_FACTORS = [0.8, 1.0, 1.3]  # each seed's values times a factor: the mean over seeds keeps the power


def write_sweep(root: Path, laws: dict = LAWS, bad: float | None = None) -> Path:
    """Job directories as a hookexp multirun leaves them (overrides, manifest, metrics.jsonl, summary.json);
    ``bad`` replaces the widest sp job's fc1 value at the last step (NaN: a blow-up)."""
    i = 0
    for group, layers in laws.items():
        for width in WIDTHS:
            for seed, factor in enumerate(SEED_FACTORS):
                job = root / str(i)
                i += 1
                overrides = ["experiment=coord_check", group, f"model.width={width}", f"seed={seed}"]
                (job / ".hydra").mkdir(parents=True)
                (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
                (job / "manifest.json").write_text(json.dumps({"command": ["hookexp", *overrides]}))
                rows = []
                for step in range(4):
                    row = {"trainer/step": step, "train/loss": 1.0}
                    for layer, (power, c) in layers.items():
                        value = factor * c * width ** power * (1 + step)
                        if bad is not None and group.endswith("sp") and layer == "fc1" and width == WIDTHS[-1] \
                                and step == 3:
                            value = bad
                        row.update({f"act/{layer}/mean": 0.0, f"act/{layer}/abs_mean": value})
                    rows.append(row)
                (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                (job / "summary.json").write_text(json.dumps({"status": "finished", "train/loss": 1.0}))
    return root


def test_log_slope_is_the_least_squares_line_through_the_logs():
    w, v = [64, 128, 256, 512], [1.0, 1.9, 4.3, 7.7]
    x, y = [math.log(a) for a in w], [math.log(b) for b in v]
    mx, my = sum(x) / 4, sum(y) / 4
    want = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sum((a - mx) ** 2 for a in x)
    assert log_slope(w, v) == pytest.approx(want, rel=1e-12)
    assert math.isnan(log_slope([64], [1.0])) and math.isnan(log_slope([64, 128], [1.0, math.inf]))
    assert math.isnan(log_slope([64, 128], [1.0, 0.0]))


def test_the_slope_per_layer_and_group_is_the_power_of_the_width(tmp_path):
    sweep = write_sweep(tmp_path / "sweep")
    markdown, groups, over = coord_check([sweep], max_slope=0.2)
    assert [g.name for g in groups] == ["+parametrization=mup", "+parametrization=sp"]  # width and seed left out
    for g in groups:
        assert g.step == 3 and len(g.jobs) == len(WIDTHS) * len(SEED_FACTORS)
        for layer, (power, c) in LAWS[g.name].items():
            assert g.slopes[layer] == pytest.approx(power, abs=1e-9), (g.name, layer)
            mean = np.mean(SEED_FACTORS) * c * 64 ** power * 4  # the mean over seeds, at step 3
            assert g.values[layer][3][64] == pytest.approx(mean, rel=1e-12)
    assert [(g.name, layer) for g, layer, _ in over] == [("+parametrization=sp", "fc3"), ("+parametrization=sp", "fc2")]
    assert "| +parametrization=sp | fc3 | 3 | 32, 64, 128, 256 | 3 | 1.000 |" in markdown
    assert (sweep / "report.md").read_text() == markdown
    assert (sweep / "report.png").read_bytes()[:4] == b"\x89PNG"


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hookexp.analysis.report", *args], capture_output=True, text=True,
                          timeout=120)


def test_max_slope_exits_1_naming_the_steepest_layer_and_0_under_the_bound(tmp_path):
    sweep = write_sweep(tmp_path / "sweep")
    failed = _report(str(sweep), "--coord", "--max-slope", "0.6")
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-1] == ("coordinate check failed: layer fc3 of group "
                                                      "'+parametrization=sp' has slope 1.000 above --max-slope 0.6")
    assert "| +parametrization=sp | fc2 | 3 | 32, 64, 128, 256 | 3 | 0.500 |" in failed.stdout
    main([str(sweep), "--coord", "--max-slope", "1.01"])  # returns: exit status 0
    with pytest.raises(SystemExit) as e:
        main([str(sweep), "--max-slope", "1"])
    assert e.value.code == 2  # a usage error: --max-slope needs --coord


def test_a_layer_that_blew_up_fails_the_bound(tmp_path):
    markdown, _, over = coord_check([write_sweep(tmp_path / "sweep", bad=math.nan)], max_slope=5.0)
    assert [(g.name, layer) for g, layer, _ in over] == [("+parametrization=sp", "fc1")]
    assert math.isnan(over[0][2])
    assert "1 layer(s) over: fc1 (+parametrization=sp: nan)" in markdown


# -- the preset, run --------------------------------------------------------------------------------------------


@needs_mup
@pytest.mark.slow  # a width sweep of 12 jobs; ./scripts/test.sh -m slow
def test_the_preset_runs_sp_and_mup_at_tiny_widths_and_reports_their_slopes(tmp_path):
    out = run_cli(["-m", "experiment=coord_check", "+parametrization=sp,mup", "model.width=16,32",
                   "model.base_width=16", f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "sweep" / "3" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["trainer/step"] for r in rows if "act/fc1/abs_mean" in r]
    assert steps == [0, 1, 2, 3]
    assert all(f"act/fc{i}/{s}" in rows[0] for i in (1, 2, 3) for s in ("abs_mean", "kurtosis"))
    overrides = yaml.safe_load((tmp_path / "sweep" / "3" / ".hydra" / "overrides.yaml").read_text())
    assert "+parametrization=mup" in overrides
    _, groups, over = coord_check([tmp_path / "sweep"], max_slope=100.0)
    assert [g.name for g in groups] == ["+parametrization=mup", "+parametrization=sp"] and not over
    assert all(set(g.slopes) == {"fc1", "fc2", "fc3"} for g in groups)


@needs_mup
@pytest.mark.slow  # a width sweep; ./scripts/test.sh -m slow
def test_the_preset_runs_the_gpt_in_mup(tmp_path):
    out = run_cli(["experiment=coord_check", "model=gpt", "data=modular_addition", "data.p=7",
                   "+parametrization=mup", "model.d_model=16", "model.base_width=8", "trainer.max_steps=2",
                   f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    layers = {k.split("/")[1] for r in rows for k in r if k.endswith("/abs_mean")}
    assert layers == {"embed", "blocks.0", "blocks.0.attn", "blocks.0.mlp", "blocks.1", "blocks.1.attn",
                      "blocks.1.mlp", "head"}
