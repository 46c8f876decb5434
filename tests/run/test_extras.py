"""The quick start installs the main job's packages only; an optional feature used without its extra
is one paragraph naming the extra to install. Each feature is tried with its package made unimportable (None in
sys.modules, as Python does for a module that failed to import)."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HELPERS, run_cli

from hookexp import ConfigError, HookexpError, MissingExtraError

ROOT = Path(__file__).parents[2]
EVERY_EXTRA = ("transformers", "datasets", "accelerate", "lightning", "optuna", "hydra_plugins", "submitit",
               "sqlalchemy", "pytest", "ruff", "torchvision")
INSTALL = "(in a clone: .venv/bin/pip install -e '.[{0}]'; ./scripts/test.sh installs every extra)."


@pytest.mark.parametrize(("module", "blocked", "feature", "extra"), [
    ("hookexp.integrations.lightning", "lightning.pytorch.callbacks",
     "hookexp.integrations.lightning.HookexpCallback (a Lightning callback) needs lightning", "lightning"),
    ("hookexp.integrations.hf", "transformers",
     "hookexp.integrations.hf.HookexpCallback (a callback of the transformers Trainer) needs transformers", "hf"),
])
def test_a_callback_without_its_extra_names_it(monkeypatch, module, blocked, feature, extra):
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, blocked, None)
    with pytest.raises(MissingExtraError) as e:
        importlib.import_module(module)
    assert isinstance(e.value, ImportError) and isinstance(e.value, HookexpError) and e.value.extra == extra
    assert str(e.value).startswith(f"{feature}, which is not installed (import of {blocked} halted; None in "
                                   "sys.modules). Install the extra: pip install 'hookexp[")
    assert str(e.value).endswith(f"pip install 'hookexp[{extra}]' {INSTALL.format(extra)}")


def test_data_hf_disk_without_datasets_names_the_extra(monkeypatch, tmp_path):
    from hookexp.workloads.data import hf_disk

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match=r"^data: data=hf_disk needs the `datasets` package, which is not installed "
                                          r".*Install the extra: pip install 'hookexp\[hf\]'"):
        hf_disk(str(tmp_path))


@pytest.mark.parametrize(("args", "blocked", "first"), [
    (["-m", "sweep=optuna_lr"], "hydra_plugins.hydra_optuna_sweeper",
     "sweep=optuna_lr needs the Hydra plugin hydra-optuna-sweeper (it selects hydra/sweeper=optuna)"),
    (["-m", "hydra/launcher=joblib", "seed=0,1"], "hydra_plugins.hydra_joblib_launcher",
     "hydra/launcher=joblib needs the Hydra plugin hydra-joblib-launcher"),
    (["-m", "hydra/launcher=basic,slurm", "seed=0,1"], "hydra_plugins.hydra_submitit_launcher",
     "hydra/launcher=slurm needs the Hydra plugin hydra-submitit-launcher (it selects "
     "hydra/launcher=submitit_slurm)"),
])
def test_a_sweep_plugin_that_is_not_installed_names_the_extra(tmp_path, args, blocked, first):
    """Hydra itself would say only "Could not find 'hydra/launcher/joblib'" (with its search path)."""
    code = (f"import sys; sys.modules[{blocked!r}] = None; sys.argv = ['hookexp', *{args!r}]; "
            "from hookexp.cli import main; main()")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"hookexp: error: {first}, which is not installed. The sweep plugins are the optional extra sweeps: pip "
        f"install 'hookexp[sweeps]' {INSTALL.format('sweeps')}")
    assert not any(tmp_path.iterdir())  # refused before Hydra made a directory


def test_the_main_job_needs_no_extra(tmp_path):
    """What ./scripts/run.sh installs (torch and the base dependencies) runs the quick start's job: every extra's
    packages are made unimportable in the job's process."""
    (tmp_path / "block").mkdir()
    (tmp_path / "block" / "sitecustomize.py").write_text(
        "import sys\n\n"
        f"BLOCKED = {set(EVERY_EXTRA)!r}\n\n\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (blocked)', name=name)\n\n\n"
        "sys.meta_path.insert(0, Block())\n")
    done = run_cli(["hooks=clamp_conv", "trainer.max_steps=3", "hydra.run.dir=run"], tmp_path,
                   env={"PYTHONPATH": f"{tmp_path / 'block'}{os.pathsep}{HELPERS}"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"status": "finished"' in (tmp_path / "run" / "summary.json").read_text()
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))  # W&B is a base dependency


def test_the_run_command_installs_no_extra_and_the_test_command_every_one_once(tmp_path):
    """scripts/setup.sh as the two quick-start commands call it, with a stand-in .venv/bin/python that records
    the pip commands it is given (and has torch): what each installs, and the stamp it writes, which makes the
    run command after the test command install nothing."""
    for name in ("scripts/setup.sh", "pyproject.toml"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    calls = tmp_path / "pip.log"
    python.write_text(f'#!/bin/sh\n[ "$1" = -m ] && echo "$*" >> {calls}\nexit 0\n')
    python.chmod(0o755)
    stamp = tmp_path / ".venv" / ".hookexp-setup"
    extras = {"run": None, "test": None}
    for script in extras:
        line = next(x for x in (ROOT / f"scripts/{script}.sh").read_text().splitlines() if "scripts/setup.sh" in x)
        extras[script] = line.split("#")[0].split("setup.sh\"")[1].strip()
    assert extras == {"run": "", "test": "dev,sweeps,hf,lightning,mup,tensorboard,docs"}

    def setup(script: str) -> list[str]:
        calls.unlink(missing_ok=True)
        subprocess.run(["bash", str(tmp_path / "scripts/setup.sh"), *[extras[script]] * bool(extras[script])],
                       capture_output=True, text=True, check=True)
        return calls.read_text().splitlines() if calls.exists() else []

    want = subprocess.run(["sha256sum", str(tmp_path / "pyproject.toml")], capture_output=True, text=True,
                          check=True).stdout[:16]
    base = f"-m pip install --quiet -e {tmp_path}"
    mup = "-m pip install --quiet --no-deps mup>=1.0"  # without its own requirements (PyPI's torchvision)
    assert setup("run") == [base]  # a fresh clone: the main job's packages only
    assert stamp.read_text() == f"{want} \n"
    assert setup("run") == []
    assert setup("test") == [f"{base}[dev,docs,hf,lightning,sweeps,tensorboard]", mup]
    assert stamp.read_text() == f"{want} dev,docs,hf,lightning,mup,sweeps,tensorboard\n"
    assert setup("test") == [] and setup("run") == []  # the run command after the test command: nothing
    stamp.write_text(f"{'0' * 16} dev,docs,hf,lightning,mup,sweeps,tensorboard\n")  # pyproject.toml changed since
    assert setup("run") == [base]
    assert setup("test") == [f"{base}[dev,docs,hf,lightning,sweeps,tensorboard]", mup]
