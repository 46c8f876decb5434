"""``python -m hookexp`` as a user runs it: the files it writes and the W&B run, read back by content."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import HELPERS, config, read_jsonl, run_cli, wandb_history, wandb_summary
from docblocks import DOCS, section

from hookexp.errors import ConfigError, HookexpError
from hookexp.run.loop import run_job as train


@pytest.fixture(scope="module")
def clamp_run(quick_start) -> Path:
    """``python -m hookexp hooks=clamp_conv``: the README's quick start, run once for this file and
    tests/test_readme.py."""
    return quick_start


def test_main_job_trains_and_writes_its_files(clamp_run):
    summary = json.loads((clamp_run / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["val/acc"] > 0.85
    assert summary["trainer/steps"] == 230 and summary["trainer/epochs"] == 10
    assert "hooks:\n  clamp_conv: output_grad clamp on conv1, conv2\n" in (clamp_run / "cli.log").read_text()
    assert summary["hook/clamp_conv/calls"] == 2 * 230  # conv1 and conv2, every step

    rows = read_jsonl(clamp_run / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    assert [r["trainer/step"] for r in train] == [*range(0, 230, 10), 229]
    assert train[-1]["train/loss"] == summary["train/loss"]
    assert train[-1]["train/loss"] < train[0]["train/loss"]
    keys = set(train[0])
    for param in ("conv1.weight", "conv1.bias", "conv2.weight", "fc1.weight", "fc2.bias"):
        assert {f"grad/{param}/{s}" for s in ("norm", "mean", "std", "min", "max", "frac_zero")} <= keys
    assert {"grad/global_norm", "hook/clamp_conv/calls", "hook/clamp_conv/frac_changed", "train/acc"} <= keys
    assert 0 < train[0]["hook/clamp_conv/frac_changed"] < 1
    val = [r for r in rows if "val/acc" in r]
    assert len(val) == 10 and val[-1]["val/acc"] == summary["val/acc"]

    manifest = json.loads((clamp_run / "manifest.json").read_text())
    assert manifest["seed"] == 0 and manifest["config"]["hooks"]["clamp_conv"]["target"] == "conv*"
    (row,) = manifest["hooks"]
    assert row["spec"] == "clamp_conv" and row["kind"] == "output_grad" and row["targets"] == ["conv1", "conv2"]
    assert manifest["versions"]["torch"] and manifest["versions"]["hookexp"] == "0.1.0"
    assert "hooks=clamp_conv" in manifest["command"]


def test_wandb_offline_run_holds_the_same_numbers(clamp_run):
    run = wandb_summary(clamp_run)
    assert run["state"] == "finished" and run["exit_code"] == 0
    assert run["tags"] == ["clamp_conv"]
    local = json.loads((clamp_run / "summary.json").read_text())
    assert run["summary"]["train/loss"] == local["train/loss"]
    assert run["summary"]["val/acc_best"] == local["val/acc_best"]
    assert run["summary"]["hook/clamp_conv/calls"] == 460
    assert any(k.startswith("grad/") for k in run["summary"])
    # the config is logged resolved, as a plain mapping
    assert run["config"]["model"]["in_channels"] == 1 and run["config"]["hooks"]["clamp_conv"]["kind"] == "output_grad"

    everything = wandb_history(clamp_run)
    assert [r.get("plots/grad_norms._type") for r in everything][-1] == "image-file"  # the plot, last
    history = [r for r in everything if "plots/grad_norms._type" not in r]
    rows = read_jsonl(clamp_run / "metrics.jsonl")
    assert len(history) == len(rows)
    for local_row, wandb_row in zip(rows, history, strict=True):
        for key, value in local_row.items():
            assert wandb_row[key] == value, key


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # Hydra's composition errors, as hookexp's paragraph: an unknown option, a value of the wrong type
        (["hooks=clamp_cnv"], ["hookexp: error: hooks: no option 'clamp_cnv' (hooks/clamp_cnv.yaml is in no config "
                               "folder). Did you mean 'clamp_conv'? The options: ablate_attn_eval, clamp_conv,"]),
        (["hooks=[clamp_conv,zero_fc_bais]"], ["hookexp: error: hooks: no option 'zero_fc_bais' (hooks/zero_fc_bais"
                                               ".yaml is in no config folder). Did you mean 'zero_fc_bias'?"]),
        (["trainer.epochs=abc"], ["hookexp: error: trainer.epochs: 'abc' is not a whole number (int). trainer.epochs "
                                  "takes a whole number (int), e.g. trainer.epochs=3."]),
        (["trainer.progress=ture"], ["hookexp: error: trainer.progress: 'ture' is not true or false. Did you mean "
                                     "'true'? trainer.progress takes true or false, e.g. trainer.progress=true."]),
        # tuning a spec whose hook file is not selected names the file that defines it
        (["hooks.clamp_conv.args.min=-1"], ["hookexp: error: hooks.clamp_conv: no hook spec named 'clamp_conv' in "
                                            "this run: conf/hooks/clamp_conv.yaml defines it, and this run does not "
                                            "load that file: select it with hooks=clamp_conv."]),
        (["hooks=zero_fc_bias", "hooks.clamp_conv.args.min=-1"], ["select it with hooks=[zero_fc_bias,clamp_conv]."]),
        (["hooks=clamp_conv", "hooks.clamp_conv.target=convv"],
         ["hookexp: error: hooks.clamp_conv.target: target 'convv' matches no module of SmallCNN",
          "Did you mean 'conv2' or 'conv1'?", "Its modules are: conv1, relu1, conv2"]),
        (["+dry_ru=true"], ["hookexp: error: dry_ru: unknown top-level key. Did you mean 'dry_run'?"]),
        (["+trainer.epoch=3"], ["hookexp: error: trainer.epoch: unknown key. Did you mean 'epochs'?"]),
        # a misspelled key without + gets the did-you-mean, not Hydra's advice to add it
        (["trainer.max_step=20"], ["hookexp: error: trainer.max_step: unknown key. Did you mean 'max_steps'?"]),
        (["hooks=clamp_conv", "hooks.clamp_conv.args.maxx=1"],
         ["hookexp: error: hooks.clamp_conv.args.maxx: transform 'clamp' has no argument 'maxx'. Did you mean 'max'?"]),
        (["hooks=clamp_conv", "hooks.clmap_conv.args.min=1"],
         ["hookexp: error: hooks.clmap_conv: no hook spec named 'clmap_conv'. Did you mean 'clamp_conv'?"]),
        # model.hiden=3 and task=causal_lm (refused once the model is built): in the test after this one
        (["sed=1"], ["hookexp: error: sed: unknown top-level key. Did you mean 'seed'"]),
        (["scheduler.warmup_steps=3"], ["hookexp: error: scheduler.warmup_steps: a constant learning rate "
                                        "(scheduler=none) takes no keys, got warmup_steps. Pick a schedule first"]),
        (["+optim.betas=[0.9,0.99]"], ["hookexp: error: optim.betas: SGD has no parameter 'betas'.",
                                       "Its parameters: lr, momentum, dampening, weight_decay, nesterov,"]),
        (["optim=adamw", "optim.lr=abc"], ["hookexp: error: optim.lr: expected a number, got 'abc'."]),
        # the module is there, the name is not: said so, with the close names, and no Hydra log line before it
        (["optim._target_=torch.optim.SDG"], ["hookexp: error: optim._target_: cannot import 'torch.optim.SDG': "
                                              "module 'torch.optim' has no attribute 'SDG'. Did you mean 'SGD'"]),
    ],
)
def test_bad_config_fails_before_training_with_the_fix_and_leaves_no_run_directory(args, expected, workdir):
    done = run_cli([*args, "hydra.run.dir=run"], workdir)
    text = done.stderr + done.stdout
    assert done.returncode == 2, text[-2000:]
    for piece in expected:
        assert piece in text, text[-2000:]
    assert "Traceback" not in text and "To append to your config" not in text and "HYDRA_FULL_ERROR" not in text
    assert "[ERROR]" not in text  # one paragraph: no log line of Hydra's (or anyone's) before it
    assert not (workdir / "run").exists()


def test_a_start_that_fails_while_building_prints_no_run_directory_and_leaves_no_date_folder(workdir):
    """A model key the target does not take is refused before the data loads; the run directory is printed only
    once it is sure to stay, and the timestamped folder and its date folder are both removed. A task the model
    cannot serve (the small CNN's classifier under causal_lm) is refused once the model is built, before the run
    starts. Both are one paragraph with the fix, as in the test before this one."""
    done = run_cli(["model.hiden=3", "logger=none"], workdir)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "hookexp: error: model.hiden: SmallCNN has no parameter 'hiden'. Did you mean 'hidden'?")
    assert "run directory" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr
    assert not (workdir / "outputs").exists()
    (workdir / "mine").mkdir()
    done = run_cli(["task=causal_lm", "logger=none", "hydra.run.dir=mine/a/b"], workdir)  # fails after the data
    assert done.returncode == 2 and "run directory" not in done.stdout + done.stderr
    assert ("hookexp: error: task: task 'causal_lm' needs logits of shape [batch, length, vocab], got (64, 10): the "
            "model predicts one vector per example, not a token per position. Train a language model on text "
            "(model=gpt data=text_file data.path=FILE), or use task=classification for this model and data."
            in done.stderr)
    assert "Traceback" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr
    assert list((workdir / "mine").iterdir()) == []  # the folders it made are gone, the user's own stays


@pytest.mark.parametrize(("args", "expected"), [
    (["hooks=clamp_cnv,none"], "hookexp: error: hooks: no option 'clamp_cnv' "),
    (["trainer.epochs=1,abc"], "hookexp: error: trainer.epochs: 'abc' is not a whole number (int)."),
])
def test_a_multirun_gets_hookexps_paragraph_for_hydras_composition_errors(args, expected, workdir):
    done = run_cli(["-m", *args, "trainer.max_steps=1", "logger=none", "hydra.sweep.dir=sweep"], workdir)
    assert done.returncode == 2, done.stderr[-2000:]
    assert expected in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr and "Traceback" not in done.stderr


def test_an_explicit_max_steps_lifts_the_default_epochs_and_the_final_line_names_the_limit(workdir):
    """2 steps an epoch (1437 examples, batches of 720): the default 10 epochs would stop at 20. The limit is the
    run layer's (in process); the final line that names it is the command line's (a child process; a max_steps
    stop's line is also test_a_wandb_run_keeps_the_terminal_quiet_and_the_last_line_is_hookexps')."""
    common = ["logger=none", "data.batch_size=720", "stats.every=100"]
    summary = train(config(*common, "trainer.max_steps=25"), workdir / "steps")
    assert (summary["trainer/steps"], summary["trainer/stopped_by"]) == (25, "trainer.max_steps=25")
    assert json.loads((workdir / "steps" / "summary.json").read_text())["trainer/stopped_by"] == "trainer.max_steps=25"
    both = run_cli([*common, "trainer.max_steps=25", "trainer.epochs=3", "hydra.run.dir=both"], workdir)
    assert both.returncode == 0, both.stderr[-3000:]
    last = (workdir / "both" / "cli.log").read_text().splitlines()[-1]
    assert "finished 6 steps (trainer.epochs=3 reached) in " in last


def test_an_interpolation_naming_a_missing_key_is_one_paragraph(workdir):
    """A model file written for an older data option (``${data.num_classes}``)."""
    (workdir / "mine" / "model").mkdir(parents=True)
    (workdir / "mine" / "model" / "old.yaml").write_text("_target_: hookexp.workloads.models.SmallCNN\n"
                                                         "num_classes: ${data.num_classes}\n")
    done = run_cli(["--config-dir", str(workdir / "mine"), "model=old", "hydra.run.dir=run"], workdir)
    assert done.returncode == 2 and not (workdir / "run").exists()
    assert done.stderr.strip().splitlines()[-1] == (
        "hookexp: error: model.num_classes: ${data.num_classes} names data.num_classes, a key the config does not "
        "have. Did you mean 'num_workers'? data has: batch_size, eval_batch_size, num_workers, val_fraction, "
        "split_seed, collate_fn, dataset. Set model.num_classes to a value, or make the interpolation name a key "
        "that exists.")
    assert "Traceback" not in done.stderr and "InterpolationKeyError" not in done.stderr


def test_an_invalid_wandb_mode_in_the_environment_is_named(workdir, monkeypatch):
    done = run_cli(["trainer.max_steps=2", "hydra.run.dir=run"], workdir, env={"WANDB_MODE": ""})
    assert done.returncode == 2
    assert ("hookexp: error: WANDB_MODE: the environment sets WANDB_MODE='', which W&B refuses (and which would "
            "override logger.mode=offline). Unset it") in done.stderr
    assert not (workdir / "run").exists()


def test_a_run_directory_holds_one_run_and_resume_recomposes_its_config(workdir):
    """The same command twice is refused before anything is written; resume=true hydra.run.dir=X continues X with
    X's own config (extending trainer.max_steps is allowed, changing what it computes is not)."""
    first = run_cli(["hooks=clamp_conv", "trainer.max_steps=4", "trainer.checkpoint_every=4", "hydra.run.dir=run"],
                    workdir)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"run directory: {workdir / 'run'}" in first.stdout + first.stderr
    before = {p: p.read_bytes() for p in (workdir / "run").rglob("*") if p.is_file()}
    again = run_cli(["hooks=clamp_conv", "trainer.max_steps=4", "trainer.checkpoint_every=4", "hydra.run.dir=run"],
                    workdir)
    assert again.returncode == 2
    assert (f"hookexp: error: hydra.run.dir: {workdir / 'run'} already holds a run (metrics.jsonl, summary.json, "
            "manifest.json, checkpoints, wandb, plots); a new run there would mix its results") in again.stderr
    assert {p: p.read_bytes() for p in (workdir / "run").rglob("*") if p.is_file()} == before
    refused = run_cli(["resume=true", "hydra.run.dir=run", "optim.lr=0.5"], workdir)
    assert refused.returncode == 2 and "hookexp: error: resume: resume=true continues the run in run with the config " \
        "it was started with (trainer.progress=false hooks=clamp_conv trainer.max_steps=4 trainer.checkpoint_every=4" \
        "); optim.lr=0.5 would change what it computes." in refused.stderr
    longer = run_cli(["resume=true", "hydra.run.dir=run", "trainer.max_steps=8"], workdir)
    assert longer.returncode == 0, longer.stderr[-2000:]
    summary = json.loads((workdir / "run" / "summary.json").read_text())
    assert summary["trainer/steps"] == 8 and summary["hook/clamp_conv/calls"] == 2 * 8  # clamp_conv came back
    fresh = run_cli(["trainer.max_steps=2", "hydra.run.dir=run", "+overwrite=true"], workdir)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    summary = json.loads((workdir / "run" / "summary.json").read_text())
    assert summary["trainer/steps"] == 2 and "hook/clamp_conv/calls" not in summary
    assert not (workdir / "run" / "checkpoints").exists()


@pytest.mark.parametrize(("argv", "expected"), [
    (["reprot", "multirun/x"], "hookexp: error: 'reprot' is neither a subcommand nor an override (KEY=VALUE, "
                               "GROUP=OPTION). Did you mean 'report' or 'replay'? Subcommands: report, ablate, replay; "
                               "python -m hookexp --help lists the config groups and keys.\n"),
    (["hooks", "clamp_conv"], "hookexp: error: 'hooks' is neither a subcommand nor an override (KEY=VALUE, "
                              "GROUP=OPTION). Subcommands: report, ablate, replay;"),
])
def test_a_first_word_that_is_no_subcommand_nor_override_is_named(argv, expected, monkeypatch, capsys):
    """Not Hydra's "Error parsing override 'reprot' / missing EQUAL at '<EOF>'" (exit 1): one line, exit 2."""
    from hookexp.cli import main

    monkeypatch.setattr(sys, "argv", ["hookexp", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(expected)


def test_a_refused_resume_lists_what_may_change_as_docs_runs_md_does(tmp_path):
    """The list names optimized_metric and logger.*, not resume itself; docs/runs.md lists the same keys."""
    from hookexp.errors import RunDirError
    from hookexp.run.rundir import resumable_changes, resume_overrides

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- trainer.max_steps=4\n")
    with pytest.raises(RunDirError) as e:
        resume_overrides(["resume=true", f"hydra.run.dir={tmp_path}", "optim.lr=0.5"])
    assert str(e.value).endswith(
        "optim.lr=0.5 would change what it computes. Only trainer.max_steps, trainer.epochs, trainer.progress, "
        "trainer.checkpoint_every, trainer.device, trainer.num_threads, trainer.save_records, data.num_workers, "
        "trainer.stop_when, hydra.searchpath, logger.*, optimized_metric may change on resume; start a new run for "
        "anything else.")
    docs = " ".join(section(DOCS / "runs.md", "Checkpoints, resume, the guard").split())
    assert [k for k in resumable_changes().split(", ") if f"`{k}`" not in docs] == []


def test_the_resume_command_an_interrupted_run_prints_works(workdir):
    """The command names the interpreter that ran, so it works where `python` is another one."""
    import shlex
    import subprocess
    import sys

    stop = "+hooks.stop={target:fc2,kind:forward,transform:{_target_:user_transforms.signal_at,step:3}}"
    done = run_cli([stop, "trainer.max_steps=6", "hydra.run.dir=run", "logger=none"], workdir)
    assert done.returncode == 128 + 15, done.stderr[-2000:]
    hint = done.stderr.strip().splitlines()[-1]
    assert hint == (f"hookexp: interrupted by signal 15 after step 4; continue with: {sys.executable} -m hookexp "
                    f"resume=true hydra.run.dir={workdir / 'run'}")
    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(HELPERS), "WANDB_SILENT": "true"}
    resumed = subprocess.run(shlex.split(hint.split("continue with: ")[1]), cwd=elsewhere, env=env,
                             capture_output=True, text=True, timeout=300)  # exactly the printed command
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((workdir / "run" / "summary.json").read_text())["trainer/steps"] == 6


def test_help_answers_without_importing_torch(workdir):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hookexp", "--help"], cwd=workdir,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "== Config groups" in done.stdout
    assert "== Subcommands" in done.stdout and "report DIR [DIR ...]" in done.stdout and "replay RUN_DIR" in done.stdout
    assert "Versions (for a bug report): --version." in done.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "hookexp.cli" in imported and "torch" not in imported


@pytest.mark.parametrize("flag", ["--version", "-V", "hooks=clamp_conv --version"])
def test_version_is_hookexps_and_names_what_a_bug_report_needs(flag, workdir):
    """Hydra's own --version answered "Hydra 1.3.8"; hookexp's names itself, torch and Hydra, without torch."""
    import subprocess
    import sys
    from importlib.metadata import version

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hookexp", *flag.split()], cwd=workdir,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip()
    assert line.startswith(f"hookexp {version('hookexp')} (torch {version('torch')}, hydra-core "
                           f"{version('hydra-core')}, "), line
    assert line.endswith(f"; Python {sys.version.split()[0]})"), line
    imported = {row.rsplit("|", 1)[-1].strip() for row in done.stderr.splitlines() if "|" in row}
    assert "torch" not in imported


def test_failure_inside_a_hook_keeps_metrics_and_marks_the_wandb_run_failed(workdir):
    args = ["hooks=clamp_conv", "hooks.clamp_conv.transform={_target_:user_transforms.explode}",
            "hooks.clamp_conv.start_step=25", "stats.every=5", "hydra.run.dir=run"]
    done = run_cli(args, workdir)
    assert done.returncode == 2
    assert ("hookexp: error: hooks.clamp_conv.transform: transform 'user_transforms.explode' failed on target "
            "'conv2' (kind 'output_grad') at step 25: ValueError: boom") in done.stderr
    run = workdir / "run"
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["trainer/step"] for r in rows if "train/loss" in r] == [0, 5, 10, 15, 20]
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    wb = wandb_summary(run)
    assert wb["exit_code"] == 1 and wb["state"] != "finished"


@pytest.mark.parametrize("args", [[], ["logger=wandb", "logger.mode=disabled"]],
                         ids=["logger=none", "logger.mode=disabled"])  # config() has logger=none
def test_without_wandb_the_local_files_are_still_written(args, workdir, monkeypatch):
    """In process: what W&B's mode decides is the run layer's (the command line's own handling of WANDB_MODE is
    test_an_invalid_wandb_mode_in_the_environment_is_named's)."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    summary = train(config(*args, "trainer.max_steps=3"), workdir / "run")
    assert summary["status"] == "finished"
    assert not (workdir / "run" / "wandb").exists()
    assert [r["trainer/step"] for r in read_jsonl(workdir / "run" / "metrics.jsonl")] == [0, 2, 2]


@pytest.mark.parametrize(("environment", "args", "writes_wandb"), [("disabled", [], False),
                                                                   ("offline", ["logger.mode=disabled"], True)])
def test_wandb_mode_in_the_environment_wins_over_logger_mode(environment, args, writes_wandb, workdir, monkeypatch):
    """CI switches W&B off with WANDB_MODE=disabled; any valid WANDB_MODE wins, as W&B users expect (in process:
    the run layer reads it)."""
    monkeypatch.setenv("WANDB_MODE", environment)
    monkeypatch.setenv("WANDB_SILENT", "true")
    summary = train(config("logger=wandb", *args, "trainer.max_steps=2"), workdir / "run")
    assert summary["status"] == "finished"
    assert (workdir / "run" / "wandb").exists() == writes_wandb
    assert [r["trainer/step"] for r in read_jsonl(workdir / "run" / "metrics.jsonl")] == [0, 1, 1]
    if writes_wandb:
        assert wandb_summary(workdir / "run")["summary"]["trainer/steps"] == 2


def test_a_wandb_run_keeps_the_terminal_quiet_and_the_last_line_is_hookexps(workdir):
    """No W&B history and summary at the end of each run (W&B's own quiet setting)."""
    done = run_cli(["trainer.max_steps=2", "hydra.run.dir=run"], workdir, env={"WANDB_SILENT": "false"})
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("wandb:")]
    assert said and not [line for line in said if any(w in line for w in ("Run history", "Run summary", "wandb sync"))]
    last = done.stdout.strip().splitlines()[-1].split("][")[-1]
    assert last.startswith("INFO] - finished 2 steps (trainer.max_steps=2 reached) in ")
    assert wandb_summary(workdir / "run")["summary"]["trainer/steps"] == 2


def test_a_wandb_server_that_never_answers_costs_init_timeout_then_training_goes_on_offline(workdir):
    """A server that accepts connections and never answers (W&B's own retries and telemetry exporter would
    wait on it before training and at exit): one probe bounded by init_timeout asks it, once, and the run goes
    on offline. Checked by what happened (the server
    asked once, the fallback said once, an offline run written, training finished), never by wall time."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(server.accept()[0]) for _ in iter(int, 1)], daemon=True).start()
    env = {"WANDB_BASE_URL": f"http://127.0.0.1:{server.getsockname()[1]}", "WANDB_API_KEY": "a" * 40}
    done = run_cli(["logger.mode=online", "logger.init_timeout=2", "trainer.max_steps=3", "hydra.run.dir=run"],
                   workdir, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    log = (workdir / "run" / "cli.log").read_text()
    fallback = f"did not answer within logger.init_timeout=2 s; logging offline under {workdir / 'run'}/wandb instead"
    assert log.count(fallback) == 1 and done.stdout.count(fallback) == 1  # said once, in the log and on the terminal
    assert "W&B online init failed" not in log  # W&B's own init never waited on the server
    assert len(held) == 1  # the one probe: nothing else (init, its retries, the exit) connected to the server
    run = wandb_summary(workdir / "run")  # the offline run, written in full
    assert run["state"] == "finished" and run["summary"]["trainer/steps"] == 3
    summary = json.loads((workdir / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["trainer/steps"] == 3


def test_unknown_wandb_mode_is_refused(workdir):
    done = run_cli(["logger.mode=ofline", "trainer.max_steps=2", "hydra.run.dir=run"], workdir)
    assert done.returncode == 2
    assert "hookexp: error: logger.mode: unknown W&B mode 'ofline'. Use offline, online or disabled." in done.stderr


def test_a_run_directory_that_cannot_be_made_is_one_paragraph(workdir):
    """A file where a folder of the run directory's path should be (as root, permissions cannot stand
    in: root writes anywhere); the same check covers a read-only disk."""
    (workdir / "blocker").write_text("a file")
    done = run_cli(["trainer.max_steps=2", "logger=none", "hydra.run.dir=blocker/run"], workdir)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"hookexp: error: hydra.run.dir: cannot write the run directory {workdir / 'blocker' / 'run'}: "
        f"{workdir / 'blocker'} is a file, not a directory. Choose a writable directory with hydra.run.dir=PATH, "
        "or fix the path or its permissions.")
    assert "Traceback" not in done.stderr


def hook_files(workdir: Path) -> Path:
    conf = workdir / "mine" / "hooks"
    conf.mkdir(parents=True)
    for name, kind, transform in (("a", "output_grad", "clamp"), ("b", "forward", "zero")):
        (conf / f"{name}.yaml").write_text(f"clip:\n  target: fc1\n  kind: {kind}\n  transform: {transform}\n")
    return workdir / "mine"


def test_the_same_spec_name_in_two_selected_hook_files_is_refused_naming_both(workdir):
    """Hydra would merge the two (b's kind and transform with a's fields); refused on the command line
    and in the Python API's compose, before anything is written."""
    conf = hook_files(workdir)
    done = run_cli(["--config-dir", str(conf), "hooks=[a,b]", "hydra.run.dir=run"], workdir)
    assert done.returncode == 2 and not (workdir / "run").exists()
    expected = ("hooks.clip: spec 'clip' is defined by two hook files, hooks/a.yaml and hooks/b.yaml; Hydra would "
                "merge them and the second would silently replace the first. Rename the spec in one of them")
    assert f"hookexp: error: {expected}" in done.stderr
    from hookexp.run import compose

    with pytest.raises(ConfigError, match=re.escape(expected)):
        compose("hooks=[a,b]", config_dir=conf)
    with pytest.raises(ConfigError, match=r"^hooks: hooks/clamp_conv\.yaml is selected twice; select each hook file"):
        compose("hooks=[clamp_conv,clamp_conv]")
    assert compose("hooks=[a]", config_dir=conf).hooks.clip.kind == "output_grad"


def config_dir_flags(how: str, conf: Path) -> list[str]:
    return ["--config-dir", str(conf)] if how == "config-dir" else [f"hydra.searchpath=[file://{conf}]"]


@pytest.mark.parametrize("how", ["config-dir", "searchpath"])
def test_a_users_config_directory_is_found_by_config_dir_and_by_hydra_searchpath(how, workdir):
    """Both ways Hydra documents find the user's hooks/ and model/ files."""
    conf = hook_files(workdir)
    (conf / "model").mkdir()
    (conf / "model" / "tiny.yaml").write_text("_target_: hookexp.workloads.models.MLP\ninput_dim: auto\n"
                                              "output_dim: auto\ndepth: 2\nwidth: 8\n")
    done = run_cli([*config_dir_flags(how, conf), "model=tiny", "hooks=b", "+dry_run=true", "logger=none",
                    "hydra.run.dir=run"], workdir)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads((workdir / "run" / "dry_run.json").read_text())["hooks"]
    assert row["spec"] == "clip" and row["kind"] == "forward" and row["targets"] == ["fc1"]


@pytest.mark.parametrize("how", ["config-dir", "searchpath"])
def test_two_hook_files_of_a_users_config_directory_defining_one_spec_are_hookexps_error(how, workdir):
    """The same refusal whichever way the directory was given."""
    done = run_cli([*config_dir_flags(how, hook_files(workdir)), "hooks=[a,b]", "hydra.run.dir=run"], workdir)
    assert done.returncode == 2 and not (workdir / "run").exists()
    assert done.stderr.strip().splitlines()[-1] == (
        "hookexp: error: hooks.clip: spec 'clip' is defined by two hook files, hooks/a.yaml and hooks/b.yaml; Hydra "
        "would merge them and the second would silently replace the first. Rename the spec in one of them (a spec "
        "name is unique in a run).")


def test_a_batch_the_model_cannot_take_names_the_data_and_the_fix(workdir):
    """A mapping batch whose keys are not the model's forward parameters: one paragraph, not torch's TypeError."""
    (workdir / "mapdata.py").write_text(
        "import torch\n\n"
        "class Rows(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 64\n\n"
        "    def __getitem__(self, i):\n"
        "        return {'features': torch.randn(1, 8, 8), 'labels': torch.tensor(i % 10)}\n\n"
        "def make():\n    return Rows(), Rows()\n")
    done = run_cli(["data.dataset._target_=mapdata.make", "model.in_channels=1", "model.image_size=8",
                    "model.num_classes=10", "hydra.run.dir=run", "logger=none"], workdir,
                   env={"PYTHONPATH": str(workdir)})
    assert done.returncode == 2 and not (workdir / "run").exists()
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hookexp: error: data.dataset: the model cannot take a training batch: "), last
    assert "forward() missing 1 required positional argument" in last and "keys ['features', 'labels']" in last
    assert "Traceback" not in done.stderr


def test_a_users_task_hears_once_which_default_keys_it_does_not_take(workdir):
    """task._target_=mytask.Mse over the classification task: label_smoothing is dropped and said so once (the
    sweep objective's check builds the task quietly before the run builds it)."""
    (workdir / "mytask.py").write_text(
        "import torch.nn.functional as F\n"
        "from hookexp.workloads.tasks import Task\n\n"
        "class Mse(Task):\n"
        "    def loss(self, out, batch):\n"
        "        return F.mse_loss(out, F.one_hot(batch[-1], out.shape[-1]).float())\n")
    done = run_cli(["task._target_=mytask.Mse", "trainer.max_steps=1", "hydra.run.dir=run", "logger=none"], workdir,
                   env={"PYTHONPATH": str(workdir)})
    assert done.returncode == 0, done.stderr[-2000:]
    line = "task: mytask.Mse does not take label_smoothing (from the default task config): not passed"
    assert (workdir / "run" / "cli.log").read_text().count(line) == 1


def test_a_type_error_inside_the_model_is_not_blamed_on_the_batch(workdir, monkeypatch):
    """Only the model's own forward refusing the batch is explained (a HookexpError: the command line's paragraph);
    a bug inside the model stays the model's own TypeError (the command line keeps its traceback). In process."""
    (workdir / "buggy.py").write_text(
        "import torch\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self, **kwargs):\n        super().__init__()\n        self.fc = torch.nn.Linear(64, 10)\n\n"
        "    def forward(self, x):\n        return self.fc(x.flatten(1), x)  # a bug: Linear takes one input\n")
    monkeypatch.syspath_prepend(str(workdir))
    try:
        with pytest.raises(TypeError) as e:
            train(config("model._target_=buggy.Net"), workdir / "run")
    finally:
        sys.modules.pop("buggy", None)  # another test's buggy.py must not find this one imported
    assert type(e.value) is TypeError and not isinstance(e.value, HookexpError)
    assert "Linear.forward() takes 2 positional arguments but 3 were given" in str(e.value)
    assert "the model cannot take a training batch" not in str(e.value)


def test_the_resume_command_keeps_where_the_configs_came_from():
    """A run composed from the user's config directory is resumed from it: the printed command keeps
    --config-dir (and the other config flags) and hydra.searchpath, and nothing else of the command line."""
    from hookexp.cli import config_sources

    args = ["--config-dir", "mine", "model=nanogpt", "hydra.searchpath=[file://extra]", "-cn=other", "seed=3",
            "hydra.run.dir=run"]
    assert config_sources(args) == ["--config-dir", "mine", "hydra.searchpath=[file://extra]", "-cn=other"]


def test_the_private_hydra_api_hookexp_uses_is_there_on_the_installed_hydra():
    """Each private Hydra function hookexp uses, run on the installed hydra-core; if a release moved one, this
    fails with hookexp's message naming the version (and so does every run, before it starts)."""
    import hydra
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from hookexp.errors import HookexpError
    from hookexp.run.hydra_api import hydra_private

    try:
        with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            parsed, repo = hydra_private("config_repository")(loader, "config", ["hooks=clamp_conv"])
            assert [o.input_line for o in parsed] == ["hooks=clamp_conv"]
            assert list(repo.load_config("hooks/clamp_conv").config) == ["clamp_conv"]
        cfg = OmegaConf.create({"trainer": {"epochs": 1}})
        from hydra.core.override_parser.overrides_parser import OverridesParser

        hydra_private("apply_overrides")(OverridesParser.create().parse_overrides(["trainer.epochs=3"]), cfg)
        assert cfg.trainer.epochs == 3
    except HookexpError as e:
        pytest.fail(f"hydra-core {hydra.__version__}: {e}")


def test_a_private_hydra_function_that_moved_names_the_hydra_version(monkeypatch):
    import hydra

    from hookexp.errors import HookexpError
    from hookexp.run import hydra_api as cli

    module, cls, _, params = cli.HYDRA_PRIVATE["apply_overrides"]
    monkeypatch.setitem(cli.HYDRA_PRIVATE, "apply_overrides", (module, cls, "_apply_overrides_to_cfg", params))
    with pytest.raises(HookexpError) as e:
        cli.hydra_private("apply_overrides")
    assert str(e.value) == (
        "hookexp uses Hydra's private hydra._internal.config_loader_impl.ConfigLoaderImpl._apply_overrides_to_cfg("
        f"overrides, cfg), which hydra-core {hydra.__version__} does not have (a Hydra release moved it). hookexp "
        "supports hydra-core>=1.3.2,<1.4: pip install 'hydra-core>=1.3.2,<1.4'.")
    monkeypatch.setitem(cli.HYDRA_PRIVATE, "apply_overrides", (module, cls, "_apply_overrides_to_config", ("cfg",)))
    with pytest.raises(HookexpError, match=rf"which hydra-core {re.escape(hydra.__version__)} does not have"):
        cli.hydra_private("apply_overrides")  # there, but with other parameters


def test_private_hydra_is_used_only_through_hydra_private_and_pyproject_states_the_versions():
    import tomllib

    from hookexp.run.hydra_api import HYDRA_PRIVATE, HYDRA_SUPPORTED

    root = Path(__file__).parents[2]
    names = {"hydra._internal", *(attr for _, _, attr, _ in HYDRA_PRIVATE.values())}
    for path in (root / "hookexp").rglob("*.py"):
        text = path.read_text()
        for name in names:
            if path.name == "hydra_api.py":  # once per entry of the HYDRA_PRIVATE table, nowhere else
                assert text.count(name) == sum(name in str(entry) for entry in HYDRA_PRIVATE.values()), name
            else:
                assert name not in text, (path, name)
    requirements = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"hydra-core{HYDRA_SUPPORTED}" in requirements


def test_no_progress_bar_when_stderr_is_not_a_terminal(workdir):
    """trainer.progress=true (the default) draws the bar on a terminal only: redirected, the log lines stand alone."""
    done = run_cli(["trainer.progress=true", "trainer.max_steps=3", "logger=none", "hydra.run.dir=run"], workdir)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "\r" not in done.stderr and "train:" not in done.stderr and "step/s" not in done.stderr, done.stderr
    assert all(line.startswith("[") for line in (done.stdout + done.stderr).splitlines() if line.strip())
