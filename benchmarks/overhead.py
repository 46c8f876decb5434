"""Step-time overhead of hookexp, as ratios against a hand-written loop measured in the same process.

    .venv/bin/python benchmarks/overhead.py                 # all models, 5 repeats
    .venv/bin/python benchmarks/overhead.py --models small_cnn --repeats 3 --steps 60
    .venv/bin/python benchmarks/overhead.py --models small_cnn --cases a,b,c,d   # a subset of the cases
    python benchmarks/overhead.py --device cuda              # on a GPU machine

Cases, interleaved in every repeat in a shuffled order (each case's time is the mean step time over ``--steps``):
  a  hand-written minimal loop (same DataLoader, model, optimizer)
  b  the hookexp trainer, no hooks, statistics off (local files; W&B's service process competes for
     the 2 cores after wandb.init and would confound the comparison with the hand loop)
  c  the trainer, statistics every step: every gradient statistic of every parameter with 32-bin
     histograms, the global norm, and activation statistics (mean, std, fraction zero, 32-bin
     histogram) of the model's activation layers (ReLUs; the transformer's encoder layers);
     histograms count up to stats.hist_sample (default 4,096) elements per tensor
  c_g   c without the activation statistics (what wandb.watch(log="gradients") describes, and more)
  c_x   c with exact histograms (stats.hist_sample=null: every element counted)
  d  the same statistics every 10 steps
  c_wb  c with the W&B offline run as well (its logging runs on hookexp's worker thread)
  e  the hand loop with wandb.watch(model, log="gradients", log_freq=1), offline, logging the loss
  f  the same with log_freq=10
  g  clamp every parameter's gradient: hookexp `grad` kind (g_grad), `pre_step` kind (g_pre), and a
     hand-written per-parameter register_hook loop (g_hand), all in the hand loop
Trainer times are its training-loop time (summary perf/train_loop_s: steps only, no build, no eval).
Runs are long enough (--steps, default 300) that per-run costs (the first step's allocations, the
first and last log) stay under 1% of a case. A warm-up pass of every case (--warmup-steps, discarded)
first loads what a process loads once (numba's kernels, W&B, torch's own lazy set-up).

Each ratio is the median over repeats of that repeat's own ratio (x and y measured minutes apart in the
same repeat, so a machine that is slower for a while slows both), and the second table gives the lowest
and highest of those per-repeat ratios: how far one run of the benchmark can be trusted on this machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module

from hookexp import attach
from hookexp.run.loop import build_run, train

MODELS = {  # config overrides, and the activation layers that case c describes
    "small_cnn": (["model=small_cnn"], "relu*"),
    "deep_mlp": (["model=mlp", "model.depth=32", "model.width=64", "model.norm=layer", "optim=adamw"], "relu*"),
    "transformer": (["model=transformer", "optim=adamw"], "layers.?"),
}
CLAMP = {"min": -1e-3, "max": 1e-3}


def compose_cfg(overrides: list[str]):
    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        return compose("config", overrides=["trainer.progress=false", "logger=none", *overrides])


def hand_loop(model_overrides: list[str], steps: int, setup: Callable | None = None, wandb_freq: int = 0) -> float:
    """Seconds per step of a minimal loop; ``setup(model, opt)`` attaches hooks; ``wandb_freq`` watches."""
    cfg = compose_cfg(model_overrides)
    run = build_run(cfg)
    model, opt = run.model, run.optimizer
    cleanup = setup(model, opt) if setup else None
    wb = None
    if wandb_freq:
        import wandb

        wb = wandb.init(mode="offline", dir=tempfile.mkdtemp(), project="bench", reinit="finish_previous",
                        settings=wandb.Settings(silent=True))
        wb.watch(model, log="gradients", log_freq=wandb_freq)
    done = 0
    start = time.perf_counter()
    while done < steps:
        for x, y in run.train_loader:
            x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if wb is not None:
                wb.log({"train/loss": loss.item()})
            done += 1
            if done == steps:
                break
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)  # the trainer's last step logs, which waits for the device too
    elapsed = time.perf_counter() - start
    if wb is not None:
        wb.finish()
    if cleanup is not None:
        cleanup()
    return elapsed / steps


def trainer_loop(model_overrides: list[str], steps: int, extra: list[str]) -> float:
    cfg = compose_cfg([*model_overrides, f"trainer.max_steps={steps}", "trainer.epochs=1000", *extra])
    with tempfile.TemporaryDirectory() as tmp:
        summary = train(cfg, Path(tmp))
    return summary["perf/train_loop_s"] / steps


def clamp_via(kind: str) -> Callable:
    def setup(model, opt):
        handle = attach(model, {"c": {"target": "*", "kind": kind, "transform": "clamp", "args": CLAMP}}, opt,
                        measure=False)
        return handle.remove

    return setup


def clamp_by_hand(model, opt):
    handles = [p.register_hook(lambda g: g.clamp(min=CLAMP["min"], max=CLAMP["max"])) for p in model.parameters()]
    return lambda: [h.remove() for h in handles]


STATS_OFF = ["stats.grads=null", "stats.every=1000000000"]


def stats_all(activations: str) -> list[str]:
    """Case c's statistics: every gradient statistic and the activation statistics of ``activations``, each
    with a 32-bin histogram."""
    return ["stats.grads=*", f"stats.activations={activations}", "stats.hist_bins=32"]


def cases(model: list[str], activations: str, steps: int) -> dict[str, Callable[[], float]]:
    every_stat = stats_all(activations)
    fns: dict[str, Callable[[int], float]] = {
        "a": lambda n: hand_loop(model, n),
        "b": lambda n: trainer_loop(model, n, STATS_OFF),
        "c": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=1"]),
        "c_g": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=1", "stats.activations=null"]),
        "c_x": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=1", "stats.hist_sample=null"]),
        "d": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=10"]),
        "c_wb": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=1", "logger=wandb"]),
        "e": lambda n: hand_loop(model, n, wandb_freq=1),
        "f": lambda n: hand_loop(model, n, wandb_freq=10),
        "g_grad": lambda n: hand_loop(model, n, clamp_via("grad")),
        "g_pre": lambda n: hand_loop(model, n, clamp_via("pre_step")),
        "g_hand": lambda n: hand_loop(model, n, clamp_by_hand),
    }
    return {name: (lambda fn=fn: fn(steps)) for name, fn in fns.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="trainer.device for every case: cpu, cuda, ...")
    parser.add_argument("--cases", default="", help="only these cases (e.g. a,b,c): the table keeps the ratios "
                        "it can compute")
    parser.add_argument("--warmup-steps", type=int, default=30, help="steps of each case's discarded warm-up run "
                        "(0: none)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order of the cases in each repeat")
    args = parser.parse_args()
    import logging
    import os

    logging.disable(logging.WARNING)
    os.environ.setdefault("WANDB_SILENT", "true")  # case c_wb's run would print its summary into the table's output
    names = args.models.split(",")
    wanted = args.cases.split(",") if args.cases else None

    def selected(m: str, steps: int) -> dict[str, Callable[[], float]]:
        overrides, activations = MODELS[m]
        every = cases([*overrides, f"trainer.device={args.device}"], activations, steps)
        return {case: fn for case, fn in every.items() if wanted is None or case in wanted}

    if args.warmup_steps:
        for m in names:
            for fn in selected(m, args.warmup_steps).values():
                fn()
        print("warm-up done", file=sys.stderr, flush=True)
    order = random.Random(args.seed)
    times: dict[str, dict[str, list[float]]] = {m: {} for m in names}
    for r in range(args.repeats):
        for m in names:
            todo = list(selected(m, args.steps).items())
            order.shuffle(todo)
            for case, fn in todo:
                times[m].setdefault(case, []).append(fn())
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    from hookexp import fused

    kernels = "numba's fused kernels" if fused.usable(torch.device(args.device).type) else "torch ops"
    print(f"\ntorch {torch.__version__}, {args.device} ({where}), {args.steps} steps x {args.repeats} repeats "
          f"(median of the per-repeat ratios); statistics computed by {kernels}\n")
    ratios = [("b", "a"), ("c", "b"), ("c_g", "b"), ("c_x", "b"), ("d", "b"), ("c_wb", "b"), ("e", "a"), ("f", "a"),
              ("e", "c"), ("e", "c_wb"), ("g_grad", "a"), ("g_pre", "a"), ("g_hand", "a"), ("g_pre", "g_hand")]
    ran = set(times[names[0]])
    ratios = [(x, y) for x, y in ratios if x in ran and y in ran]
    header = ["model", *(["a ms/step"] if "a" in ran else []), *(f"{x}/{y}" for x, y in ratios)]

    def per_repeat(m: str, x: str, y: str) -> list[float]:
        return [tx / ty for tx, ty in zip(times[m][x], times[m][y], strict=True)]

    def table(cell: Callable[[list[float]], str]) -> None:
        """One row per model; ``cell`` sums up a list of values: the hand loop's ms/step over the repeats, and
        each ratio's per-repeat values."""
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for m in names:
            a_ms = [cell([t * 1e3 for t in times[m]["a"]])] if "a" in ran else []
            print("| " + " | ".join([m, *a_ms, *(cell(per_repeat(m, x, y)) for x, y in ratios)]) + " |")

    table(lambda values: f"{statistics.median(values):.2f}")
    print(f"\nThe lowest and highest per-repeat ratio ({args.repeats} repeats; a ms/step: the fastest and slowest "
          "repeat):\n")
    table(lambda values: f"{min(values):.2f}-{max(values):.2f}")


if __name__ == "__main__":
    main()
