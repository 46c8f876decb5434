"""What ``attach()`` with its defaults costs in a hand-written training loop, as ratios against the same hooks
written by hand with plain torch, measured in the same process.

    .venv/bin/python benchmarks/attach_overhead.py                  # ~2 min on 2 cores
    .venv/bin/python benchmarks/attach_overhead.py --repeats 80 --depth 32

Cases (each a full training step: forward, backward, optimizer.step() of an MLP of ``--depth`` Linear layers
with a ReLU between them; batch 32, width 64):
  forward   an identity ``forward`` spec on every Linear and ReLU (``target: "*"``, 2 * depth - 1 hooks)
            against ``register_forward_hook(lambda m, args, out: out)`` on the same modules
  pre_step  a ``pre_step`` clamp on every parameter against ``torch._foreach_clamp_min_``/``_max_`` on the
            gradients between backward and ``optimizer.step()``; also with ``measure=10`` (effects measured
            on every 10th step, as the trainer's default log steps), beside the default (``"read"``: step 0
            and the step after each ``stats()`` read, none here)
  (and each hand loop against the loop without hooks, for scale)
Every repeat times the two cases of each ratio in adjacent blocks of ``--steps`` steps (alternating which
goes first); a ratio is the median over repeats of those block ratios, with the quartiles beside it, so
that a machine that is slower for a while slows both sides. ``attach`` gets the optimizer, so its step
follows ``optimizer.step()``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from hookexp import attach
from hookexp.workloads.models import MLP

CLAMP = (-1e-3, 1e-3)


def make(depth: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = MLP(in_channels=1, image_size=8, num_classes=10, depth=depth, width=64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return model, opt, torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))


def layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.ReLU))]


def step_fn(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
            between: Callable[[], None] | None = None) -> Callable[[], None]:
    loss_fn = nn.functional.cross_entropy

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        if between is not None:
            between()
        opt.step()

    return step


def hand_forward(out_of: tuple) -> Callable[[], None]:
    model, opt, x, y = out_of
    for m in layers(model):
        m.register_forward_hook(lambda module, args, out: out)
    return step_fn(model, opt, x, y)


def hook_forward(out_of: tuple) -> Callable[[], None]:
    model, opt, x, y = out_of
    attach(model, {"id": {"target": "*", "types": ["Linear", "ReLU"], "kind": "forward"}}, opt)
    return step_fn(model, opt, x, y)


def hand_clamp(out_of: tuple) -> Callable[[], None]:
    model, opt, x, y = out_of
    params = list(model.parameters())

    def clamp() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_clamp_min_(grads, CLAMP[0])
        torch._foreach_clamp_max_(grads, CLAMP[1])

    return step_fn(model, opt, x, y, clamp)


def hook_clamp(out_of: tuple, **attach_args: object) -> Callable[[], None]:
    model, opt, x, y = out_of
    attach(model, {"c": {"target": "*", "kind": "pre_step", "transform": "clamp",
                         "args": {"min": CLAMP[0], "max": CLAMP[1]}}}, opt, **attach_args)
    return step_fn(model, opt, x, y)


def bare(out_of: tuple) -> Callable[[], None]:
    return step_fn(*out_of)


CASES = {"none": bare, "hand_forward": hand_forward, "hook_forward": hook_forward, "hand_clamp": hand_clamp,
         "hook_clamp": hook_clamp, "hook_clamp_m10": lambda out_of: hook_clamp(out_of, measure=10)}
RATIOS = [("forward: attach / hand", "hook_forward", "hand_forward"),
          ("pre_step clamp: attach / hand _foreach_clamp_", "hook_clamp", "hand_clamp"),
          ("pre_step clamp, measure=10: attach / hand", "hook_clamp_m10", "hand_clamp"),
          ("hand forward hooks / no hooks", "hand_forward", "none"),
          ("hand clamp / no hooks", "hand_clamp", "none")]


def timed(step: Callable[[], None], steps: int) -> float:
    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: least noise on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = {name: make_case(make(args.depth)) for name, make_case in CASES.items()}
    for step in steps.values():  # warm-up: allocator, first measured step, lazy torch set-up
        timed(step, 20)
    ratios: dict[str, list[float]] = {label: [] for label, _, _ in RATIOS}
    per_step: dict[str, list[float]] = {name: [] for name in CASES}
    rng = random.Random(0)
    for r in range(args.repeats):
        pairs = list(RATIOS)
        rng.shuffle(pairs)
        for label, a, b in pairs:  # the two cases of a ratio in adjacent blocks, in alternating order
            t = {n: timed(steps[n], args.steps) for n in ((a, b) if r % 2 else (b, a))}
            ratios[label].append(t[a] / t[b])
            for n, v in t.items():
                per_step[n].append(v)
    print(f"MLP depth {args.depth} (width 64, batch 32; {2 * args.depth - 1} forward hooks, "
          f"{2 * args.depth} parameters), {args.repeats} repeats of {args.steps}-step blocks, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"{'ratio':<48} {'median':>7} {'q1':>7} {'q3':>7}")
    for label, r in ratios.items():
        q1, _, q3 = statistics.quantiles(r, n=4)
        print(f"{label:<48} {statistics.median(r):7.3f} {q1:7.3f} {q3:7.3f}")
    print("ms/step (median): " + ", ".join(f"{n} {statistics.median(t) * 1e3:.3f}" for n, t in per_step.items()))


if __name__ == "__main__":
    main()
