"""Training over several processes: the process group, the strategy, and what each strategy changes.

``trainer.strategy``: ``auto`` (one process, or DDP under torchrun), ``ddp`` (DistributedDataParallel: the
gradients all-reduced) or ``fsdp`` (FSDP2 ``fully_shard`` on what ``trainer.fsdp.wrap`` matches, then the root,
right after the model is built). gloo on CPU, nccl on CUDA; rank 0 writes the run's files. What each strategy
changes for the hooks and the statistics: docs/internals.md, "Strategies", and docs/scale.md.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from hookexp.config import TrainerConfig
from hookexp.engine.schema import spec_name
from hookexp.errors import ConfigError, HookCompatibilityError, did_you_mean
from hookexp.run import launchers

STRATEGIES = ("auto", "ddp", "fsdp")
_GROUPS = itertools.count()  # process groups this process made (one per job of a multirun)

# Hook kinds that cannot work on FSDP2's DTensor parameters, and what to use instead (every other kind was
# checked against the unsharded model: tests/run/test_fsdp.py).
REFUSED_UNDER_FSDP = {
    "grad": ("FSDP2 replaces every parameter by a sharded DTensor, and Tensor.register_hook never fires on one "
             "(the gradient flows through the gathered copy, then is reduce-scattered into the shard)",
             "kind 'post_accumulate' (the shard of the reduced gradient, after backward) or 'pre_step' (the "
             "final gradient, right before optimizer.step())"),
}


@dataclass
class Dist:
    """This process's place among the ranks, and the strategy they train with."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "single"  # single | ddp | fsdp: what trainer.strategy resolved to
    owns_group: bool = False  # whether setup() made the process group (teardown destroys it)

    @property
    def enabled(self) -> bool:
        """Several ranks: their sums and their decisions to stop must be agreed on."""
        return self.world_size > 1

    @property
    def sharded(self) -> bool:
        """FSDP: every rank holds a shard of the parameters (and writes its shard of a checkpoint)."""
        return self.strategy == "fsdp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def place(self, device: torch.device) -> torch.device:
        """The device this rank trains on: under several ranks on CUDA, its own GPU (``cuda:LOCAL_RANK``); in a group
        of one, the GPU named, or the first (nccl and DDP need an index)."""
        if device.type != "cuda" or (not self.enabled and (self.strategy == "single" or device.index is not None)):
            return device
        return torch.device("cuda", self.local_rank)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks (a no-op on one process)."""
        if self.enabled:
            values = values.clone()
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether any rank says yes (so that every rank stops at the same step)."""
        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def vote(self, flag: bool, device: torch.device) -> torch.Tensor:
        """:meth:`any` on its way: a 1-element tensor on ``device``, 1 where any rank says yes, all-reduced behind
        the work queued so far (no host sync on CUDA; read it with the log step's other values)."""
        t = torch.full((1,), 1.0 if flag else 0.0, device=device)
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def all_true(self, flag: torch.Tensor) -> torch.Tensor:
        """A 0-d bool tensor that is true where it is true on every rank (one all-reduce, on the device)."""
        if not self.enabled:
            return flag
        t = flag.to(torch.int32).reshape(1)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t[0].bool()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a picklable object; one small collective)."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        if not self.enabled:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def params_in_sync(self, model: torch.nn.Module) -> bool:
        """Whether every rank holds the same parameters (compared through a sum and a sum of squares)."""
        flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
        mine = torch.stack([flat.sum(), (flat * flat).sum()])
        if not self.enabled:
            return True
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return bool(torch.equal(lo, hi))


def resolve_strategy(strategy: str, world_size: int) -> str:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}.{did_you_mean(str(strategy), STRATEGIES)} Use auto (one "
                          "process, or DDP under torchrun), ddp or fsdp.", key="trainer.strategy")
    if strategy == "auto":
        return "ddp" if world_size > 1 else "single"
    return strategy


def setup(device: torch.device, strategy: str = TrainerConfig.strategy) -> Dist:
    """Join the process group when launched by torchrun (or by submitit with several SLURM tasks); one process
    otherwise. ``ddp`` and ``fsdp`` in a single process train in a process group of one rank (FSDP on one GPU,
    for instance).

    The backend follows ``trainer.device``, not what the machine has: nccl with one GPU per process
    when it is CUDA, gloo otherwise (so ``trainer.device=cpu`` trains CPU ranks on a GPU machine too).
    """
    launchers.export_slurm_environment()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    resolved = resolve_strategy(strategy, world)
    if world <= 1 and resolved == "single":
        return Dist()
    if world <= 1:
        rank = local = 0
    else:
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", local + 1))
    if device.type == "cuda" and nproc > torch.cuda.device_count():
        raise ConfigError(f"torchrun started {nproc} processes on this node but it has "
                          f"{torch.cuda.device_count()} CUDA device(s), and each process trains on its own GPU. "
                          f"Use --nproc_per_node={torch.cuda.device_count()} or fewer, or trainer.device=cpu to "
                          f"train the ranks on the CPU (gloo).", key="trainer.device")
    ranks = Dist(rank, max(world, 1), local, resolved)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(ranks.place(device))
        if world <= 1:  # no torchrun: a group of one, in this process
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            join_group(backend)
        ranks.owns_group = True
    return ranks


def join_group(backend: str) -> None:
    """The process group of the ranks torchrun's variables describe (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Each group this process makes gets its own keys in the rendezvous store: the jobs of a multirun run one after
    another in the same processes, and a job would otherwise meet the previous job's stale addresses there."""
    store, rank, world = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"hookexp/{next(_GROUPS)}", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)


def teardown(d: Dist, wait: bool = True) -> None:
    """Leave the process group setup() made: after a barrier (every rank done), or at once after a failure.

    Then a pause without the GIL: gloo's worker threads free the last collective's state, which takes the GIL; a
    group destroyed later by DDP's reducer, which holds the GIL while it waits for those threads, would otherwise
    wait forever (pytorch#56297) — the next job of a multirun, in the same process, hung there."""
    if d.owns_group and dist.is_initialized():
        if wait:
            dist.barrier()
        time.sleep(0.05)
        dist.destroy_process_group()


@contextlib.contextmanager
def released_on_error(d: Dist) -> Iterator[None]:
    """A failure before training (a config or checkpoint error) leaves no process group behind: in a multirun the
    next job, in the same process, makes its own."""
    try:
        yield
    except BaseException:
        teardown(d, wait=False)
        raise


# ----------------------------------------------------------------------------------------------------
# Hook kinds under FSDP.


def engine_shards_gradients() -> bool:
    """Whether the engine hands a parameter kind's transform the local shard of a sharded (DTensor) gradient, with
    ``HookContext.sum_over_shards`` for whole-tensor quantities such as clip_norm's norm."""
    from hookexp.engine import HookContext

    return hasattr(HookContext, "sum_over_shards")


def refused_kinds() -> dict[str, tuple[str, str]]:
    """The kinds refused under ``fsdp``, with why and what to use instead."""
    refused = dict(REFUSED_UNDER_FSDP)
    if not engine_shards_gradients():
        why = ("this version's engine gives a parameter kind's transform the whole sharded gradient (a DTensor), on "
               "which batched transforms and the measuring of hook effects fail")
        instead = ("a module kind on the module that owns the parameter (output_grad sees the gradient of its "
                   "output), or trainer.clip_grad_norm for a clip by the global norm")
        refused.update(post_accumulate=(why, instead), pre_step=(why, instead))
    return refused


def refuse_kinds(specs: Mapping[str, Any] | Sequence[Any] | None, strategy: str) -> None:
    """Refuse, before anything is built, the enabled hook specs whose kind cannot work under ``strategy``
    (under ``fsdp``: :func:`refused_kinds`), naming each spec and the kind to use instead."""
    if strategy != "fsdp" or not specs:
        return
    kinds = refused_kinds()
    items = specs.items() if isinstance(specs, Mapping) else \
        ((spec_name(s), s) for s in specs if isinstance(s, Mapping))
    refused = [(str(name), str(spec.get("kind"))) for name, spec in items
               if isinstance(spec, Mapping) and spec.get("kind") in kinds and spec.get("enabled", True)]
    if not refused:
        return
    name, kind = refused[0]
    why, instead = kinds[kind]
    others = [f"hooks.{n} ({k})" for n, k in refused[1:]]
    also = f" The same holds for {', '.join(others)}." if others else ""
    raise HookCompatibilityError(f"kind {kind!r} cannot work under trainer.strategy=fsdp: {why}. Use {instead}; or "
                                 f"train with trainer.strategy=ddp.{also}", spec=name, field="kind")


# ----------------------------------------------------------------------------------------------------
# Sharding and wrapping.


def _modules(model: torch.nn.Module, pattern: str, key: str) -> list[tuple[str, torch.nn.Module]]:
    """The modules ``pattern`` names, with the hook target grammar (@aliases included); errors name ``key``."""
    from hookexp.engine import match

    try:
        return match(model, pattern, on="module", key=key)
    except ConfigError as e:  # the default ('@blocks') names no module of a model without blocks
        raise ConfigError(f"{e.message.rstrip()} Set {key} to a pattern of this model's modules, or "
                          f"{key}=null to shard the whole model as one unit.", key=key) from None


def shard(model: torch.nn.Module, trainer: DictConfig, ranks: Dist, device: torch.device,
          param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each module ``trainer.fsdp.wrap`` matches (innermost first), then the root, on a
    one-dimensional mesh of all ranks. Under ``trainer.precision=bf16/fp16`` the gathered parameters (forward
    and backward) are in that dtype and the gradients are reduced in float32; the sharded parameters, the
    optimizer and the statistics stay in float32. Called before anything holds the parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (ranks.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    options = {"mesh": mesh, "reshard_after_forward": bool(trainer.fsdp.reshard_after_forward), "mp_policy": policy}
    wrap = trainer.fsdp.wrap
    units = _modules(model, wrap, "trainer.fsdp.wrap") if wrap else []
    for _, module in reversed(units):  # named_modules order is outer first: shard the inner units first
        if module is not model:
            fully_shard(module, **options)
    fully_shard(model, **options)
    return model


def warn_pool_gradients(model: torch.nn.Module, trainer: DictConfig, device: torch.device) -> None:
    """torch 2.13's inductor on a CPU can give every layer before a MaxPool2d a zero gradient at some batch sizes
    (docs/training.md); warn where a run could meet it: a pool, inductor, the CPU, deterministic algorithms off."""
    if torch.__version__ >= (2, 13) and trainer.compile_backend == "inductor" and device.type == "cpu" and \
            not torch.are_deterministic_algorithms_enabled() and \
            any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules()):
        logging.getLogger("hookexp").warning(
            "trainer.compile=true: torch %s's inductor on a CPU can give every layer before a MaxPool2d a zero "
            "gradient at some batch sizes (an epoch's smaller last batch among them; docs/training.md). Set "
            "repro.deterministic=true, or trainer.compile_backend=aot_eager.", torch.__version__)


def wrap(model: torch.nn.Module, trainer: DictConfig, ranks: Dist, device: torch.device) -> torch.nn.Module:
    """What the loop calls forward on: the model under DDP (``ddp``), the sharded model itself (``fsdp``, sharded
    by :func:`shard` when it was built), compiled when asked. Hooks and probes are attached before this, so they
    keep their names and torch.compile sees them."""
    forward: torch.nn.Module = model
    # Under DDP, Dynamo compiles the frame of the model's own forward, called from DDP's forward; the forward of a
    # torch.nn container (nn.Sequential: small_cnn, mlp) is no frame it compiles, so the model ran eagerly (hooked
    # modules compiled one by one): such a model is compiled itself, then wrapped
    compile_inside = trainer.compile and ranks.strategy == "ddp" and \
        getattr(type(model).forward, "__module__", "").startswith("torch.nn.")
    if trainer.compile:
        warn_pool_gradients(model, trainer, device)
        # Dynamo's caches are the process's: an earlier run's graph of the same model class (a sweep's previous job,
        # traced with other hooks) would pass its guards and run without this run's hooks
        torch._dynamo.reset()
    if compile_inside:
        forward = torch.compile(forward, backend=trainer.compile_backend)
    if ranks.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(forward, device_ids=[device.index] if device.type == "cuda" else None)
    if trainer.compile and not compile_inside:
        forward = torch.compile(forward, backend=trainer.compile_backend)
    return forward
