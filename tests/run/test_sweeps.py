"""Reproducibility, multiruns, the report, ablations, Optuna, joblib, SLURM config and W&B sweeps."""

from __future__ import annotations

import json
import re
import shlex
import statistics
import sys
from pathlib import Path

import pytest
import yaml
from conftest import has_module, read_jsonl, run_cli
from hydra import compose, initialize_config_module

from hookexp.analysis.report import report

FAST = ["trainer.max_steps=12", "stats.every=4", "logger=none"]


def without_timing(path: Path) -> list[str]:
    """The file's lines as written, byte for byte, with the timing keys (perf/*) cut out."""
    return [re.sub(r',\s*"perf/[^"]+":\s*[^,}]+', "", line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # several full CLI jobs; ./scripts/test.sh -m slow
def test_same_config_and_seed_give_identical_metrics(workdir):
    for name in ("a", "b"):
        done = run_cli(["hooks=[clamp_conv,grad_noise]", "repro.deterministic=true", *FAST,
                        f"hydra.run.dir={name}"], workdir)
        assert done.returncode == 0, done.stderr[-2000:]
    first, second = without_timing(workdir / "a" / "metrics.jsonl"), without_timing(workdir / "b" / "metrics.jsonl")
    assert first == second and len(first) == 5
    done = run_cli(["hooks=[clamp_conv,grad_noise]", "repro.deterministic=true", "seed=1", *FAST, "hydra.run.dir=c"],
                   workdir)
    assert done.returncode == 0
    losses = [[r.get("train/loss") for r in read_jsonl(workdir / run / "metrics.jsonl")] for run in ("a", "c")]
    assert losses[0] != losses[1]
    assert all('"perf/' not in line for line in first)  # the cut worked: the raw file has them
    assert '"perf/step_time"' in (workdir / "a" / "metrics.jsonl").read_text()
    done = run_cli(["hooks=[clamp_conv,grad_noise]", "repro.deterministic=true", "data.num_workers=2", *FAST,
                    "hydra.run.dir=w"], workdir)
    assert done.returncode == 0, done.stderr[-2000:]
    assert without_timing(workdir / "w" / "metrics.jsonl") == first  # worker processes change nothing
    manifest = json.loads((workdir / "a" / "manifest.json").read_text())
    assert {"commit", "dirty"} <= set(manifest["git"]) and manifest["host"] and manifest["seed"] == 0
    assert manifest["config"]["repro"]["deterministic"] is True


def test_two_by_two_multirun_and_report(workdir):
    done = run_cli(["-m", "hooks=none,zero_fc_bias", "seed=0,1", *FAST, "hydra.sweep.dir=sweep"], workdir)
    assert done.returncode == 0, done.stderr[-2000:]
    jobs = sorted((workdir / "sweep").glob("[0-9]"))
    assert len(jobs) == 4
    markdown, groups, left_out = report([workdir / "sweep"])
    assert not left_out
    assert [g.name for g in groups] == ["hooks=none", "hooks=zero_fc_bias"]
    for group in groups:
        assert len(group.jobs) == 2
        expected = statistics.mean(json.loads((j.path / "summary.json").read_text())["val/acc"] for j in group.jobs)
        assert group.values("val/acc") and statistics.mean(group.values("val/acc")) == pytest.approx(expected)
        assert f"| {group.name} | 2 | {statistics.mean(group.values('val/acc')):.4f} ± " in markdown
    assert (workdir / "sweep" / "report.md").read_text() == markdown
    assert (workdir / "sweep" / "report.png").read_bytes()[:4] == b"\x89PNG"
    # steps to reach on the real files: a train/loss level some logged rows reach and others do not
    losses = {j.path: [(r["trainer/step"], r["train/loss"]) for r in read_jsonl(j.path / "metrics.jsonl")
                       if "train/loss" in r] for g in groups for j in g.jobs}
    level = statistics.median(v for rows in losses.values() for _, v in rows)
    markdown, groups, _ = report([workdir / "sweep"], out_dir=workdir / "out", reach=[f"train/loss={level!r}"])
    for group in groups:
        firsts = [min((s for s, v in losses[j.path] if v <= level), default=None) for j in group.jobs]
        reached = [s for s in firsts if s is not None]
        cell = (f"{statistics.mean(reached):.1f} ± {statistics.stdev(reached):.1f}" if len(reached) == 2 else
                str(reached[0]) if reached else "never") + f" ({len(reached)} of 2 reached)"
        assert f"| {cell} |" in next(line for line in markdown.splitlines() if line.startswith(f"| {group.name} | 2 |"))


def test_a_failing_job_does_not_lose_the_others(workdir):
    done = run_cli(["-m", "hooks=clamp_conv", "hooks.clamp_conv.transform=clamp,{_target_:user_transforms.explode}",
                    *FAST, "hydra.sweep.dir=sweep"], workdir)
    assert done.returncode == 1
    assert "hookexp: 1 of 2 jobs failed" in done.stderr and "ValueError: boom" in done.stderr
    assert json.loads((workdir / "sweep" / "0" / "summary.json").read_text())["status"] == "finished"
    _, groups, left_out = report([workdir / "sweep"])
    assert len(groups) == 1 and len(left_out) == 1 and "ValueError: boom" in left_out[0].error


def test_an_interrupted_sweep_is_finished_by_its_command_with_resume(workdir):
    """SIGTERM during job 1 of 3 (no checkpoint_every): the sweep stops there and prints its own command with
    resume=true; that command keeps job 0 as it finished, continues job 1 from the signal's checkpoint and runs
    job 2, which never started. Job 1 then logs what an uninterrupted job logs, and resume=true splits no
    group of the report."""
    stop = "+hooks.stop={target:'',kind:forward,transform:{_target_:user_transforms.signal_at,step:10000}}"
    sweep = ["-m", stop, "hooks.stop.transform.step=10000,5,10000", "seed=0", *FAST, "hydra.sweep.dir=sweep"]
    first = run_cli(sweep, workdir)
    assert first.returncode == 143, first.stderr[-2000:]
    (said,) = [line for line in first.stderr.splitlines() if "continue the sweep" in line]
    command = said.split(" with: ", 1)[1]
    assert said.startswith("hookexp: interrupted by signal 15 after step 6 of job 1 of the sweep in ")
    assert command.endswith(f"hydra.sweep.dir={workdir / 'sweep'} resume=true") and " -m " in command
    assert not (workdir / "sweep" / "2").exists()
    def results(job: Path) -> dict[Path, bytes]:  # (Hydra rewrites .hydra/ for every job it launches; logs append)
        return {p: p.read_bytes() for p in job.rglob("*") if p.is_file() and ".hydra" not in p.parts
                and p.name != "cli.log"}

    job0 = results(workdir / "sweep" / "0")

    again = run_cli(shlex.split(command)[3:], workdir)  # what follows `python -m hookexp`
    assert again.returncode == 0, again.stderr[-2000:]
    said = again.stdout + again.stderr  # (a multirun logs to stdout)
    assert "nothing to do: job" in said and "finished at step 12 (kept as it is" in said
    assert results(workdir / "sweep" / "0") == job0 and len(job0) >= 4  # metrics, summary, manifest, plot
    summaries = [json.loads((workdir / "sweep" / str(i) / "summary.json").read_text()) for i in range(3)]
    assert [(s["status"], s["trainer/steps"]) for s in summaries] == [("finished", 12)] * 3
    assert without_timing(workdir / "sweep" / "1" / "metrics.jsonl") == without_timing(
        workdir / "sweep" / "0" / "metrics.jsonl")  # the stop hook changes nothing: seed 0's run, resumed once
    _, groups, left_out = report([workdir / "sweep"])
    assert not left_out and sorted((g.name, len(g.jobs)) for g in groups) == [
        ("hooks.stop.transform.step=10000", 2), ("hooks.stop.transform.step=5", 1)]


@pytest.mark.slow  # several full CLI jobs; ./scripts/test.sh -m slow
def test_ablate_runs_leave_one_out_and_reports(workdir):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "hookexp", "ablate", "hooks=[clamp_conv,zero_fc_bias]", "seed=0,1",
                           "trainer.progress=false", *FAST, "hydra.sweep.dir=abl"], cwd=workdir, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    _, groups, left_out = report([workdir / "abl"])
    assert not left_out
    assert sorted(g.name for g in groups) == ["+ablate=all", "+ablate=clamp_conv", "+ablate=none",
                                              "+ablate=zero_fc_bias"]
    assert all(len(g.jobs) == 2 for g in groups)
    assert "| +ablate=none | 2 |" in done.stdout
    assert f"hookexp.ablate: wrote {Path('abl') / 'report.md'} and report.png (the jobs are in abl)" in done.stderr
    summary = json.loads((workdir / "abl" / "0" / "summary.json").read_text())
    assert summary["hook/clamp_conv/calls"] > 0
    off = next(g for g in groups if g.name == "+ablate=clamp_conv").jobs[0]
    assert json.loads((off.path / "summary.json").read_text())["hook/clamp_conv/calls"] == 0


def test_ablate_rejects_an_unknown_spec(workdir):
    done = run_cli(["hooks=clamp_conv", "+ablate=clamp_cnv", *FAST, "hydra.run.dir=run"], workdir)
    assert done.returncode == 2
    assert "hookexp: error: ablate: no hook spec named 'clamp_cnv' to ablate. Did you mean 'clamp_conv'?" in done.stderr


@pytest.mark.skipif(not has_module("hydra_plugins.hydra_optuna_sweeper"), reason="extra .[sweeps] not installed")
@pytest.mark.slow  # several full CLI jobs; ./scripts/test.sh -m slow
@pytest.mark.parametrize(("metric", "best"), [(None, lambda s: max(x["val/acc"] for x in s)),
                                              ("val/loss", lambda s: -min(x["val/loss"] for x in s))])
def test_optuna_sweeps_the_optimized_metric_in_its_direction(workdir, metric, best):
    """The default objective is val/acc (maximized); optimized_metric=val/loss is minimized (its negation)."""
    chosen = [] if metric is None else [f"optimized_metric={metric}"]
    done = run_cli(["-m", "sweep=optuna_lr", "hydra.sweeper.n_trials=3", "trainer.max_steps=6", "logger=none",
                    *chosen, "hydra.sweep.dir=opt"], workdir)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "setup plugin alembic" not in done.stderr and "\x1b[" not in done.stderr  # no storage chatter, no ANSI
    results = yaml.safe_load((workdir / "opt" / "optimization_results.yaml").read_text())
    assert set(results["best_params"]) == {"optim.lr", "optim.momentum"}
    summaries = [json.loads(p.read_text()) for p in (workdir / "opt").glob("*/summary.json")]
    assert len(summaries) == 3 and results["best_value"] == best(summaries)


def test_the_sweep_objective_and_its_direction():
    from hookexp.goals import objective, objective_value
    from hookexp.run.build import logged_metrics
    from hookexp.workloads.tasks import CausalLM, Classification, Regression

    assert objective(None, logged_metrics(Classification())) == "val/acc"
    assert objective(None, logged_metrics(Regression())) == "val/loss"  # no val/acc: today's -val/loss
    assert objective("val/ppl", logged_metrics(CausalLM())) == "val/ppl"
    assert objective("val/acc_best", logged_metrics(Classification())) == "val/acc_best"
    summary = {"val/acc": 0.75, "val/loss": 0.5, "val/ppl": 4.0, "val/acc_best": 0.875, "status": "finished"}
    assert [objective_value(m, summary) for m in ("val/acc", "val/loss", "val/ppl", "val/acc_best", "val/mse")] == \
        [0.75, -0.5, -4.0, 0.875, None]


def test_an_unknown_optimized_metric_is_refused_before_training(workdir):
    done = run_cli(["optimized_metric=val/accuracy", "trainer.max_steps=2", "logger=none", "hydra.run.dir=r"],
                   workdir)
    assert done.returncode == 2
    assert ("hookexp: error: optimized_metric: 'val/accuracy' is not a metric this task logs. Did you mean 'val/acc'"
            in done.stderr), done.stderr[-2000:]
    assert "val/loss, val/acc, train/loss, train/acc, val/loss_best, val/acc_best" in done.stderr
    assert not (workdir / "r").exists()


@pytest.mark.skipif(not has_module("hydra_plugins.hydra_joblib_launcher"), reason="extra .[sweeps] not installed")
@pytest.mark.slow  # several full CLI jobs; ./scripts/test.sh -m slow
def test_joblib_launcher_runs_two_jobs_with_wandb_offline(workdir):
    from conftest import wandb_summary

    done = run_cli(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1", "trainer.max_steps=6",
                    "hydra.sweep.dir=jl"], workdir)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = [wandb_summary(workdir / "jl" / str(i)) for i in (0, 1)]
    assert all(r["state"] == "finished" for r in runs)
    assert {r["config"]["logger"]["group"] for r in runs} == {"jl"}  # the sweep directory
    assert [r["name"] for r in runs] == [f"trainer.progress=False seed={i} trainer.max_steps=6" for i in (0, 1)]


@pytest.mark.skipif(not has_module("hydra_plugins.hydra_submitit_launcher"), reason="extra .[sweeps] not installed")
def test_slurm_launcher_config_composes():
    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher.partition == "gpu" and launcher.gpus_per_node == 1 and launcher.timeout_min == 120


@pytest.mark.slow  # several full CLI jobs; ./scripts/test.sh -m slow
def test_the_command_a_wandb_agent_builds_runs(workdir):
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    spec = yaml.safe_load((Path(__file__).parents[2] / "sweeps" / "wandb_lr.yaml").read_text())
    assert "${args_no_hyphens}" in spec["command"]
    # What wandb_agent.Agent._command_run does with a run the sweep controller proposes:
    proposed = {"args": {"optim.lr": {"value": 0.0123}, "seed": {"value": 2}}}
    sweep_vars = sweep_utils.create_sweep_command_args(proposed)
    sweep_vars.update(interpreter=[sys.executable], env=["/usr/bin/env"])
    command: list[str] = []
    for part in sweep_utils.create_sweep_command(list(spec["command"])):
        command += sweep_vars.get(part[2:-1], []) if part.startswith("${") else [part]
    assert command[-2:] == ["optim.lr=0.0123", "seed=2"]
    # no W&B account here: the same command, logging offline
    command = [("logger.mode=offline" if c == "logger.mode=online" else c) for c in command]
    import subprocess

    done = subprocess.run([*command, "trainer.max_steps=5", "hydra.run.dir=run"], cwd=workdir,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((workdir / "run" / "manifest.json").read_text())["config"]
    assert config["optim"]["lr"] == 0.0123 and config["seed"] == 2


def test_ablate_finds_specs_selected_by_an_experiment_and_ignores_sweeps():
    from hookexp.analysis.ablate import is_sweep, spec_names

    assert is_sweep("seed=0,1,2") and is_sweep("hooks=[a,b],[c]")
    assert not is_sweep("hooks=[clamp_conv,zero_fc_bias]") and not is_sweep("hooks.x.args={min:0,max:1}")
    assert spec_names(["experiment=seed_hooks", "seed=0,1,2", "hydra.sweep.dir=x"]) == ["clamp_conv", "zero_fc_bias"]
    assert spec_names(["hooks=[grad_noise,sign_grad]", "optim.lr=0.1,0.01"]) == ["grad_noise", "sign_grad"]


def test_ablate_names_a_misspelt_hook_set_in_one_paragraph(capsys, tmp_path, monkeypatch):
    """hookexp ablate hooks=[clamp_conv,zero_fc_bais]: hookexp's paragraph with the did-you-mean and exit 2 before any
    job starts, not Hydra's MissingConfigException traceback."""
    from hookexp.analysis.ablate import main

    monkeypatch.chdir(tmp_path)
    assert main(["hooks=[clamp_conv,zero_fc_bais]", "seed=0,1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hookexp ablate: error: hooks: no option 'zero_fc_bais' (hooks/zero_fc_bais.yaml is in no "
                          "config folder). Did you mean 'zero_fc_bias'?")
    assert main(["hooks=clamp_conv", "trainer.epochs=abc"]) == 2
    assert capsys.readouterr().err.startswith("hookexp ablate: error: trainer.epochs: 'abc' is not a whole number")
    assert list(tmp_path.iterdir()) == []  # no sweep directory
