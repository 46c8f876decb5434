"""trainer.strategy=fsdp (FSDP2) on the package's GPT, with CPU ranks (gloo): hook kinds against the unsharded model,
a 2-rank run against one process, sharded checkpoints and resume, the kinds that are refused, and the launchers
(a 2-node rendezvous on this machine, a Hydra multirun under torchrun, SLURM's environment, SLURM's absence).

The torchrun launches are few and shared (module-scoped fixtures): each costs seconds on two cores.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from conftest import FORENSICS_ON, HELPERS, TESTS, config, helpers_path, read_jsonl, run_cli
from hydra import compose, initialize_config_module

from hookexp.errors import CheckpointError, ConfigError, HookCompatibilityError
from hookexp.run import distributed, launchers
from hookexp.run.loop import dry_run
from hookexp.run.loop import run_job as train

# No biases: the key part of attn.qkv.bias has a gradient that is zero but for rounding (softmax ignores a key
# bias), whose signs (frac_neg) differ with the order of any sum, sharded or not.
GPT = ["task=causal_lm", "model=gpt", "model.bias=false", "data=text_file", "data.block_size=16", "model.d_model=32",
       "model.n_head=2", "stats.every=2", "trainer.clip_grad_norm=0.5", "optim=adamw", "trainer.device=cpu",
       "+hooks.clamp={target:blocks.*.mlp,kind:output_grad,transform:clamp,args:{min:0.0}}"]
FSDP = ["trainer.strategy=fsdp"]  # trainer.fsdp.wrap: @blocks
STOP = "+hooks.stop={target:blocks.0,kind:forward,transform:{_target_:user_transforms.signal_at,step:%d}}"


ENGINE_CHANGE = "the engine does not yet give parameter kinds the local shard of a DTensor gradient"
# A pre_step clip on every parameter when the engine handles sharded gradients; every family of statistics, whose
# sharded values (parameters, gradients, optimizer states) and data-parallel ones (activations) are combined over the
# ranks.
CLIP = ["+hooks.clip={target:'*',kind:pre_step,transform:clip_norm,args:{max_norm:0.3}}"] \
    if distributed.engine_shards_gradients() else []
STATS = ["stats.activations=blocks.*.mlp", "stats.params=*", "stats.updates=*", "stats.optimizer=*",
         r"stats.group_by='re:^blocks\.\d+'", "stats.hist_bins=4", "stats.hist_sample=null"]


def text(tmp: Path) -> Path:
    path = tmp / "text.txt"
    path.write_text((TESTS / "conftest.py").read_text() * 2)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_timing(path: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_jsonl(path)]


def torchrun(args: list[str], cwd: Path, *, nodes: int = 1, timeout: int = 240) -> list[subprocess.CompletedProcess]:
    """``torchrun ... ARGS`` with 2 CPU ranks: one node with 2 processes, or 2 nodes (two torchrun agents on this
    machine, one process each) meeting at a c10d rendezvous, as on two machines."""
    env = {**os.environ, "PYTHONPATH": helpers_path(), "WANDB_SILENT": "true"}
    run = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        commands = [[*run, "--standalone", "--nproc_per_node=2", *args]]
    else:
        endpoint = f"127.0.0.1:{free_port()}"
        commands = [[*run, f"--nnodes={nodes}", "--nproc_per_node=1", f"--node_rank={i}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={endpoint}", "--rdzv-id=hookexp-test", *args] for i in range(nodes)]
    procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    done = []
    for c, p in zip(commands, procs, strict=True):
        out, err = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(c, p.returncode, out, err))
    return done


# ----------------------------------------------------------------------------------------------------
# Hook kinds on the sharded GPT against the unsharded one (tests/helpers/fsdp_worker.py, one torchrun launch).

KINDS = ["forward_pre", "forward", "forward_on_unit", "output_grad", "backward", "backward_on_unit",
         "backward_pre_on_unit", "backward_legacy", "node", "node_pre_on_unit"]
PARAMETER_KINDS = ["post_accumulate_clamp", "post_accumulate_clip_norm", "pre_step_clamp", "pre_step_clip_norm"]


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("kinds") / "kinds.json"
    (done,) = torchrun([str(HELPERS / "fsdp_worker.py"), str(out)], out.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def check_kind(row: dict) -> None:
    assert "error" not in row, row.get("traceback", row.get("error"))
    assert row["hook_effect"] > 1e-3  # the hook changes the training: equality below is not trivial
    assert row["sharded_calls"] == row["calls"]
    assert row["param_diff"] < 1e-6
    assert row["sharded_losses"] == pytest.approx(row["losses"], rel=1e-6)


@pytest.mark.parametrize("case", KINDS)
def test_module_kinds_act_on_the_sharded_model_as_on_the_unsharded_one(kinds, case):
    """Forward-side kinds, output_grad, and the backward-side module kinds, also on modules fully_shard made units
    (blocks.N, whose parameters are gathered and freed around them): the same training, step for step."""
    check_kind(kinds[case])


@pytest.mark.parametrize("case", PARAMETER_KINDS)
@pytest.mark.xfail(not distributed.engine_shards_gradients(), reason=ENGINE_CHANGE, strict=True)
def test_parameter_kinds_act_on_the_reduced_shard_and_clip_by_the_global_norm(kinds, case):
    """post_accumulate and pre_step see the averaged gradient's shard: elementwise transforms act on it as on the
    whole gradient, clip_norm scales by the whole tensor's norm (batched pre_step too); hook effects measured."""
    check_kind(kinds[case])


@pytest.mark.parametrize("case", PARAMETER_KINDS)
def test_parameter_kinds_measure_the_whole_tensor_not_the_shard(kinds, case):
    """The hook effects (hook/<spec>/change_norm, cosine, frac_changed) of a parameter kind on the
    sharded model equal the unsharded model's: squared norms and counts are summed over the shards."""
    row = kinds[case]
    assert "error" not in row, row.get("traceback", row.get("error"))
    (effects,) = row["effects"].values()
    (sharded,) = row["sharded_effects"].values()
    assert set(effects) == {"change_norm", "cosine", "frac_changed"} and effects["change_norm"] > 1e-4
    assert sharded == pytest.approx(effects, rel=1e-5, abs=1e-7)


def test_kinds_that_cannot_work_on_sharded_parameters_are_refused_naming_the_kind_to_use(tmp_path):
    specs = ["+hooks.local={target:'*.bias',kind:grad,transform:clamp,args:{min:0.0}}",
             "+hooks.later={target:head.weight,kind:grad,transform:record}",
             "+hooks.off={target:head.weight,kind:grad,transform:record,enabled:false}"]
    expected = ("hooks.local.kind: kind 'grad' cannot work under trainer.strategy=fsdp: FSDP2 replaces every "
                "parameter by a sharded DTensor, and Tensor.register_hook never fires on one (the gradient flows "
                "through the gathered copy, then is reduce-scattered into the shard). Use kind 'post_accumulate' "
                "(the shard of the reduced gradient, after backward) or 'pre_step' (the final gradient, right before "
                "optimizer.step()); or train with trainer.strategy=ddp. The same holds for hooks.later (grad).")
    cfg = config(*GPT, *FSDP, f"data.path={text(tmp_path)}", *specs)
    with pytest.raises(HookCompatibilityError) as e:
        train(cfg, tmp_path / "run")
    assert str(e.value) == expected
    assert not (tmp_path / "run").exists()  # refused before anything was made (no process group either)
    assert not torch.distributed.is_initialized()
    with pytest.raises(HookCompatibilityError, match=r"^hooks\.local\.kind: kind 'grad' cannot work under"):
        dry_run(cfg, tmp_path / "dry")
    distributed.refuse_kinds({"a": {"target": "x", "kind": "grad", "enabled": False}}, "fsdp")  # disabled: fine
    distributed.refuse_kinds([{"target": "x", "kind": "grad"}], "ddp")  # grad hooks work under DDP
    with pytest.raises(HookCompatibilityError, match=r"^hooks\.grad:x\.kind: kind 'grad' cannot work"):
        distributed.refuse_kinds([{"target": "x", "kind": "grad"}], "fsdp")  # the Python API's list of specs
    clip = {"clip": {"target": "*", "kind": "pre_step", "transform": "clip_norm", "args": {"max_norm": 1.0}}}
    if distributed.engine_shards_gradients():
        distributed.refuse_kinds(clip, "fsdp")
    else:  # until the engine gives parameter kinds the local shard: refused here, not a crash on the first log step
        with pytest.raises(HookCompatibilityError) as e:
            distributed.refuse_kinds(clip, "fsdp")
        assert str(e.value) == (
            "hooks.clip.kind: kind 'pre_step' cannot work under trainer.strategy=fsdp: this version's engine gives a "
            "parameter kind's transform the whole sharded gradient (a DTensor), on which batched transforms and the "
            "measuring of hook effects fail. Use a module kind on the module that owns the parameter (output_grad "
            "sees the gradient of its output), or trainer.clip_grad_norm for a clip by the global norm; or train "
            "with trainer.strategy=ddp.")


@pytest.mark.parametrize(("wrap", "units"), [("@blocks", ["blocks.0", "blocks.1", ""]),
                                             ("re:^blocks\\.1(\\.mlp)?$", ["blocks.1.mlp", "blocks.1", ""]),
                                             (None, [""])])
def test_fsdp_shards_the_modules_the_wrap_pattern_names_innermost_first_then_the_root(wrap, units):
    """blocks.1.mlp inside blocks.1: the inner unit first (the other order fails in fully_shard)."""
    from omegaconf import OmegaConf
    from torch.distributed.fsdp import FSDPModule

    from hookexp.workloads.models import GPT

    ranks = distributed.setup(torch.device("cpu"), "fsdp")  # a group of one rank, in this process
    try:
        model = GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, d_model=32)
        names = [n for n, _ in model.named_parameters()]
        trainer = OmegaConf.create({"fsdp": {"wrap": wrap, "reshard_after_forward": True}})
        sharded = distributed.shard(model, trainer, ranks, torch.device("cpu"))
        assert sharded is model and [n for n, _ in model.named_parameters()] == names  # names kept
        assert sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)) == sorted(units)
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())
        with pytest.raises(ConfigError, match=r"^trainer\.fsdp\.wrap: .*'blockz'.*Did you mean"):
            distributed.shard(GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, d_model=32),
                              OmegaConf.create({"fsdp": {"wrap": "blockz", "reshard_after_forward": True}}), ranks,
                              torch.device("cpu"))
    finally:
        distributed.teardown(ranks)
    assert not torch.distributed.is_initialized()


def test_a_group_of_one_trains_on_the_gpu_it_names_or_the_first():
    """FSDP or DDP in one process on CUDA: nccl and DDP need a device index."""
    cuda = torch.device("cuda")
    assert distributed.Dist(strategy="fsdp").place(cuda) == torch.device("cuda", 0)
    assert distributed.Dist(strategy="ddp").place(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert distributed.Dist().place(cuda) == cuda  # one process, no group: as given
    assert distributed.Dist(strategy="fsdp").place(torch.device("cpu")) == torch.device("cpu")


def test_an_unknown_strategy_is_one_paragraph_with_did_you_mean():
    with pytest.raises(ConfigError) as e:
        distributed.setup(torch.device("cpu"), "fsdb")
    assert str(e.value) == ("trainer.strategy: unknown strategy 'fsdb'. Did you mean 'fsdp'? Use auto (one process, "
                            "or DDP under torchrun), ddp or fsdp.")


# ----------------------------------------------------------------------------------------------------
# Training under FSDP, checkpoints and resume.


def test_fsdp_in_one_process_checkpoints_a_sharded_directory_and_resumes_exactly(tmp_path):
    """A group of one rank (no torchrun: FSDP on one GPU, here on the CPU): the checkpoint is a directory of
    torch.distributed.checkpoint files, rank files and their checksums, and a run stopped by SIGTERM then resumed
    writes what the uninterrupted run writes."""
    base = [*GPT, *FSDP, *STATS, f"data.path={text(tmp_path)}", "data.batch_size=4", "trainer.max_steps=8"]
    train(config(*base, STOP % 10_000), tmp_path / "straight")
    first = train(config(*base, STOP % 3), tmp_path / "cut")
    assert first["status"] == "interrupted" and first["trainer/steps"] == 4  # one rank: it stops at once
    last = tmp_path / "cut" / "checkpoints" / "last"
    sums = json.loads((last / "checksums.json").read_text())
    assert sorted(p.name for p in last.iterdir()) == sorted([".metadata", "__0_0.distcp", "rank0.pt",
                                                            "checksums.json"])
    assert sums["world_size"] == 1 and sums["step"] == 4
    assert sums["files"] == {p.name: [p.stat().st_size, zlib.crc32(p.read_bytes())] for p in last.iterdir()
                             if p.name != "checksums.json"}
    assert not list((tmp_path / "cut" / "checkpoints").glob(".*"))
    resumed = train(config(*base, STOP % 3, "resume=true"), tmp_path / "cut")
    assert resumed["status"] == "finished" and not torch.distributed.is_initialized()
    assert without_timing(tmp_path / "cut" / "metrics.jsonl") == without_timing(tmp_path / "straight" /
                                                                                 "metrics.jsonl")


@pytest.mark.parametrize("policy", ["guard.spike.action=rollback", "guard.nan_policy=rollback"])
def test_rollback_is_refused_under_fsdp_with_the_settings_that_work(tmp_path, policy):
    """A rollback snapshot holds the whole state in host memory, which sharded state is not: refused before any
    step, in one paragraph naming the key that asked for it (nan_policy's was named guard.spike.action) and what
    works under FSDP."""
    with pytest.raises(ConfigError) as e:
        train(config(*GPT, *FSDP, f"data.path={text(tmp_path)}", "data.batch_size=4", "trainer.max_steps=2",
                     "guard.spike.metric=train/loss", policy), tmp_path / "run")
    assert str(e.value) == (
        f"{policy.split('=')[0]}: rollback is not supported under trainer.strategy=fsdp (snapshots of sharded state). "
        "Use guard.spike.action=log and guard.nan_policy=skip_step there, or train with ddp.")
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp_trains_in_mixed_precision(tmp_path, precision):
    """Gathered parameters in bf16/fp16, gradients reduced in float32; fp16's GradScaler on sharded gradients."""
    summary = train(config(*GPT, *FSDP, *STATS, f"data.path={text(tmp_path)}", "data.batch_size=4",
                           "trainer.max_steps=4", f"trainer.precision={precision}"), tmp_path)
    assert summary["status"] == "finished" and summary["trainer/steps"] == 4
    assert 0 < summary["train/loss"] < 10 and 0 < summary["val/loss"] < 10


@pytest.mark.parametrize("damage", ["flip", "no_checksums", "world_size"])
def test_a_damaged_sharded_checkpoint_is_refused_before_anything_is_touched(tmp_path, damage):
    base = [*GPT, *FSDP, *STATS, f"data.path={text(tmp_path)}", "data.batch_size=4", "trainer.checkpoint_every=2"]
    train(config(*base, "trainer.max_steps=4"), tmp_path)
    last = tmp_path / "checkpoints" / "last"
    if damage == "flip":
        shard = last / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        expected = "its file '__0_0.distcp' fails its CRC check: the file is corrupt"
    elif damage == "no_checksums":  # a save cut short before its last file
        (last / "checksums.json").unlink()
        expected = ("it has no checksums.json: it is incomplete (a save was cut short) or not written by hookexp")
    else:
        sums = json.loads((last / "checksums.json").read_text())
        (last / "checksums.json").write_text(json.dumps({**sums, "world_size": 4}))
        expected = ("it was written by 4 ranks and this run has 1; an FSDP checkpoint resumes on the same number of "
                    "ranks (torchrun --nnodes ... --nproc_per_node ... making 4 in all)")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(CheckpointError) as e:
        train(config(*base, "trainer.max_steps=6", "resume=true"), tmp_path)
    assert str(e.value) == (f"resume: cannot resume from {last}: {expected}. The checkpoint before it is "
                            f"{last.with_name('previous')}: resume=true hydra.run.dir=... with "
                            f"resume={last.with_name('previous')} continues from there. Or start again with "
                            "+overwrite=true.")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert not torch.distributed.is_initialized()


def test_a_non_finite_model_is_never_checkpointed_under_fsdp(tmp_path):
    """The finite-state rule holds for the sharded checkpoint: NaN weights from step 3 on never replace step 3's."""
    poison = "+hooks.poison={target:blocks.1,kind:output_grad,transform:{_target_:user_transforms.nan_at,step:3}}"
    summary = train(config(*GPT, *FSDP, *STATS, f"data.path={text(tmp_path)}", "data.batch_size=4", poison,
                           "guard.nan_policy=warn", "trainer.max_steps=6", "trainer.checkpoint_every=1",
                           "trainer.clip_grad_norm=null"), tmp_path)
    assert json.loads((tmp_path / "checkpoints" / "last" / "checksums.json").read_text())["step"] == 3
    assert summary["guard/nonfinite_warnings"] >= 3


def test_a_nan_in_one_ranks_shard_stops_every_rank_not_one(tmp_path):
    """guard.nan_policy=raise: rank 1's shard of head.weight's gradient turns NaN at step 2 (rank 0's stays finite).
    Both ranks stop at step 2 with the error; neither waits forever for the other in the next collective."""
    poison = ("+hooks.poison={target:head.weight,kind:post_accumulate,"
              "transform:{_target_:user_transforms.nan_on_rank,step:2,rank:1}}")
    done = torchrun(["-m", "hookexp", "trainer.progress=false", "logger=none", *GPT, *FSDP, poison,
                     f"data.path={text(tmp_path)}", "data.batch_size=4", "trainer.max_steps=6",
                     f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=180)
    (run,) = done
    assert run.returncode != 0
    assert run.stderr.count("non-finite loss or gradient at step 2") >= 2, run.stderr[-3000:]  # one per rank
    assert "parameters: head.weight (gradient)" in run.stderr  # rank 1 names its bad shard


# ----------------------------------------------------------------------------------------------------
# Two ranks: a 2-node rendezvous on this machine, a multirun of two jobs under it, a resume; against one process.


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """``torchrun --nnodes=2 ... -m hookexp -m`` (two agents, a c10d rendezvous) with two jobs: job 0 trains 10
    steps, job 1 the same but stops by SIGTERM during step 3; then ``torchrun --standalone --nproc_per_node=2 -m
    hookexp resume=true`` continues job 1. One process (the batch of both ranks) trains the same in ``single``."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    args = [*GPT, *FSDP, *CLIP, *STATS, f"data.path={text(tmp)}", "data.batch_size=4", "trainer.max_steps=10"]
    sweep = ["-m", "hookexp", "-m", "trainer.progress=false", "logger=none", *args, STOP % 10_000,
             "hooks.stop.transform.step=10000,3", "hydra.sweep.dir=sweep"]
    nodes = torchrun(sweep, tmp, nodes=2)
    said = [done for done in nodes if "hookexp: interrupted by signal 15 after step 5" in done.stderr]
    assert len(said) == 1, [done.stderr[-3000:] for done in nodes]  # job 1 was interrupted; rank 0 alone says so
    (resume,) = torchrun(["-m", "hookexp", "resume=true", f"hydra.run.dir={tmp / 'sweep' / '1'}"], tmp)
    assert resume.returncode == 0, resume.stderr[-3000:]
    single = [a for a in args if not a.startswith(("trainer.strategy", "trainer.fsdp", "data.batch_size"))]
    train(config(*single, "data.batch_size=8", STOP % 10_000, FORENSICS_ON), tmp / "single")  # the CLI's default
    return tmp


def test_two_fsdp_ranks_train_as_one_process_with_the_same_keys(two_ranks):
    """The acceptance run: an output_grad clamp, a pre_step clip (with the engine change) and the loop's clip on the
    sharded GPT; each rank takes half of each batch, the one process the whole: the same losses and keys."""
    fsdp, single = read_jsonl(two_ranks / "sweep" / "0" / "metrics.jsonl"), read_jsonl(two_ranks / "single" /
                                                                                       "metrics.jsonl")
    assert [sorted(r) for r in fsdp] == [sorted(r) for r in single]
    train_rows = [(a, b) for a, b in zip(fsdp, single, strict=True) if "train/loss" in a]
    assert [a["trainer/step"] for a, _ in train_rows] == [0, 2, 4, 6, 8, 9]
    for a, b in zip(fsdp, single, strict=True):
        for key in [k for k in a if k.startswith(("train/", "val/", "grad/pre_clip_norm"))]:
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
    assert {"hook/clamp/calls", "grad/pre_clip_norm", "val/ppl"} <= {k for r in fsdp for k in r}
    summary = json.loads((two_ranks / "sweep" / "0" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["dist/world_size"] == 2 and summary["dist/strategy"] == "fsdp"
    assert json.loads((two_ranks / "sweep" / "0" / "manifest.json").read_text())["world_size"] == 2


def test_two_fsdp_ranks_log_the_statistics_of_the_unsharded_gradients(two_ranks):
    """Every statistic of the 2-rank FSDP run equals the one process's, step for step: gradients, activations (each
    rank's half of the batch), weights, updates, Adam's moments, the block groups, the histograms."""
    fsdp, single = read_jsonl(two_ranks / "sweep" / "0" / "metrics.jsonl"), read_jsonl(two_ranks / "single" /
                                                                                       "metrics.jsonl")
    keys = [k for k in single[0] if k.startswith("grad/") and k.count("/") == 2]
    assert len(keys) == 7 * 16  # norm, mean, std, min, max, frac_zero, frac_neg of each of the 16 parameters
    families = ("grad/", "act/", "param/", "update/", "opt/")
    assert {k.split("/")[0] for k in single[1] if k.startswith(families)} == {f[:-1] for f in families}
    assert {"grad/group/blocks.0/norm", "param/group/blocks.1/norm", "opt/head.weight/exp_avg_sq_norm",
            "update/blocks.0.mlp.fc.weight/ratio", "act/blocks.1.mlp/std"} <= set(single[1])
    for a, b in zip(fsdp, single, strict=True):
        for key in [k for k in b if k.startswith(families)]:
            # a fraction of elements moves by one element (1/3072 on the attention weights) when a gradient within
            # an ulp of zero changes sign: the two runs add in other orders
            near = 1e-3 if key.endswith(("/frac_neg", "/frac_zero")) else 1e-7
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=near), key
    clip = {"hook/clip/change_norm", "hook/clip/cosine", "hook/clip/frac_changed"} if CLIP else set()
    assert clip <= {k for r in single for k in r}
    for a, b in zip(fsdp, single, strict=True):  # the pre_step clip's effects, of the whole tensors
        for key in [k for k in b if k in clip]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
    hists = [read_jsonl(two_ranks / run / "histograms.jsonl") for run in ("sweep/0", "single")]
    assert len(hists[0]) == len(hists[1]) == 6
    for a, b in zip(*hists, strict=True):
        for key in [k for k in b if k.endswith("/hist")]:
            assert a[key]["values"] == pytest.approx(b[key]["values"], abs=1e-6), key


def test_a_resumed_fsdp_run_writes_what_the_uninterrupted_one_wrote(two_ranks):
    straight, cut = two_ranks / "sweep" / "0", two_ranks / "sweep" / "1"
    assert without_timing(cut / "metrics.jsonl") == without_timing(straight / "metrics.jsonl")
    drop = ("perf/", "runtime_s", "run_dir")
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (straight, cut))
    assert {k: v for k, v in sa.items() if not k.startswith(drop)} == {k: v for k, v in sb.items()
                                                                       if not k.startswith(drop)}
    files = sorted(p.name for p in (cut / "checkpoints" / "last").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "rank0.pt", "rank1.pt"]


# ----------------------------------------------------------------------------------------------------
# SLURM: the environment submitit gives each task, and SLURM's absence.


SLURM_TASK = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
              "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_NODEID": "1", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}


def slurm_task(monkeypatch, **changes: str) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # remembered as it was: what setup() exports is undone after the test
        monkeypatch.delenv(name)
    for name, value in {**SLURM_TASK, **changes}.items():
        monkeypatch.setenv(name, value)


def test_a_task_submitit_started_joins_as_the_rank_slurm_gave_it(monkeypatch):
    """Task 5 of 8 (4 per node, 2 nodes): torchrun's variables from SLURM's, the master the first node of the list;
    every task of the job draws the same port; setup() then joins the group as rank 5 of 8."""
    slurm_task(monkeypatch)
    values = launchers.slurm_environment()
    port = values.pop("MASTER_PORT")
    assert values == {"MASTER_ADDR": "gpu03", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                      "LOCAL_WORLD_SIZE": "4"}
    slurm_task(monkeypatch, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    assert launchers.slurm_environment()["MASTER_PORT"] == port and 20000 <= int(port) <= 60000
    slurm_task(monkeypatch, MASTER_PORT="29999")
    assert "MASTER_PORT" not in launchers.slurm_environment()  # the user's own stays

    joined = {}  # what the group would be made from (there is no gpu03 to meet here)
    monkeypatch.setattr(distributed, "join_group", lambda backend: joined.update(backend=backend, **{
        k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}))
    ranks = distributed.setup(torch.device("cpu"), "fsdp")
    assert (ranks.rank, ranks.world_size, ranks.local_rank, ranks.strategy) == (5, 8, 1, "fsdp")
    assert joined == {"backend": "gloo", "RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "gpu03", "MASTER_PORT": "29999"}


@pytest.mark.parametrize("changes", [{"SLURM_NTASKS": "1"}, {"SUBMITIT_EXECUTOR": "local"}, {"WORLD_SIZE": "2"}])
def test_one_task_another_executor_or_torchrun_itself_leave_the_environment_alone(monkeypatch, changes):
    slurm_task(monkeypatch, **changes)
    assert launchers.slurm_environment() == {}


def test_the_slurm_launcher_without_slurm_is_one_paragraph(tmp_path):
    done = run_cli(["-m", "hydra/launcher=slurm", "logger=none", "seed=0,1", "hydra.sweep.dir=sweep"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "hookexp: error: hydra/launcher: the SLURM launcher submits every job with sbatch and starts its tasks with "
        "srun, and this machine has no sbatch and no srun on its PATH: it is not a SLURM cluster's login node. Run "
        "the command on a login node of the cluster (with the same hookexp installed, pip install -e '.[sweeps]'), or "
        "launch here without SLURM: drop hydra/launcher=slurm (the jobs run one after another), or use "
        "hydra/launcher=joblib hydra.launcher.n_jobs=N to run N jobs at once on this machine.")
    assert not (tmp_path / "sweep").exists()


def test_the_slurm_launcher_starts_one_task_per_gpu():
    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=2",
                                           "hydra.launcher.gpus_per_node=8"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node) == (2, 8, 8)


def test_a_misspelt_fsdp_key_is_one_paragraph_with_did_you_mean():
    from hookexp.cli import check_config

    with pytest.raises(ConfigError) as e:
        check_config(config("+trainer.fsdp.wrapp=blocks.?"))
    assert str(e.value) == ("trainer.fsdp.wrapp: unknown key. Did you mean 'wrap'? trainer.fsdp has: wrap, "
                            "reshard_after_forward.")


def test_the_default_wrap_on_a_model_without_blocks_names_its_fix(tmp_path):
    """trainer.fsdp.wrap's default (@blocks) on the small CNN, which has no blocks: one paragraph naming the key,
    why, and the two ways on (a pattern, or null for one unit); no process group left behind."""
    with pytest.raises(ConfigError) as e:
        train(config(*FSDP, "trainer.max_steps=1"), tmp_path)
    assert e.value.key == "trainer.fsdp.wrap" and str(e.value).startswith(
        "trainer.fsdp.wrap: target '@blocks': '@blocks' has no meaning for SmallCNN")
    assert str(e.value).endswith("Set trainer.fsdp.wrap to a pattern of this model's modules, or "
                                 "trainer.fsdp.wrap=null to shard the whole model as one unit.")
    assert not torch.distributed.is_initialized()
    train(config(*FSDP, "trainer.fsdp.wrap=null", "trainer.max_steps=1"), tmp_path / "root")  # the fix works
