"""Every observer under ``torch.compile``, counted with Dynamo's own counters (no clock): a compiled run with the
shipped gradient statistics, the noise scale, the spike recorder, the guard and a hook spec of each kind that
compiles without a graph break, across log steps, validation and a checkpoint, breaks no graph and recompiles
no frame because of hookexp's code. Forensics (on by default) is left out here: ``guard.forensics.window=0``."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import config

import hookexp
from hookexp.run.loop import run_job as train

PACKAGE = str(Path(hookexp.__file__).resolve().parent)
# the kinds whose hooks Dynamo never traces: they run in the autograd engine or the optimizer, outside the graph
COMPILED_KINDS = {
    "grad": ("conv1.weight", "clamp", "{min:-1.0,max:1.0}"),
    "post_accumulate": ("fc1.weight", "scale", "{factor:1.0}"),
    "pre_step": ("fc2.weight", "clamp", "{min:-1.0,max:1.0}"),
}


def specs() -> list[str]:
    return [f"+hooks.h_{kind}={{target:{t},kind:{kind},transform:{tr},args:{a}}}"
            for kind, (t, tr, a) in COMPILED_KINDS.items()]


def ours(text: str) -> bool:
    """A guard or break that names hookexp's own source (the model's code in workloads/models.py is the user's)."""
    return PACKAGE in text and f"{PACKAGE}/workloads/models.py" not in text


def test_a_compiled_run_with_every_observer_breaks_no_graph_and_recompiles_nothing_of_hookexp(tmp_path):
    import torch._dynamo
    from torch._dynamo.utils import counters, guard_failures, orig_code_map

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    summary = train(config("trainer.compile=true", "trainer.compile_backend=eager", "trainer.max_steps=7",
                           "stats.every=3", "trainer.eval_every=4", "trainer.checkpoint_every=4",
                           "stats.gns=true", "trainer.accumulate=2", "guard.spike.metric=train/loss",
                           "guard.forensics.window=0", *specs()), tmp_path / "run")
    assert summary["status"] == "finished" and summary["trainer/steps"] == 7
    assert all(summary[f"hook/h_{kind}/calls"] > 0 for kind in COMPILED_KINDS)
    assert "gns/global/noise_scale" in summary or any(k.startswith("gns/") for k in summary)
    assert sum(counters["graph_break"].values()) == 0, list(counters["graph_break"])
    assert sum(counters["unimplemented"].values()) == 0, list(counters["unimplemented"])
    frames = sorted({code.co_filename for code in orig_code_map.values.values()})  # compiled -> original code
    assert [f for f in frames if ours(f)] == [], "Dynamo compiled a frame of hookexp's own code"
    reasons = [r for failures in guard_failures.values() for r in failures]
    assert [r for r in map(str, reasons) if ours(r)] == []
    # what does recompile is torch's: validation's no_grad, and the epoch's last, smaller batch
    assert counters["frames"]["ok"] == counters["frames"]["total"] > 0


@pytest.mark.slow  # a limit that stays, counted; ./scripts/test.sh -m slow
@pytest.mark.parametrize("setting", ["stats.activations=relu*", "+hooks.f={target:conv1,kind:forward,"
                                     "transform:scale,args:{factor:1.0}}"])
def test_forward_side_observers_still_break_the_graph_under_compile(tmp_path, setting):
    """The activation probes and the forward-side kinds run eagerly under compile (docs/training.md): a graph
    break at each hooked module. Counted here so that the day they trace, this test says so."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    train(config("trainer.compile=true", "trainer.compile_backend=eager", "trainer.max_steps=3",
                 "guard.forensics.window=0", setting), tmp_path / "run")
    assert sum(counters["graph_break"].values()) > 0
