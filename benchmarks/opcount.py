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

Beside the ops, the bytes they move: each op that is not a view counts the bytes of its distinct tensor inputs
and outputs (an in-place op's tensor once read and once written). Without fusion or caches, an upper bound of a
step's DRAM traffic on a GPU, whose log step is priced in bytes more than in launches; divided by a card's
bandwidth, a lower bound of their time. gpt2_124m's activations grow with the batch: its ``d0`` and ``c`` log
steps are counted again at batch 4, which splits their bytes into the part per 32 tokens and the rest.
``--fused`` counts the statistics' CUDA path (single passes over each row, ``stats.FUSED``) on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import logging
import math
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
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


# ops that overwrite their first argument without reading it (an ``out=`` argument is never counted as read
# either), ops that allocate without writing, and ops whose tensor argument is a template (``new_*``, ``*_like``)
WRITE_ONLY = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_"}
ALLOCATE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}


# ops that read (gather) or write (scatter, in place) only the positions an index picks in their first argument:
# it counts at most as many elements as their largest other tensor (the output of a gather, the values or the
# index of a scatter)
GATHER = {"take", "index_select", "gather", "index", "embedding"}
SCATTER = {"index_put_", "index_add_", "index_copy_", "scatter_", "scatter_add_", "scatter_reduce_", "put_",
           "masked_scatter_"}


def template(name: str) -> bool:
    return name.startswith("new_") or name.endswith("_like")


@functools.cache
def aliasing(func) -> tuple[bool, frozenset[int], frozenset[str]]:
    """(whether ``func`` is a view, the positions and the names of the arguments it writes), from its schema: a
    view's arguments alias its outputs without being written (``OpOverload.is_view``'s rule, here for any torch)."""
    arguments = func._schema.arguments
    written = [(i, a) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]
    view = not written and any(a.alias_info is not None for a in arguments)
    return view, frozenset(i for i, a in written if not a.kwarg_only), frozenset(a.name for _, a in written)


def tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.layout == torch.strided]


def nbytes(t: torch.Tensor) -> int:
    """The bytes of the distinct elements ``t`` addresses: a broadcast (stride 0) dimension counts once."""
    if t.numel() == 0:
        return 0
    return math.prod(n for n, st in zip(t.shape, t.stride(), strict=True) if st != 0) * t.element_size()


def key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())


class Count(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active, by name, and the bytes each op reads and writes: the
    ``nbytes`` of its distinct tensor inputs and outputs on ``device`` (every device when None). A view (an op
    whose outputs alias its inputs) moves none; the tensor an in-place op writes counts once read and once
    written, an ``out=`` tensor once written, an indexed one (``GATHER``, ``SCATTER``) the elements its index can
    pick. An upper bound of the DRAM traffic of unfused kernels."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.device = device
        self.ops: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.sizes: Counter[tuple[str, int]] = Counter()  # (op, bytes of one call) -> calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        if name not in PROFILER:
            self.ops[name] += 1
            moved = self.moved(func, name, args, kwargs, out)
            self.bytes[name] += moved
            self.sizes[name, moved] += 1
        return out

    def moved(self, func, name: str, args, kwargs, out) -> int:
        """The bytes ``func`` read and wrote (``out`` is its result)."""
        view, write_pos, write_names = aliasing(func)
        if view or name in ALLOCATE:
            return 0
        written = [a for i, a in enumerate(args) if i in write_pos] + [v for k, v in kwargs.items() if k in write_names]
        read_only = [a for i, a in enumerate(args) if i not in write_pos] + [
            v for k, v in kwargs.items() if k not in write_names]
        # an out= argument is kwarg-only: written, not read; an in-place op's is read too, unless it only overwrites
        read = read_only + ([a for i, a in enumerate(args) if i in write_pos] if name not in WRITE_ONLY else [])
        ins, outs = self.distinct([] if template(name) else read), self.distinct([*written, out])
        if not write_pos and not write_names:
            # an op that returns its input as is (``_unsafe_view``, a no-op ``to``): no data moved
            stored = {t.untyped_storage().data_ptr() for t in ins.values()}
            if outs and all(t.untyped_storage().data_ptr() in stored for t in outs.values()):
                return 0
        first = next(iter(tensors(args[:1])), None)
        if first is None or (name not in GATHER and name not in SCATTER):
            return sum(map(nbytes, ins.values())) + sum(map(nbytes, outs.values()))
        others = outs.values() if name in GATHER else [t for t in tensors(args[1:]) if key(t) != key(first)]
        most = max((t.numel() for t in others), default=0) * first.element_size()
        return sum(min(nbytes(t), most) if key(t) == key(first) else nbytes(t) for d in (ins, outs) for t in d.values())

    def distinct(self, tree) -> dict[tuple, torch.Tensor]:
        return {key(t): t for t in tensors(tree) if self.device is None or t.device.type == self.device}


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


def count(run, model: list[str], extra: list[str], steps: int) -> Count:
    """The ops and bytes of one run of ``steps`` steps on the CPU (output silenced)."""
    mode = Count("cpu")
    with contextlib.redirect_stdout(io.StringIO()), mode:
        if run is None:
            overhead.hand_loop(model, steps)
        else:
            run(model, steps, extra)
    return mode


def marginal(run, model: list[str], extra: list[str], n1: int, n2: int, warmup: int) -> tuple[Counter, Counter]:
    """(the ops, the bytes) of one step, by op name: the marginal counts over n1 -> n2 steps (after a warm-up
    run)."""
    if warmup:
        count(run, model, extra, warmup)
    first, second = count(run, model, extra, n1), count(run, model, extra, n2)
    n = n2 - n1
    # an epoch's start (the sampler's permutation, ...) and end (validation, a shorter last batch) add a few ops once
    # in a while: a step's count of each op is the whole part of its marginal count, which leaves them out
    ops = Counter({k: (second.ops[k] - first.ops[k]) // n for k in set(first.ops) | set(second.ops)})
    ops = Counter({k: v for k, v in ops.items() if v})
    return ops, Counter({k: step_bytes(k, ops[k], first.sizes, second.sizes, n) for k in ops})


def step_bytes(op: str, calls: int, first: Counter, second: Counter, n: int) -> int:
    """The bytes of a step's ``calls`` calls of ``op``: of its calls of each size, the marginal count rounded (a
    size that a step does not call every time, such as an epoch's shorter last batch or validation, is left out),
    the most frequent (then the largest) first, up to the op's count; calls whose size changes from step to step
    (a data-dependent shape) are priced at the mean of the others."""
    diff = {b: second[o, b] - first[o, b] for o, b in set(first) | set(second) if o == op}
    kept: dict[int, int] = {}
    for b, d in sorted(diff.items(), key=lambda kv: (-kv[1], -kv[0])):  # a tie: the larger first
        if (k := min((2 * d + n) // (2 * n), calls - sum(kept.values()))) > 0:
            kept[b] = k
    moved = sum(b * k for b, k in kept.items())
    rest = {b: d - n * kept.get(b, 0) for b, d in diff.items() if d - n * kept.get(b, 0) > 0}
    if (missing := calls - sum(kept.values())) > 0 and rest:
        moved += missing * sum(b * k for b, k in rest.items()) // sum(rest.values())
    return moved


def per_step(run, model: list[str], extra: list[str], n1: int, n2: int, warmup: int) -> Counter[str]:
    """The ops of one step, by name: the marginal count over n1 -> n2 steps (after a warm-up run)."""
    return marginal(run, model, extra, n1, n2, warmup)[0]


def mb(n: float) -> str:
    return f"{n / 1e6:.1f}" if abs(n) >= 1e7 else f"{n / 1e6:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small_cnn,gpt_small,gpt2_124m")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", default="20,40", help="n1,n2: the marginal count over n1 -> n2 steps")
    overhead.add_fused(parser)
    parser.add_argument("--ops", action="store_true",
                        help="print each case's ops beyond a's, and the bytes a log step adds, by op name")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("WANDB_SILENT", "true")
    overhead.use_fused(args)
    torch.manual_seed(0)
    n1, n2 = (int(s) for s in args.steps.split(","))
    wanted = args.cases.split(",")
    rows = []
    scaled: list[str] = []
    for m in args.models.split(","):
        bench = MODELS[m]
        model = [*bench.overrides, "trainer.device=cpu", *SMALL_BATCH.get(m, [])]
        steps = (n1, n2) if m != "gpt2_124m" else (2, 4)  # a big model's step takes a while on a CPU
        counts: dict[str, tuple[tuple[Counter, Counter], tuple[Counter, Counter]]] = {}
        for case, (run, extra) in case_runs(bench).items():
            if case not in wanted:
                continue
            if run is None:
                step = marginal(None, model, [], *steps, warmup=2)
                counts[case] = (step, step)
            else:
                counts[case] = (marginal(run, model, [*extra, *NO_LOG], *steps, warmup=2),
                                marginal(run, model, [*extra, *EVERY_STEP], *steps, warmup=2))
            (plain, plain_b), (logged, logged_b) = counts[case]
            print(f"{m} {case}: {sum(plain.values())} / {sum(logged.values())} ops, "
                  f"{mb(sum(plain_b.values()))} / {mb(sum(logged_b.values()))} MB", file=sys.stderr, flush=True)
            if m in SCALE and case in SCALE_CASES:
                scaled.append(f"{m} {case}: " + scale(m, run, model, extra, steps, logged_b.total() - plain_b.total()))
                print(scaled[-1], file=sys.stderr, flush=True)
        rows.append((m, counts))
        if args.ops and "a" in counts:
            base = counts["a"][0][0]
            for case, ((plain, plain_b), (logged, logged_b)) in counts.items():
                extra_ops = plain - base
                fewer = base - plain
                print(f"\n{m} {case}: +{sum(extra_ops.values())} -{sum(fewer.values())} over a: "
                      + ", ".join(f"{k} {v}" for k, v in sorted(extra_ops.items(), key=lambda kv: -kv[1]))
                      + ("; fewer: " + ", ".join(f"{k} {v}" for k, v in fewer.items()) if fewer else ""))
                log_b = {k: logged_b[k] - plain_b[k] for k in logged_b if logged_b[k] != plain_b[k]}
                if log_b:
                    print(f"{m} {case}: a log step's MB beyond a step's: "
                          + ", ".join(f"{k} {mb(v)} ({logged[k] - plain[k]:+d} ops)"
                                      for k, v in sorted(log_b.items(), key=lambda kv: -kv[1])))
    path = "the statistics' CUDA path (--fused)" if args.fused else "the statistics' CPU path"
    print(f"\ntorch {torch.__version__}, {path}; aten ops per step, marginal over {n1} -> {n2} steps (gpt2_124m: "
          "2 -> 4, batch 1 x 32 tokens, on the CPU); a step that does not log / a log step (stats.every=1)\n")
    cols = [c for c in CASES if c in wanted]
    print("| model | " + " | ".join(cols) + " | trainer - a |")
    print("|---|" + "---|" * (len(cols) + 1))
    for m, counts in rows:
        cells = []
        for c in cols:
            plain, logged = (sum(x[0].values()) for x in counts[c])
            cells.append(str(plain) if c == "a" else f"{plain} / {logged}")
        own = (f"{sum(counts['b_nofx'][0][0].values()) - sum(counts['a'][0][0].values()):+d}"
               if "a" in counts and "b_nofx" in counts else "")
        print(f"| {m} | " + " | ".join(cells) + f" | {own} |")
    print("\nMB (1e6 bytes) read and written per step by the same ops (each op's distinct tensor inputs and "
          "outputs; views none): a step that does not log / a log step\n")
    print("| model | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for m, counts in rows:
        cells = []
        for c in cols:
            plain, logged = (mb(x[1].total()) for x in counts[c])
            cells.append(plain if c == "a" else f"{plain} / {logged}")
        print(f"| {m} | " + " | ".join(cells) + " |")
    logs = [c for c in cols if c != "a"]
    print(f"\nA log step's MB beyond a step's that does not log (ms at {HBM / 1e12} TB/s: the least those bytes "
          "cost on an H100 SXM)\n")
    print("| model | " + " | ".join(logs) + " |")
    print("|---|" + "---|" * len(logs))
    for m, counts in rows:
        extra_b = [counts[c][1][1].total() - counts[c][0][1].total() for c in logs]
        print(f"| {m} | " + " | ".join(f"{mb(b)} ({b / HBM * 1e3:.3f})" for b in extra_b) + " |")
    if scaled:
        print("\n" + "\n".join(scaled))


HBM = 3.35e12  # B/s: an H100 SXM's HBM3, its peak
# gpt2_124m's log step at batch 1 x 32 tokens and 4 x 32: what grows with the batch (the activations' statistics),
# per row of 32 tokens, times the rows of the benchmark's 8 x 1024 tokens
SCALE = {"gpt2_124m": (4, 8 * 1024 // 32)}
SCALE_CASES = ("d0", "c")


def scale(m: str, run, model: list[str], extra: list[str], steps: tuple[int, int], one: int) -> str:
    """A log step's extra bytes ``one`` at batch 1, split by a second count at a larger batch into the part per
    batch row and the rest, and that extrapolated to the benchmark's batch."""
    batch, rows = SCALE[m]
    model = [*model, f"data.batch_size={batch}"]
    more = [marginal(run, model, [*extra, *log], *steps, warmup=2)[1].total() for log in (NO_LOG, EVERY_STEP)]
    row = (more[1] - more[0] - one) / (batch - 1)
    at = one + (rows - 1) * row
    return (f"a log step's extra {mb(one)} MB at batch 1, {mb(more[1] - more[0])} at batch {batch}: {mb(one - row)} "
            f"MB fixed + {mb(row)} MB a row of 32 tokens; at {rows} rows (8 x 1024 tokens) {mb(at)} MB, "
            f"{at / HBM * 1e3:.2f} ms at {HBM / 1e12} TB/s")


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
