"""The README's quick start and the recipes of docs/models.md ("Your own model, data and loss", "A model that
computes its own loss"): their files written as shown, their commands run as shown. Every other shell command
of README.md and docs/ is run by tests/test_docs.py."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from docblocks import DOCS, README, blocks, run, section, user_env

MODELS = DOCS / "models.md"


def test_your_own_model_data_and_loss_runs_as_the_readme_shows(tmp_path: Path):
    text = section(MODELS, "Your own model, data and loss")
    files = {body.splitlines()[0][2:].strip(): body for lang, body in blocks(text)
             if lang in ("python", "yaml") and body.startswith("# ")}
    assert set(files) == {"mynet.py", "myconf/model/mynet.yaml", "myconf/data/blobs.yaml", "myconf/task/focal.yaml",
                          "run_mine.py"}
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    commands = [line for lang, body in blocks(text) if lang == "bash" for line in body.splitlines() if line]
    assert len(commands) == 3
    env = user_env()  # hookexp, python: the venv's; mynet found from the cwd
    for command in commands:
        args = shlex.split(command)
        assert args[0] in ("hookexp", "python")
        done = run(command, tmp_path, env)  # by bash as a user pastes it
        assert done.returncode == 0, (command, done.stderr[-3000:])
        if args[0] == "python":
            assert float(done.stdout.split()[-1]) > 0.9
    summaries = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/**/summary.json")]
    assert len(summaries) == 3 and all(s["status"] == "finished" and s["val/acc"] > 0.9 for s in summaries)
    manifests = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/**/manifest.json")]
    assert all(m["config"]["model"] == {"_target_": "mynet.Net", "hidden": 64} for m in manifests[:2])


def test_a_model_that_computes_its_own_loss_trains_as_the_readme_shows(tmp_path: Path):
    """nanoGPT's GPT (tests/helpers/nanogpt.py as the user's model.py), trained with the README's command
    (smaller); its losses, gradients and hook effects equal those of the adapter a user had to write before (the
    whole logits, under task=causal_lm), step for step."""
    from conftest import HELPERS, TESTS, read_jsonl
    from hydra import compose, initialize_config_module

    from hookexp.run.loop import run_job as train

    text = section(MODELS, "A model that computes its own loss")
    files = {body.splitlines()[0][2:].strip(): body for lang, body in blocks(text) if lang == "yaml"}
    assert set(files) == {"myconf/model/nanogpt.yaml"}
    (tmp_path / "myconf" / "model").mkdir(parents=True)
    (tmp_path / "myconf" / "model" / "nanogpt.yaml").write_text(files["myconf/model/nanogpt.yaml"])
    (tmp_path / "model.py").write_text((HELPERS / "nanogpt.py").read_text())
    (tmp_path / "input.txt").write_text((TESTS / "conftest.py").read_text() * 2)
    (command,) = [line for lang, body in blocks(text) if lang == "bash" for line in body.splitlines() if line]
    small = ["model.config.n_layer=2", "model.config.n_head=2", "model.config.n_embd=32", "data.block_size=17",
             "data.batch_size=8", "trainer.max_steps=6", "stats.every=2", "logger=none", "trainer.progress=false",
             "hydra.run.dir=run"]
    done = run(f"{command} {shlex.join(small)}", tmp_path, user_env())  # model.py found from the cwd
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "finished"

    adapter = ["task=causal_lm", "data=text_file", f"data.path={tmp_path / 'input.txt'}",
               "model._target_=nanogpt.Adapter",
               "+model.config={_target_:nanogpt.GPTConfig,vocab_size:auto,block_size:auto,n_layer:2,n_head:2,"
               "n_embd:32,dropout:0.0}", "+hooks.clip={target:gpt.transformer.h.*.mlp,kind:output_grad,"
               "transform:clip_norm,args:{max_norm:0.01}}", *small[3:-1]]
    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        train(compose("config", overrides=adapter), tmp_path / "adapter", adapter)
    ours, theirs = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("run", "adapter"))
    assert [r["trainer/step"] for r in ours] == [r["trainer/step"] for r in theirs]
    keys = ["train/loss", "val/loss", "val/ppl", "grad/global_norm", "hook/clip/calls", "hook/clip/change_norm",
            "hook/clip/cosine"]
    assert {k for r in ours for k in r} >= set(keys) and not any("acc" in k for r in ours for k in r)
    for a, b in zip(ours, theirs, strict=True):
        for key in [k for k in keys if k in b]:
            assert a[key] == pytest.approx(b[key], rel=1e-5), key


def test_the_quick_start_gives_the_figure_the_readme_quotes(quick_start: Path):
    """The val/acc the README quotes for the quick start is what the quick start gives. The command is read from
    the README and run as it stands there (conftest's ``quick_start``), and the figure must be its result to the
    digits quoted."""
    figure = re.search(r"val/acc about (\d+\.(\d+))", section(README, "Quick start"))
    summary = json.loads((quick_start / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert round(summary["val/acc"], len(figure.group(2))) == float(figure.group(1)), (summary["val/acc"], figure[0])
