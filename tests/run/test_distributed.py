"""torchrun with 2 CPU ranks (gloo): replicas stay in sync, only rank 0 writes, and grad-kind hooks see
each rank's local gradient while pre_step hooks see the averaged one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from conftest import config, helpers_path, read_jsonl
from hydra import compose, initialize_config_module

from hookexp.run.build import build
from hookexp.run.distributed import Dist
from hookexp.run.loaders import EpochSampler
from hookexp.run.loop import run_job as train

SPECS = ["+hooks.local={target:fc2.bias,kind:grad,transform:record}",
         "+hooks.averaged={target:fc2.bias,kind:pre_step,transform:record}"]


def torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 -m hookexp ARGS`` with CPU ranks, also on a GPU machine."""
    env = {**os.environ, "PYTHONPATH": helpers_path(), "WANDB_SILENT": "true"}
    # --standalone: torchrun's own rendezvous on a port it binds itself (a port picked here and freed could be taken
    # by a parallel test's torchrun before this one binds it)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "hookexp", "trainer.progress=false", "trainer.device=cpu", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_two_ranks_stay_in_sync_only_rank_0_writes_and_a_resume_keeps_every_ranks_period(workdir):
    """A checkpoint between log steps (step 10; logs at 0, 4, 8, 11) holds each rank's sums of steps 8 and 9: the
    run resumed from it into another directory logs exactly what the uninterrupted run logged, the noise scale's
    moving averages included. The activation statistics describe both ranks' halves of the batch: step 0's are one
    process's on the whole batch."""
    import pytest

    common = ["hooks=clamp_conv", "trainer.max_steps=12", "stats.every=4", "trainer.checkpoint_every=5",
              "stats.activations=relu*", "stats.gns=true"]
    done = torchrun([*common, "hydra.run.dir=run"], workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    run = workdir / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dist/world_size"] == 2 and summary["dist/params_in_sync"] is True
    assert summary["trainer/steps"] == 12
    steps = [r["trainer/step"] for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert steps == [0, 4, 8, 11]  # once each: rank 1 wrote nothing
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1
    assert json.loads((run / "manifest.json").read_text())["world_size"] == 2
    resumed = torchrun([*common, "resume=run", "hydra.run.dir=fork", "logger=none"], workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def rows(path):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_jsonl(path)]

    assert rows(workdir / "fork" / "metrics.jsonl") == rows(run / "metrics.jsonl")

    one = workdir / "one"  # one process, the two ranks' batches of 64 as one of 128 (rank r takes every other index)
    train(config("hooks=clamp_conv", "trainer.max_steps=1", "stats.activations=relu*", "data.batch_size=128"), one)
    (first, *_), (alone, *_) = read_jsonl(run / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    activations = sorted(k for k in alone if k.startswith("act/"))
    assert len(activations) == 3 * 5 and sorted(k for k in first if k.startswith("act/")) == activations
    assert {k: first[k] for k in activations} == pytest.approx({k: alone[k] for k in activations}, rel=1e-6)


def test_an_interrupted_torchrun_prints_its_command_once_and_other_ranks_leave_no_directory(workdir):
    """Rank 0 alone prints the resume command, torchrun's with its rank counts; each rank's
    Hydra names a directory of its own here (runs/<rank>, as timestamps a second apart do) and only the run's is
    left."""
    stop = "+hooks.stop={target:fc2,kind:forward,transform:{_target_:user_transforms.signal_at,step:3}}"
    done = torchrun([stop, "trainer.max_steps=6", "logger=none", "hydra.run.dir=runs/${oc.env:RANK}"], workdir)
    assert done.returncode != 0
    hints = [line.split("; continue with: ")[1] for line in done.stderr.splitlines() if "continue with:" in line]
    assert hints == [f"{Path(sys.executable).with_name('torchrun')} --nnodes=1 --nproc_per_node=2 -m hookexp "
                     f"resume=true hydra.run.dir={workdir / 'runs' / '0'}"], done.stderr[-3000:]
    assert [p.name for p in (workdir / "runs").iterdir()] == ["0"]
    assert json.loads((workdir / "runs" / "0" / "summary.json").read_text())["status"] == "interrupted"


def test_grad_hooks_see_local_gradients_and_pre_step_hooks_the_averaged_one(workdir):
    done = torchrun([*SPECS, "trainer.max_steps=1", "logger=none", "hydra.run.dir=run"], workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    records = {name: torch.load(workdir / "run" / "records" / f"{name}.pt", weights_only=True)[0]["value"]
               for name in ("local", "averaged")}

    # By hand: the same model and the two ranks' first batches, one process.
    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "trainer.device=cpu"])
    parts = build(cfg, Dist(), torch.device("cpu"))
    train_set = parts.loaders.train
    local_grads = []
    for rank in (0, 1):  # each rank's first batch: its share of the epoch's permutation
        sampler = EpochSampler(len(train_set), seed=cfg.seed, train=True, rank=rank, world_size=2)
        x, y = train_set.__getitems__(list(sampler)[:cfg.data.batch_size])
        parts.model.zero_grad()
        F.cross_entropy(parts.model(x), y).backward()
        local_grads.append(parts.model.fc2.bias.grad.clone())
    assert torch.allclose(records["local"], local_grads[0], atol=1e-7)  # rank 0's own gradient
    assert torch.allclose(records["averaged"], (local_grads[0] + local_grads[1]) / 2, atol=1e-7)
    assert not torch.allclose(records["local"], records["averaged"], atol=1e-4)


GNS = ["trainer.accumulate=2", "stats.gns=true", "stats.gns_ema=0.5", "stats.every=1", "stats.grads=null",
       r"stats.group_by='re:^fc\d'", "trainer.max_steps=2"]


def test_the_noise_scale_of_two_ranks_is_one_process_with_twice_the_accumulation(workdir):
    """stats.gns under DDP: 2 ranks x 2 micro-batches give exactly what one process gives with the same 4
    micro-batches accumulated, the ranks' small-batch estimates averaged in the log step's all_reduce."""
    import itertools

    import pytest

    import hookexp

    done = torchrun([*GNS, "logger=none", "hydra.run.dir=run"], workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = {r["trainer/step"]: {k: v for k, v in r.items() if k.startswith("gns")}
              for r in read_jsonl(workdir / "run" / "metrics.jsonl") if "train/loss" in r}

    # One process: the same model, and each step's 4 micro-batches (rank 0's two, then rank 1's), loss / 4.
    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "trainer.device=cpu", *GNS])
    parts = build(cfg, Dist(), torch.device("cpu"))
    train_set, b = parts.loaders.train, cfg.data.batch_size
    orders = [list(EpochSampler(len(train_set), seed=cfg.seed, train=True, rank=r, world_size=2)) for r in (0, 1)]
    model, optimizer = parts.model, parts.optimizer
    got: dict[int, dict] = {}
    with hookexp.watch(model, optimizer, every=1, grads=None, group_by=r"re:^fc\d", gns=True, gns_ema=0.5,
                       log=lambda metrics, step: got.__setitem__(step, metrics)):
        for step in range(2):
            optimizer.zero_grad()
            for rank, i in itertools.product((0, 1), (2 * step, 2 * step + 1)):
                x, y = train_set.__getitems__(orders[rank][i * b:(i + 1) * b])
                (F.cross_entropy(model(x), y) / 4).backward()
            optimizer.step()
    assert sorted(logged) == sorted(got) == [0, 1]
    for step, row in logged.items():
        assert len(row) == 9  # global, fc1, fc2 x (b_simple, grad_sq, trace)
        for key, value in row.items():
            assert value == pytest.approx(got[step][key], rel=1e-5), (step, key)


def test_more_cuda_ranks_than_gpus_is_refused_with_the_fix(monkeypatch):
    """Each CUDA rank trains on its own GPU: two ranks on a one-GPU node would fail deep inside nccl."""
    import pytest

    from hookexp import ConfigError
    from hookexp.run import distributed

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        distributed.setup(torch.device("cuda"))
    assert str(e.value) == ("trainer.device: torchrun started 2 processes on this node but it has 1 CUDA device(s), "
                            "and each process trains on its own GPU. Use --nproc_per_node=1 or fewer, or "
                            "trainer.device=cpu to train the ranks on the CPU (gloo).")


def test_each_cuda_rank_trains_on_its_own_gpu_and_cpu_ranks_on_the_cpu():
    from hookexp.run.distributed import Dist

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert Dist(rank=3, world_size=4, local_rank=1).place(cuda) == torch.device("cuda", 1)
    assert Dist(rank=3, world_size=4, local_rank=1).place(cpu) == cpu
    assert Dist().place(cuda) == cuda  # one process: trainer.device as given
