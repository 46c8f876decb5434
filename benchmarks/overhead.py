"""Step-time overhead of hookexp, as ratios against a hand-written loop measured in the same process.

    .venv/bin/python benchmarks/overhead.py                 # every model, issue 19's cases, 3 repeats
    .venv/bin/python benchmarks/overhead.py --models small_cnn --repeats 5 --steps 60
    .venv/bin/python benchmarks/overhead.py --models gpt --cases a,b,d,a_wb,w,e   # a subset of the cases
    .venv/bin/python benchmarks/overhead.py --cases all      # every case below
    python benchmarks/overhead.py --device cuda              # on a GPU machine (adds gpt2_124m to the models)
    python benchmarks/overhead.py --device cuda --models gpt2_124m --cases a,b,b_fsdp --time-limit 240

Models (``--models``; steps per case, unless ``--steps`` gives one count for all):
  small_cnn    the default small CNN on digits, SGD (300 steps)
  deep_mlp     an MLP of 32 linear layers of 64 units with LayerNorm, AdamW (300 steps)
  transformer  the small pre-norm encoder on digits (image rows as tokens), AdamW (200 steps)
  gpt          causal LM: the package's GPT at d_model 256, 4 blocks, on benchmarks/corpus.txt
               (characters, windows of 128 tokens, batch 8), AdamW (60 steps)
  hf_gpt2      causal LM: a transformers GPT-2 built from a config (n_embd 256, 4 layers, 4 heads, random
               weights), same data and optimizer (60 steps; only when transformers imports)
  gpt2_124m    GPT-2 small's shape and size: the package's GPT at d_model 768, 12 blocks, 12 heads, context 1024,
               vocabulary 50257 (GPT-2's; the corpus's characters use the first ~100 ids, the rest are trained
               like GPT-2's rarely seen tokens), head tied to the embedding: 124.4M parameters; batch 8 x 1024
               tokens, AdamW, bf16 autocast (trainer.precision=bf16, and the same autocast in the hand loops)
               (40 steps; a GPU model: in the default --models only with --device cuda)
  gpt2_host    gpt2_124m's blocks, heads, tied head, AdamW and bf16 autocast at d_model 24, context 32, batch 1,
               the corpus's own characters: gpt2_124m's ops a step on tiny tensors, so that on a CPU a step's time
               is mostly the host's (Python, dispatch: what a GPU's host pays besides the launches; log_step.py)
               (100 steps; only where named)

Cases, interleaved in every repeat in a shuffled order (each case's time is the mean step time over its steps).
The default set is issue 19's (a, b, c, d0, d, d_all, a_wb, w, e); ``--cases all`` adds the rest:
  a      hand-written minimal loop: the same data, model, optimizer and task loss (``task.forward`` and
         ``task.loss``: cross-entropy, or the causal LM's next-token cross-entropy), built by hookexp's
         ``build`` like the trainer's
  b      the hookexp trainer, no hooks, statistics off (local files; W&B's service process competes for
         the cores after wandb.init and would confound the comparison with the hand loop)
  c      the trainer, statistics every step: every gradient statistic of every parameter with 32-bin
         histograms, the global norm, and activation statistics (mean, std, fraction zero, 32-bin
         histogram) of the model's activation layers (ReLUs; the encoder layers; the GPTs' MLPs);
         histograms count up to stats.hist_sample (default 4,096) elements per tensor
  d0     the shipped stats config (every gradient statistic of every parameter, no histograms, no activations)
         every 10 steps (stats.every=10): what `python -m hookexp` does
  d      c every 10 steps (stats.every=10, the default)
  d_all  every statistic family every 10 steps: d plus weight norms (stats.params=*), update norms and
         update/weight ratios (stats.updates=*), optimizer state norms (stats.optimizer=*) and, for the
         models made of blocks, one norm per block (stats.group_by)
  a_wb   the hand loop logging its loss to a W&B offline run every step: what w and e both pay besides
  w      a_wb with hookexp.watch(model, opt, every=1, log=run, hist_bins=64): every gradient statistic
         and a 64-bin histogram of every parameter, logged into the same run every step
  e      a_wb with wandb.watch(model, log="gradients", log_freq=1) (64-bin histograms of every gradient)
  c_g    c without the activation statistics            c_x  c with exact histograms (hist_sample=null)
  c_eager  c with the statistics' eager kernels (stats.compile=false; CUDA compiles them by default)
  c_wb   c with the W&B offline run as well              f    e with log_freq=10
  g      clamp every parameter's gradient: hookexp `grad` kind (g_grad), `pre_step` kind (g_pre), and a
         hand-written per-parameter register_hook loop (g_hand), all in the hand loop
  b2     b with two micro-batches a step (trainer.accumulate=2): the baseline of gns
  gns    d with the gradient noise scale (stats.gns=true, per block where the model has blocks) and
         trainer.accumulate=2: a norm per parameter per micro-batch on every step, logged every 10 steps
  b_fsdp b with trainer.strategy=fsdp in a process group of one rank, made in this process by the trainer
         (nccl on CUDA, gloo on the CPU): what FSDP2's sharding machinery costs with nothing to shard across
  a_fsdp the hand loop on the same FSDP2-sharded model (fully_shard as the trainer's build does it, one rank):
         b_fsdp/a_fsdp is hookexp's own price under FSDP
  d_fsdp d with trainer.strategy=fsdp: the statistics of sharded (DTensor) parameters, against b_fsdp
  b_nofx b with first-divergence forensics off (guard.forensics.window=0); b has it on, as every run with the
         guard: b/b_nofx is what the forensics ring buffer costs
Comparisons with wandb.watch are of overheads, as issue 19 asks: w/a_wb - 1 and e/a_wb - 1, and their
ratio "w/e ovh" (watch()'s overhead over wandb.watch's; target <= 0.5): in the first table the median
w/a_wb - 1 over the median e/a_wb - 1, in the second (w - a_wb) / (e - a_wb) per repeat. A ratio of step
times cannot beat wandb.watch by more than wandb.watch costs.
Trainer times are its training-loop time (summary perf/train_loop_s: steps only, no build, no eval), less the
first step (perf/first_step_s: compiling under --set trainer.compile=true, lazy set-up); the hand loops start
their clock after their first step too, and compile the model as the trainer does (distributed.wrap).
A warm-up pass of every case (--warmup-steps, discarded) first loads what a process loads once (W&B,
transformers, torch's own lazy set-up). The hand loops use the trainer's precision (trainer.precision: autocast,
and fp16's GradScaler) so that a/b compares like with like. --time-limit stops starting repeats once the next
one would end past it; the tables then hold the repeats done. --json writes every step time.

Each ratio is the median over repeats of that repeat's own ratio (x and y measured minutes apart in the
same repeat, so a machine that is slower for a while slows both), and the second table gives the lowest
and highest of those per-repeat ratios: how far one run of the benchmark can be trusted on this machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from hydra import compose, initialize_config_module

import hookexp
from hookexp import attach
from hookexp.run import distributed
from hookexp.run.build import build, pick_device
from hookexp.run.distributed import Dist
from hookexp.run.loaders import to_device
from hookexp.run.loop import run_job as train
from hookexp.run.precision import MixedPrecision

# the causal-LM cases' text, fixed: the README of 2026-11-25 (58 KB), so that every table trains on the same text
README = Path(__file__).resolve().parent / "corpus.txt"


@dataclass(frozen=True)
class Bench:
    overrides: tuple[str, ...]
    activations: str  # the activation layers that c, d and d_all describe
    steps: int = 300  # steps per case (--steps overrides)
    group_by: str | None = None  # d_all's stats.group_by (one norm per block)
    needs: str | None = None  # a module that must import, else the model is skipped
    gpu: bool = False  # in the default --models only with a CUDA --device (too slow for a CPU)
    asked: bool = False  # never in the default --models: only where named


LM = ("task=causal_lm", "data=text_file", f"data.path={README}", "data.block_size=128", "data.batch_size=8",
      "optim=adamw")
GPT2_SMALL = ("task=causal_lm", "data=text_file", f"data.path={README}", "data.block_size=1024", "data.batch_size=8",
              "optim=adamw", "model=gpt", "model.vocab_size=50257", "model.d_model=768", "model.n_layer=12",
              "model.n_head=12", "model.tie_weights=true", "trainer.precision=bf16")
# gpt2_124m's ops on tiny tensors: a CPU step's time is mostly the host's (Python, dispatch), which a GPU's host pays
GPT2_HOST = ("task=causal_lm", "data=text_file", f"data.path={README}", "data.block_size=32", "data.batch_size=1",
             "optim=adamw", "model=gpt", "model.block_size=32", "model.d_model=24", "model.n_layer=12",
             "model.n_head=12", "model.tie_weights=true", "trainer.precision=bf16")
MODELS = {
    "small_cnn": Bench(("model=small_cnn",), "relu*"),
    "deep_mlp": Bench(("model=mlp", "model.depth=32", "model.width=64", "model.norm=layer", "optim=adamw"), "relu*"),
    "transformer": Bench(("model=transformer", "optim=adamw"), "layers.?", 200, r"re:^layers\.\d+"),
    "gpt": Bench((*LM, "model=gpt", "model.d_model=256", "model.n_layer=4"), "blocks.*.mlp", 60, r"re:^blocks\.\d+"),
    "hf_gpt2": Bench((*LM, "model=hf", "model.config.n_embd=256", "model.config.n_layer=4", "model.config.n_head=4"),
                     "transformer.h.*.mlp", 60, r"re:^transformer\.h\.\d+", needs="transformers"),
    "gpt2_124m": Bench(GPT2_SMALL, "blocks.*.mlp", 40, r"re:^blocks\.\d+", gpu=True),
    "gpt2_host": Bench(GPT2_HOST, "blocks.*.mlp", 100, r"re:^blocks\.\d+", asked=True),
}
CLAMP = {"min": -1e-3, "max": 1e-3}


class Interrupted(BaseException):
    """SIGUSR1 or SIGTERM (``timeout -s USR1``): stop, and print the tables of the repeats done. (Inside a trainer
    case the trainer takes SIGTERM itself: it checkpoints and stops, and the case then raises this.)"""


ISSUE_19 = ("a", "b", "c", "d0", "d", "d_all", "a_wb", "w", "e")


def compose_cfg(overrides: list[str]):
    with initialize_config_module(config_module="hookexp.conf", version_base="1.3"):
        return compose("config", overrides=["trainer.progress=false", "logger=none", *overrides])


def wandb_run():
    import wandb

    return wandb.init(mode="offline", dir=tempfile.mkdtemp(), project="bench", reinit="finish_previous",
                      settings=wandb.Settings(silent=True))


Setup = Callable[..., Callable[[], object] | None]  # setup(model, optimizer, run) -> cleanup


NO_HOOKS = SimpleNamespace(bindings=())  # what MixedPrecision reads of the trainer's hooks: none in a hand loop


def hand_loop(model_overrides: list[str], steps: int, setup: Setup | None = None, log_loss: bool = False,
              fsdp: bool = False) -> float:
    """Seconds per step of a minimal loop over what ``build`` makes of the config (the trainer's data, model,
    optimizer and task); ``setup(model, opt, run)`` attaches hooks or watches; ``log_loss`` logs the loss to a
    W&B offline run (``run``) every step; ``fsdp``: the model sharded by FSDP2 (``fully_shard``, as
    ``trainer.strategy=fsdp`` shards it) in a process group of one rank made here (nccl on CUDA, gloo on the
    CPU): the hand loop that ``b_fsdp`` is compared with."""
    if fsdp:
        cfg = compose_cfg([*model_overrides, *FSDP])
        device = pick_device(cfg.trainer.device)
        ranks = distributed.setup(device, "fsdp")
        try:
            device = ranks.place(device)
            parts = build(cfg, ranks, device)  # fully_shard, as the trainer's run is built
            return _hand_steps(cfg, parts, (device, ranks), steps, (setup, log_loss))
        finally:
            distributed.teardown(ranks)
    cfg = compose_cfg(model_overrides)
    device = pick_device(cfg.trainer.device)
    parts = build(cfg, Dist(), device)
    return _hand_steps(cfg, parts, (device, Dist()), steps, (setup, log_loss))


def _hand_steps(cfg, parts, where: tuple[torch.device, Dist], steps: int,
                how: tuple[Setup | None, bool]) -> float:
    (device, ranks), (setup, log_loss) = where, how
    model, opt, task = parts.model, parts.optimizer, parts.task
    amp = MixedPrecision(cfg.trainer.precision, device, NO_HOOKS)  # the trainer's autocast (and fp16 scaler)
    run = wandb_run() if log_loss else None
    cleanup = setup(model, opt, run) if setup else None
    forward = distributed.wrap(model, cfg.trainer, ranks, device)  # torch.compile'd under trainer.compile=true
    model.train()
    done, epoch = 0, 0
    start = time.perf_counter()
    while done < steps:
        for batch in parts.loaders.epoch(epoch):
            batch = to_device(batch, device)
            opt.zero_grad(set_to_none=True)
            with amp.autocast():
                loss = task.loss(task.forward(forward, batch), batch)
            amp.backward(loss)
            amp.unscale(opt)
            amp.step(opt)
            if run is not None:
                run.log({"train/loss": loss.item()})
            done += 1
            if done == 1 < steps:  # the clock starts after the first step (compiling, lazy set-up), as trainer_loop's
                start = time.perf_counter()
            if done == steps:
                break
        epoch += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the trainer's last step logs, which waits for the device too
    elapsed = time.perf_counter() - start
    if cleanup is not None:
        cleanup()
    if run is not None:
        run.finish()
    return elapsed / max(steps - 1, 1)


def trainer_loop(model_overrides: list[str], steps: int, extra: list[str]) -> float:
    cfg = compose_cfg([*model_overrides, f"trainer.max_steps={steps}", "trainer.epochs=1000", *extra])
    with tempfile.TemporaryDirectory() as tmp:
        summary = train(cfg, Path(tmp))
    if summary.get("signal"):
        raise Interrupted
    if steps == 1:
        return summary["perf/train_loop_s"]
    return (summary["perf/train_loop_s"] - summary["perf/first_step_s"]) / (steps - 1)


def clamp_via(kind: str) -> Setup:
    def setup(model, opt, run):
        handle = attach(model, {"c": {"target": "*", "kind": kind, "transform": "clamp", "args": CLAMP}}, opt,
                        measure=False)
        return handle.remove

    return setup


def clamp_by_hand(model, opt, run):
    handles = [p.register_hook(lambda g: g.clamp(min=CLAMP["min"], max=CLAMP["max"])) for p in model.parameters()]
    return lambda: [h.remove() for h in handles]


def wandb_watch(freq: int) -> Setup:
    def setup(model, opt, run):
        run.watch(model, log="gradients", log_freq=freq)
        return lambda: run.unwatch(model)

    return setup


def hookexp_watch(model, opt, run):
    return hookexp.watch(model, opt, every=1, log=run, hist_bins=64).remove


STATS_OFF = ["stats.grads=null", "stats.every=1000000000"]
FSDP = ["trainer.strategy=fsdp"]  # one process: the trainer makes a process group of one rank (nccl / gloo)


def add_fused(parser: argparse.ArgumentParser) -> None:
    """The ``--fused`` flag (:func:`use_fused`)."""
    parser.add_argument("--fused", action="store_true",
                        help="describe the statistics as on CUDA (single passes, stats.FUSED) on the CPU too")


def use_fused(args: argparse.Namespace) -> None:
    """With ``--fused``, the statistics are described as on CUDA (single passes over each row, ``stats.FUSED``) on
    the CPU too: what a GPU's host dispatches and its kernels move, on any machine."""
    if args.fused:
        from hookexp.telemetry import stats

        stats.FUSED = frozenset({*stats.FUSED, "cpu"})


def stats_all(activations: str) -> list[str]:
    """Case c's statistics: every gradient statistic and the activation statistics of ``activations``, each
    with a 32-bin histogram."""
    return ["stats.grads=*", f"stats.activations={activations}", "stats.hist_bins=32"]


def every_family(bench: Bench) -> list[str]:
    """Case d_all's statistics: c's, and weight, update and optimizer-state norms, and group norms."""
    groups = [f"stats.group_by='{bench.group_by}'"] if bench.group_by else []
    return [*stats_all(bench.activations), "stats.params=*", "stats.updates=*", "stats.optimizer=*", *groups]


def cases(bench: Bench, model: list[str], steps: int) -> dict[str, Callable[[], float]]:
    every_stat = stats_all(bench.activations)
    groups = [f"stats.group_by='{bench.group_by}'"] if bench.group_by else []
    fns: dict[str, Callable[[int], float]] = {
        "a": lambda n: hand_loop(model, n),
        "b": lambda n: trainer_loop(model, n, STATS_OFF),
        "c": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=1"]),
        "c_g": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=1", "stats.activations=null"]),
        # c with the statistics' eager kernels (stats.compile=false; on CUDA they are compiled by default)
        "c_eager": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=1", "stats.compile=false"]),
        "c_x": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=1", "stats.hist_sample=null"]),
        "d": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=10"]),
        "d0": lambda n: trainer_loop(model, n, ["stats.every=10"]),  # the shipped stats config
        "d_all": lambda n: trainer_loop(model, n, [*every_family(bench), "stats.every=10"]),
        "c_wb": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=1", "logger=wandb"]),
        "a_wb": lambda n: hand_loop(model, n, log_loss=True),
        "w": lambda n: hand_loop(model, n, hookexp_watch, log_loss=True),
        "e": lambda n: hand_loop(model, n, wandb_watch(1), log_loss=True),
        "f": lambda n: hand_loop(model, n, wandb_watch(10), log_loss=True),
        "g_grad": lambda n: hand_loop(model, n, clamp_via("grad")),
        "g_pre": lambda n: hand_loop(model, n, clamp_via("pre_step")),
        "g_hand": lambda n: hand_loop(model, n, clamp_by_hand),
        "b2": lambda n: trainer_loop(model, n, [*STATS_OFF, "trainer.accumulate=2"]),
        "gns": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=10", "trainer.accumulate=2",
                                                 "stats.gns=true", *groups]),
        "a_fsdp": lambda n: hand_loop(model, n, fsdp=True),
        "b_fsdp": lambda n: trainer_loop(model, n, [*STATS_OFF, *FSDP]),
        "d_fsdp": lambda n: trainer_loop(model, n, [*every_stat, "stats.every=10", *FSDP]),
        "b_nofx": lambda n: trainer_loop(model, n, [*STATS_OFF, "guard.forensics.window=0"]),
    }
    return {name: (lambda fn=fn: fn(steps)) for name, fn in fns.items()}


@dataclass(frozen=True)
class Column:
    label: str
    needs: tuple[str, ...]  # the cases it is computed from
    of: Callable[[dict[str, float]], float]  # its value from one repeat's step times
    summary: Callable[[dict[str, list[float]]], float] | None = None  # the first table's cell (None: the median
    # of the per-repeat values)


def ratio(x: str, y: str) -> Column:
    return Column(f"{x}/{y}", (x, y), lambda t: t[x] / t[y])


def watch_vs_wandb(t: dict[str, float]) -> float:
    """watch()'s overhead over wandb.watch's, both against the hand loop that logs its loss (a_wb)."""
    return (t["w"] - t["a_wb"]) / (t["e"] - t["a_wb"])


def watch_vs_wandb_medians(times: dict[str, list[float]]) -> float:
    """The same from the median overheads (median w/a_wb - 1 over median e/a_wb - 1): a repeat where
    wandb.watch happens to cost almost nothing does not swing it, as it swings that repeat's own ratio."""
    def overhead(x: str) -> float:
        return statistics.median(tx / ta for tx, ta in zip(times[x], times["a_wb"], strict=True)) - 1

    return overhead("w") / overhead("e")


COLUMNS = [ratio("b", "a"), ratio("c", "b"), ratio("c_eager", "b"), ratio("c_g", "b"), ratio("c_x", "b"),
           ratio("d0", "b"), ratio("d", "b"),
           ratio("d_all", "b"), ratio("c_wb", "b"), ratio("w", "a_wb"), ratio("e", "a_wb"),
           Column("w/e ovh", ("w", "e", "a_wb"), watch_vs_wandb, watch_vs_wandb_medians), ratio("f", "a_wb"),
           ratio("e", "c"), ratio("g_grad", "a"), ratio("g_pre", "a"), ratio("g_hand", "a"),
           ratio("g_pre", "g_hand"), ratio("gns", "b2"), ratio("b_fsdp", "b"), ratio("b_fsdp", "a_fsdp"),
           ratio("d_fsdp", "b_fsdp"),
           ratio("b", "b_nofx"), ratio("b_nofx", "a")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="comma-separated (default: every model; gpt2_124m only "
                        "with a CUDA --device)")
    parser.add_argument("--steps", type=int, default=0, help="steps per case for every model (0: each model's own)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="trainer.device for every case: cpu, cuda, ...")
    parser.add_argument("--cases", default=",".join(ISSUE_19), help="the cases to run (e.g. a,b,c), or 'all': the "
                        "table keeps the ratios it can compute")
    parser.add_argument("--warmup-steps", type=int, default=30, help="steps of each case's discarded warm-up run "
                        "(0: none; at most a fifth of a model's steps)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order of the cases in each repeat")
    parser.add_argument("--time-limit", type=float, default=0, help="seconds: start no repeat that would end after "
                        "this (judged by the slowest repeat so far; the first always runs); 0: no limit")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides appended to "
                        "every model's (e.g. data.batch_size=2 data.block_size=64 for a quick check)")
    parser.add_argument("--json", type=Path, help="write the step times (seconds, per model, case and repeat) there")
    add_fused(parser)
    args = parser.parse_args()
    use_fused(args)
    if args.models is None:
        cuda = args.device.startswith("cuda")
        args.models = ",".join(m for m, b in MODELS.items() if (cuda or not b.gpu) and not b.asked)
    import logging

    logging.disable(logging.WARNING)
    os.environ.setdefault("WANDB_SILENT", "true")  # W&B runs would print their summaries into the table's output
    names = []
    for m in args.models.split(","):
        needs = MODELS[m].needs
        if needs and importlib.util.find_spec(needs) is None:
            print(f"{m}: skipped ({needs} does not import)", file=sys.stderr)
        else:
            names.append(m)
    wanted = None if args.cases == "all" else args.cases.split(",")

    def steps_of(m: str) -> int:
        return args.steps or MODELS[m].steps

    def selected(m: str, steps: int) -> dict[str, Callable[[], float]]:
        bench = MODELS[m]
        every = cases(bench, [*bench.overrides, f"trainer.device={args.device}", *args.set], steps)
        return {case: fn for case, fn in every.items() if wanted is None or case in wanted}

    started = time.perf_counter()
    failed: dict[tuple[str, str], str] = {}  # (model, case) -> the error; the case is left out from then on

    def attempt(m: str, case: str, fn: Callable[[], float]) -> float | None:
        try:
            return fn()
        except Exception as e:  # one broken case (a strategy the machine lacks, ...) must not cost the others
            traceback.print_exc()
            failed[m, case] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            print(f"{m} {case}: FAILED, left out ({failed[m, case]})", file=sys.stderr, flush=True)
            return None

    def interrupted(signum: int, frame: object) -> None:
        raise Interrupted

    for sig in (signal.SIGTERM, signal.SIGUSR1):  # `timeout` stops the benchmark: the tables of the repeats done
        signal.signal(sig, interrupted)
    order = random.Random(args.seed)
    times: dict[str, dict[str, list[float]]] = {m: {} for m in names}
    slowest, done = 0.0, 0
    try:
        if args.warmup_steps:
            for m in names:
                for case, fn in selected(m, max(2, min(args.warmup_steps, steps_of(m) // 5))).items():
                    attempt(m, case, fn)
            print(f"warm-up done ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        for r in range(args.repeats):
            if r and args.time_limit and time.perf_counter() - started + slowest > args.time_limit:
                print(f"--time-limit {args.time_limit:.0f} s: stopping after {r} repeat(s)", file=sys.stderr,
                      flush=True)
                break
            began = time.perf_counter()
            for m in names:
                todo = [(c, fn) for c, fn in selected(m, steps_of(m)).items() if (m, c) not in failed]
                order.shuffle(todo)
                for case, fn in todo:
                    t = attempt(m, case, fn)
                    if t is None:
                        times[m].pop(case, None)
                    else:
                        times[m].setdefault(case, []).append(t)
            slowest, done = max(slowest, time.perf_counter() - began), r + 1
            print(f"repeat {r + 1}/{args.repeats} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr,
                  flush=True)
    except (Interrupted, KeyboardInterrupt):
        print(f"interrupted after {done} whole repeat(s): the tables hold those", file=sys.stderr, flush=True)
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    times = {m: {c: t[:done] for c, t in cases_of.items() if len(t) >= done} for m, cases_of in times.items()}
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "torch": torch.__version__, "times": times,
                                         "failed": {f"{m} {c}": e for (m, c), e in failed.items()}}, indent=1))
    for (m, c), e in failed.items():
        print(f"{m} {c}: FAILED ({e})")
    ran = set.intersection(*(set(times[m]) for m in names)) if names else set()
    if not done or not ran:
        print("no repeat finished: no table" if not done else "no case ran in every model: no table")
        sys.exit(1)

    where = (torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else
             f"{os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s)")
    steps = f"{args.steps} steps" if args.steps else "steps " + ", ".join(f"{m} {steps_of(m)}" for m in names)
    print(f"\ntorch {torch.__version__}, {args.device} ({where}), {steps}, {done} repeats (median of the "
          f"per-repeat ratios); statistics computed by torch ops (hookexp/telemetry/stats.py)\n")
    columns = [c for c in COLUMNS if set(c.needs) <= ran]
    header = ["model", *(["a ms/step"] if "a" in ran else []), *(c.label for c in columns)]

    def per_repeat(m: str, c: Column) -> list[float]:
        return [c.of(dict(zip(times[m], t, strict=True))) for t in zip(*times[m].values(), strict=True)]

    def median(m: str, c: Column) -> float:
        return c.summary(times[m]) if c.summary else statistics.median(per_repeat(m, c))

    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for m in names:
        a_ms = [f"{statistics.median(times[m]['a']) * 1e3:.2f}"] if "a" in ran else []
        print("| " + " | ".join([m, *a_ms, *(f"{median(m, c):.2f}" for c in columns)]) + " |")
    print(f"\nThe lowest and highest per-repeat value ({done} repeats; a ms/step: the fastest and slowest "
          "repeat):\n")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for m in names:
        a_ms = [f"{min(times[m]['a']) * 1e3:.2f}-{max(times[m]['a']) * 1e3:.2f}"] if "a" in ran else []
        cells = [f"{min(v):.2f}-{max(v):.2f}" for v in (per_repeat(m, c) for c in columns)]
        print("| " + " | ".join([m, *a_ms, *cells]) + " |")
    order_ran = [c for c in [*ISSUE_19, *sorted(ran - set(ISSUE_19))] if c in ran]
    print("\nEach case's step time, ms (median over repeats):\n")
    print("| " + " | ".join(["model", *order_ran]) + " |\n|" + "---|" * (len(order_ran) + 1))
    for m in names:
        print("| " + " | ".join([m, *(f"{statistics.median(times[m][c]) * 1e3:.2f}" for c in order_ran)]) + " |")
    targets = [("the trainer without forensics costs <= 2% over the hand loop (b_nofx/a <= 1.02)", "b_nofx/a", 1.02),
               ("the shipped statistics cost <= 2% (d0/b <= 1.02)", "d0/b", 1.02),
               ("every statistic every step costs <= 15% (c/b <= 1.15)", "c/b", 1.15),
               ("the trainer under FSDP costs <= 3% over the hand FSDP loop (b_fsdp/a_fsdp <= 1.03)",
                "b_fsdp/a_fsdp", 1.03),
               ("all statistics every 10 steps cost <= 5% of a step (d/b <= 1.05)", "d/b", 1.05),
               ("watch() at every=1 has at most half wandb.watch's overhead (w/e ovh <= 0.5)", "w/e ovh", 0.5)]
    for text, label, limit in targets:
        column = next((c for c in columns if c.label == label), None)
        if column is not None:
            got = {m: median(m, column) for m in names}
            verdict = "met" if all(v <= limit for v in got.values()) else "NOT met"
            print(f"\n{text}: {verdict} (" + ", ".join(f"{m} {v:.2f}" for m, v in got.items()) + ")", end="")
    print(f"\n\n{time.perf_counter() - started:.0f} s in all")
    if failed:
        sys.exit(1)  # the tables are there, without the cases that failed


if __name__ == "__main__":
    main()
