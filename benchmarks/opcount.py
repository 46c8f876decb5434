"""The price of a step, counted: aten ops dispatched per training step, for the cases of ``overhead.py``.

    .venv/bin/python benchmarks/opcount.py                        # the table of benchmarks/README.md (~4 min)
    .venv/bin/python benchmarks/opcount.py --models small_cnn --cases a,b_nofx --ops   # which ops each case adds

Every op that reaches the dispatcher under autograd (forward, backward, optimizer, the trainer's own) is counted
by a ``TorchDispatchMode``; a step's count is the marginal one, ``(ops(n2 steps) - ops(n1 steps)) / (n2 - n1)``,
so that building, the first and last steps' logging, validation and the final checkpoint (the same in both runs)
cancel. Each run is repeated after a discarded warm-up run of the same case (torch's lazy set-up is not a step's
price). A count does not depend on the machine, the thread count or the batch size: any machine reproduces it
exactly (the ``a`` column of ``gpt2_124m`` runs on the CPU with batch 1 x 32 tokens, the same ops as on a GPU
but for the autocast casts of bf16 there, which are counted too).

Two counts per case: a step that does not log (``stats.every`` larger than the run), and a log step
(``stats.every=1``: every step logs), whose difference is what a log step adds. ``--ops`` prints, per case, the
ops it dispatches per step beyond ``a``'s, by name.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead

NO_LOG = ["stats.every=1000000000"]  # the first and the last step log in both runs: they cancel
EVERY_STEP = ["stats.every=1"]
# gpt2_124m on a CPU: the op count does not depend on the batch or context size
SMALL_BATCH = {"gpt2_124m": ["data.batch_size=1", "data.block_size=32", "model.block_size=32"]}
FORENSICS_OFF = ["guard.forensics.window=0"]
# the DataLoader's record_function markers (one pair a batch fetched, and a few more at an epoch's start): not ops
PROFILER = {"_record_function_enter_new", "_record_function_exit"}


class Count(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if name not in PROFILER:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def case_runs(bench: overhead.Bench) -> dict[str, tuple[object, list[str]]]:
    """case -> (runner, the overrides besides the statistics cadence)."""
    groups = [f"stats.group_by='{bench.group_by}'"] if bench.group_by else []
    every_stat = overhead.stats_all(bench.activations)
    trainer = overhead.trainer_loop
    off = ["stats.grads=null"]
    return {
        "a": (None, []),
        "b": (trainer, [*off]),
        "b_nofx": (trainer, [*off, *FORENSICS_OFF]),
        "d0": (trainer, []),  # the shipped statistics
        "d0_nofx": (trainer, [*FORENSICS_OFF]),
        "c": (trainer, [*every_stat]),
        "c_nofx": (trainer, [*every_stat, *FORENSICS_OFF]),
        "b2": (trainer, [*off, "trainer.accumulate=2"]),
        "gns": (trainer, [*every_stat, "trainer.accumulate=2", "stats.gns=true", *groups]),
        "gns_nofx": (trainer, [*every_stat, "trainer.accumulate=2", "stats.gns=true", *groups, *FORENSICS_OFF]),
    }


CASES = ("a", "b_nofx", "b", "d0_nofx", "d0", "c_nofx", "c", "b2", "gns_nofx", "gns")


def count(run, model: list[str], extra: list[str], steps: int) -> Counter[str]:
    """The ops of one run of ``steps`` steps (output silenced)."""
    mode = Count()
    with contextlib.redirect_stdout(io.StringIO()), mode:
        if run is None:
            overhead.hand_loop(model, steps)
        else:
            run(model, steps, extra)
    return mode.ops


def per_step(run, model: list[str], extra: list[str], n1: int, n2: int, warmup: int) -> Counter[str]:
    """The ops of one step, by name: the marginal count over n1 -> n2 steps (after a warm-up run)."""
    if warmup:
        count(run, model, extra, warmup)
    first, second = count(run, model, extra, n1), count(run, model, extra, n2)
    diff = Counter({k: (second[k] - first[k]) for k in set(first) | set(second)})
    # an epoch's start (the sampler's permutation, ...) adds a few ops once in a while: a step's count of each op
    # is the whole part of its marginal count, which leaves them out
    return Counter({k: v // (n2 - n1) for k, v in diff.items() if v // (n2 - n1)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small_cnn,gpt_small,gpt2_124m")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", default="20,40", help="n1,n2: the marginal count over n1 -> n2 steps")
    parser.add_argument("--ops", action="store_true", help="print each case's ops beyond a's, by name")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("WANDB_SILENT", "true")
    torch.manual_seed(0)
    n1, n2 = (int(s) for s in args.steps.split(","))
    wanted = args.cases.split(",")
    rows = []
    for m in args.models.split(","):
        bench = MODELS[m]
        model = [*bench.overrides, "trainer.device=cpu", *SMALL_BATCH.get(m, [])]
        steps = (n1, n2) if m != "gpt2_124m" else (2, 4)  # a big model's step takes a while on a CPU
        counts: dict[str, tuple[Counter[str], Counter[str]]] = {}
        for case, (run, extra) in case_runs(bench).items():
            if case not in wanted:
                continue
            if run is None:
                step = per_step(None, model, [], *steps, warmup=2)
                counts[case] = (step, step)
            else:
                counts[case] = (per_step(run, model, [*extra, *NO_LOG], *steps, warmup=2),
                                per_step(run, model, [*extra, *EVERY_STEP], *steps, warmup=2))
            print(f"{m} {case}: {sum(counts[case][0].values())} / {sum(counts[case][1].values())}", file=sys.stderr,
                  flush=True)
        rows.append((m, counts))
        if args.ops and "a" in counts:
            base = counts["a"][0]
            for case, (plain, _) in counts.items():
                extra_ops = plain - base
                fewer = base - plain
                print(f"\n{m} {case}: +{sum(extra_ops.values())} -{sum(fewer.values())} over a: "
                      + ", ".join(f"{k} {v}" for k, v in sorted(extra_ops.items(), key=lambda kv: -kv[1]))
                      + ("; fewer: " + ", ".join(f"{k} {v}" for k, v in fewer.items()) if fewer else ""))
    print(f"\ntorch {torch.__version__}; aten ops per step, marginal over {n1} -> {n2} steps (gpt2_124m: 2 -> 4, "
          "batch 1 x 32 tokens, on the CPU); a step that does not log / a log step (stats.every=1)\n")
    cols = [c for c in CASES if c in wanted]
    print("| model | " + " | ".join(cols) + " | trainer - a |")
    print("|---|" + "---|" * (len(cols) + 1))
    for m, counts in rows:
        cells = []
        for c in cols:
            plain, logged = (sum(x.values()) for x in counts[c])
            cells.append(str(plain) if c == "a" else f"{plain} / {logged}")
        own = (f"{sum(counts['b_nofx'][0].values()) - sum(counts['a'][0].values()):+d}"
               if "a" in counts and "b_nofx" in counts else "")
        print(f"| {m} | " + " | ".join(cells) + f" | {own} |")


MODELS = {
    "small_cnn": overhead.MODELS["small_cnn"],
    # the small GPT: d_model 64, 2 blocks, windows of 128 characters, batch 8
    "gpt_small": overhead.Bench((*overhead.LM, "model=gpt", "model.d_model=64", "model.n_layer=2"), "blocks.*.mlp",
                                group_by=r"re:^blocks\.\d+"),
    "gpt": overhead.MODELS["gpt"],
    "gpt2_124m": overhead.MODELS["gpt2_124m"],
}

if __name__ == "__main__":
    main()
