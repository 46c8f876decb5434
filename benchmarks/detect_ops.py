"""Aten ops a training step adds for first-divergence forensics, the spike recorder and the non-finite guard.

Counted with a TorchDispatchMode over a hand-written loop (forward, backward, SGD step), with and without each
observer, after a warm-up (the buffer's layout is fixed at the first step): the marginal ops per step. Counts
are deterministic: no timing. ``--compile`` also trains each model compiled with forensics on and off and prints
dynamo's graph-break and recompile counters and the time ratio.

    .venv/bin/python benchmarks/detect_ops.py                 # ~20 s on a CPU
    .venv/bin/python benchmarks/detect_ops.py --compile       # + the compiled runs (~2 min)
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hookexp.config import ForensicsConfig, SpikeConfig
from hookexp.telemetry.forensics import Forensics
from hookexp.telemetry.guard import NonFiniteGuard
from hookexp.telemetry.observer import Observer, Observers
from hookexp.telemetry.spike import SpikeRecorder
from hookexp.workloads.models import GPT, SmallCNN


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def workload(name: str) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """A model and one step's loss (a fixed batch)."""
    torch.manual_seed(0)
    if name == "small_cnn":
        model: nn.Module = SmallCNN()
        x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
        return model, lambda m: nn.functional.cross_entropy(m(x), y)
    model = GPT(vocab_size=64, block_size=32, n_layer=2, n_head=4, d_model=64)
    ids = torch.randint(0, 64, (8, 32))
    return model, lambda m: nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def observers_of(case: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Observer]:
    if case == "none":
        return {}
    if case == "forensics":
        return {"forensics": Forensics(model, opt, ForensicsConfig())}
    if case == "spike":  # the gradients' norm judged every step
        return {"spike": SpikeRecorder(SpikeConfig(metric="grad/global_norm"), model)}
    if case == "guard":
        return {"guard": NonFiniteGuard("raise", model)}
    raise ValueError(case)


def ops_per_step(name: str, case: str, steps: int = 5, warmup: int = 3) -> tuple[float, Counter[str]]:
    model, loss_of = workload(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    observers = Observers(observers_of(case, model, opt), opt)
    counter = CountOps()
    for step in range(warmup + steps):
        if step == warmup:
            counter.__enter__()
        observers.start(step, False)
        loss = loss_of(model)
        loss.backward()
        observers.allow_update(loss, step)
        opt.step()
        opt.zero_grad()
        observers.end(step)
    counter.__exit__(None, None, None)
    observers.close()
    return sum(counter.ops.values()) / steps, counter.ops


def compiled_run(name: str, forensics: bool, steps: int = 40) -> tuple[float, dict[str, int]]:
    """Seconds for ``steps`` compiled steps (after two to compile) and dynamo's counters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, loss_of = workload(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    observers = Observers({"forensics": Forensics(model, opt, ForensicsConfig())} if forensics else {}, opt)
    compiled = torch.compile(model)
    for step in range(steps + 2):
        if step == 2:
            started = time.perf_counter()
        observers.start(step, False)
        loss_of(compiled).backward()
        opt.step()
        opt.zero_grad()
        observers.end(step)
    seconds = time.perf_counter() - started
    observers.close()
    return seconds, {"graph_breaks": sum(counters["graph_break"].values()),
                     "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
                     "frames": counters["stats"]["unique_graphs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small_cnn,gpt")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    print("| model | forensics | spike recorder (grad/global_norm) | guard (raise) | step without |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        base, _ = ops_per_step(name, "none")
        extra = {case: ops_per_step(name, case)[0] - base for case in ("forensics", "spike", "guard")}
        print(f"| {name} | {extra['forensics']:g} | {extra['spike']:g} | {extra['guard']:g} | {base:g} |")
    if args.compile:
        for name in args.models.split(","):
            off, _ = compiled_run(name, False)
            on, counts = compiled_run(name, True)
            print(f"{name} compiled: {on:.2f} s with forensics, {off:.2f} s without: x{on / off:.2f}; {counts}")


if __name__ == "__main__":
    main()
