"""Every observer under ``torch.compile``, counted with Dynamo's own counters (no clock): a compiled run with the
shipped gradient statistics, the activation statistics, the noise scale, the spike recorder, the guard and a hook
spec of each kind that compiles, and forensics (on by default), across log steps, validation and a checkpoint, with
two micro-batches a step, breaks no graph, recompiles no frame because of hookexp's code, and logs what the eager run
logs; the same on a model whose own forward Dynamo compiles, its hooks outside. What cannot compile is counted in the
slow test at the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FORENSICS_ON, config

import hookexp
from hookexp.run.loop import run_job as train
from hookexp.telemetry import stats

PACKAGE = str(Path(hookexp.__file__).resolve().parent)
# kind -> (target, transform, args, schedule): one spec of each kind that compiles; the schedules switch specs on
# and off across steps, which the compiled graph reads at run time, not as a guard
COMPILED_KINDS = {
    "forward_pre": ("conv2", "scale", "{factor:0.5}", "start_step:2"),
    "forward": ("fc1", "clamp", "{min:-0.1,max:0.1}", "every:2"),
    "output_grad": ("relu1", "scale", "{factor:2.0}", "end_step:5"),
    "grad": ("conv1.weight", "clamp", "{min:-1.0,max:1.0}", "every:1"),
    "post_accumulate": ("fc1.weight", "scale", "{factor:1.0}", "every:1"),
    "pre_step": ("fc2.weight", "clamp", "{min:-1.0,max:1.0}", "every:1"),
}
RUN = (FORENSICS_ON, "trainer.max_steps=7", "stats.every=3", "trainer.eval_every=4", "trainer.checkpoint_every=4",
       "stats.gns=true", "trainer.accumulate=2", "guard.spike.metric=train/loss", "stats.activations=relu*",
       "stats.hist_bins=8", "stats.compile=true")  # the statistics' own kernel compiled, as on CUDA by default


def specs(kinds: dict[str, tuple[str, str, str, str]]) -> list[str]:
    return [f"+hooks.h_{kind}={{target:{t},kind:{kind},transform:{tr},args:{a},{when}}}"
            for kind, (t, tr, a, when) in kinds.items()]


def ours(text: str) -> bool:
    """A guard or break that names hookexp's own source (the model's code in workloads/models.py is the user's)."""
    return PACKAGE in text and f"{PACKAGE}/workloads/models.py" not in text


def rows(run: Path, file: str = "metrics.jsonl") -> list[dict]:
    """The logged rows without their timings."""
    lines = (run / file).read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")} for line in lines]


def test_a_compiled_run_with_every_observer_breaks_no_graph_recompiles_nothing_and_logs_what_eager_logs(tmp_path):
    import torch._dynamo
    from torch._dynamo.utils import counters, guard_failures, orig_code_map

    eager = train(config(*RUN, *specs(COMPILED_KINDS)), tmp_path / "eager")
    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    calls = stats.ROW_KERNEL.calls
    summary = train(config("trainer.compile=true", "trainer.compile_backend=eager", *RUN, *specs(COMPILED_KINDS)),
                    tmp_path / "run")
    assert summary["status"] == "finished" and summary["trainer/steps"] == 7
    assert sum(counters["graph_break"].values()) == 0, list(counters["graph_break"])
    assert sum(counters["unimplemented"].values()) == 0, list(counters["unimplemented"])
    frames = sorted({(code.co_filename, code.co_name) for code in orig_code_map.values.values()})  # -> original code
    # the one function of hookexp's that is compiled is the statistics' kernel (stats.compile), once
    assert [(Path(f).name, name) for f, name in frames if ours(f)] == [("stats.py", "_rows")], frames
    reasons = [r for failures in guard_failures.values() for r in failures]
    assert [r for r in map(str, reasons) if ours(r)] == []
    # what does recompile is torch's: validation's no_grad (the epoch's last, smaller batch is not reached here)
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 2  # the model's (fullgraph ones not counted)
    assert stats.ROW_KERNEL.failed is None and stats.ROW_KERNEL.calls > calls  # the statistics' kernel ran
    assert [str(r) for r in reasons] == ["0/0: GLOBAL_STATE changed: grad_mode "]

    # the same numbers as eager, exactly (the eager backend runs the same kernels): losses, gradient and activation
    # statistics, the noise scale, and what each hook did, on each log step and validation
    logged, expected = rows(tmp_path / "run"), rows(tmp_path / "eager")
    assert [r["trainer/step"] for r in logged] == [0, 3, 3, 6, 6]
    assert logged == expected
    first = logged[0]
    assert {"act/relu1/mean", "act/relu3/frac_zero", "gns/b_simple", "grad/global_norm"} <= set(first)
    histograms = rows(tmp_path / "run", "histograms.jsonl")
    assert histograms == rows(tmp_path / "eager", "histograms.jsonl")
    assert [h["trainer/step"] for h in histograms] == [0, 3, 6] and "act/relu2/hist" in histograms[0]
    # the schedules acted: a spec acts on its steps only, and the calls say so (2 micro-batches a step)
    assert {kind: summary[f"hook/h_{kind}/calls"] for kind in COMPILED_KINDS} == {
        kind: eager[f"hook/h_{kind}/calls"] for kind in COMPILED_KINDS} == {
        "forward_pre": 10, "forward": 8, "output_grad": 10, "grad": 14, "post_accumulate": 14, "pre_step": 7}
    assert first["hook/h_forward/frac_changed"] > 0 and first["hook/h_output_grad/change_norm"] > 0
    assert "hook/h_forward_pre/change_norm" not in first and logged[1]["hook/h_forward_pre/change_norm"] > 0


def test_a_users_model_compiled_recompiles_for_no_micro_batch_of_hookexps_hooks(tmp_path):
    """A user's model (tests/helpers/user_models.py): torch.compile compiles its own forward and runs the model's
    hooks outside it (forensics' end of a forward is a frame of its own). Each micro-batch meets the same state of
    hookexp's hooks, so no guard on it fails: before, each of trainer.accumulate's micro-batches recompiled, and past
    torch's recompile limit (8) the model ran eagerly."""
    import torch._dynamo
    from torch._dynamo.utils import counters, guard_failures

    common = (FORENSICS_ON, "model._target_=user_models.Net", "trainer.max_steps=2", "stats.every=1",
              "trainer.accumulate=3", "data.batch_size=16", "guard.spike.metric=train/loss", "stats.gns=true",
              "stats.activations=blocks.*")
    train(config(*common), tmp_path / "eager", list(common))
    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    compiled = (*common, "trainer.compile=true", "trainer.compile_backend=eager")
    train(config(*compiled), tmp_path / "run", list(compiled))
    reasons = [str(r) for failures in guard_failures.values() for r in failures]
    assert [r for r in reasons if PACKAGE in r] == []
    assert sum(counters["graph_break"].values()) == 0
    assert rows(tmp_path / "run") == rows(tmp_path / "eager")


def test_under_ddp_a_sequential_model_is_compiled_not_run_eagerly(tmp_path):
    """trainer.strategy=ddp (a group of one here; torchrun's ranks alike) with trainer.compile: small_cnn is an
    nn.Sequential, whose forward, called from DDP's, is no frame Dynamo compiles. It is compiled before DDP wraps it:
    one graph (and validation's), no graph break, eager's values; before, Dynamo captured nothing of it (or, with
    forensics or activation statistics on, each hooked module as a graph of its own)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    common = (FORENSICS_ON, "trainer.strategy=ddp", "trainer.max_steps=2", "stats.every=1", "trainer.accumulate=2",
              "stats.activations=relu*")
    train(config(*common), tmp_path / "eager")
    torch._dynamo.reset()
    counters.clear()
    train(config(*common, "trainer.compile=true", "trainer.compile_backend=eager"), tmp_path / "run")
    assert counters["stats"]["unique_graphs"] == 2 and counters["stats"]["calls_captured"] > 0
    assert sum(counters["graph_break"].values()) == 0
    assert rows(tmp_path / "run") == rows(tmp_path / "eager")


@pytest.mark.slow  # a limit that stays, counted; ./scripts/test.sh -m slow
@pytest.mark.parametrize(("setting", "breaks"), [
    # the autograd Node of a module's output exists only eagerly; the module backward kinds need compiled autograd
    ("+hooks.n={target:conv1,kind:node,transform:scale,args:{factor:1.0}}", True),
    ("+hooks.n={target:conv1,kind:node_pre,transform:scale,args:{factor:1.0}}", True),
    ("+hooks.b={target:fc1,kind:backward,transform:scale,args:{factor:1.0}}", True),
    # a forward-side transform that reads the context (the step, its state) runs eagerly
    ("+hooks.r={target:conv1,kind:forward,transform:noise,args:{std:0.1}}", True),
    # a transform that traces stays in the graph
    ("+hooks.f={target:conv1,kind:forward,transform:scale,args:{factor:1.0}}", False),
])
def test_what_cannot_trace_breaks_the_graph_under_compile(tmp_path, setting, breaks):
    """The kinds and transforms that run eagerly under compile (docs/training.md): a graph break at each hooked
    module. Counted here so that the day they trace, this test says so."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    train(config("trainer.compile=true", "trainer.compile_backend=eager", "trainer.max_steps=3", setting),
          tmp_path / "run")
    assert (sum(counters["graph_break"].values()) > 0) is breaks


def test_a_second_compiled_run_in_the_process_runs_its_own_hooks(tmp_path):
    """A sweep runs its jobs in one process: the second job's model (the same class, other hooks) must not run the
    first job's compiled graph, which Dynamo's guards would let it (its hooks then never run)."""
    common = ("trainer.compile=true", "trainer.compile_backend=eager", "trainer.max_steps=2",
              "guard.forensics.window=0")
    train(config(*common), tmp_path / "first")
    second = train(config(*common, "hooks=clamp_conv"), tmp_path / "second")
    assert second["hook/clamp_conv/calls"] == 4  # output_grad on conv1 and conv2, two steps


def test_a_transform_that_fails_while_dynamo_traces_gets_a_paragraph_naming_the_setting(tmp_path):
    """A forward transform that cannot run on its target fails inside Dynamo's tracing, as torch's compile error:
    the run says so in a paragraph that names trainer.compile and the way to the failing spec, no raw traceback."""
    from hookexp.engine.registry import TRANSFORMS, register_transform
    from hookexp.errors import ConfigError

    register_transform("wrong_width", needs_ctx=False)(lambda x, ctx=None: x @ torch.ones(x.shape[-1] + 1, 3))
    try:
        with pytest.raises(ConfigError) as e:
            train(config("trainer.compile=true", "trainer.compile_backend=eager", "trainer.max_steps=1",
                         "+hooks.w={target:fc1,kind:forward,transform:wrong_width}"), tmp_path / "run")
    finally:
        TRANSFORMS.pop("wrong_width", None)
    text = str(e.value)
    assert text.startswith("trainer.compile: torch.compile failed on the model and its hooks (RuntimeError: a and b "
                           "must have same reduction dim")
    assert "run once with trainer.compile=false, and hookexp names the spec and the target" in text
    assert "\n" not in text


@pytest.mark.parametrize("deterministic", [False, True])
def test_compiling_a_pool_with_inductor_on_the_cpu_warns_of_torchs_zero_gradients(caplog, deterministic):
    """torch 2.13's inductor zeroes the gradients behind a MaxPool2d at some batch sizes on a CPU (docs/training.md):
    a compiled run that could meet it says so, with the settings that avoid it; deterministic algorithms do."""
    from omegaconf import OmegaConf

    from hookexp.run.distributed import Dist, wrap

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.MaxPool2d(2))
    trainer = OmegaConf.create({"compile": True, "compile_backend": "inductor"})
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with caplog.at_level("WARNING", logger="hookexp"):
            wrap(model, trainer, Dist(), torch.device("cpu"))  # compiles nothing until called
    finally:
        torch.use_deterministic_algorithms(before)
    warned = [r.getMessage() for r in caplog.records if "MaxPool2d" in r.getMessage()]
    assert len(warned) == (0 if deterministic or torch.__version__ < (2, 13) else 1)
    if warned:
        assert "Set repro.deterministic=true, or trainer.compile_backend=aot_eager." in warned[0]
