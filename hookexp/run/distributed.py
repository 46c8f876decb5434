"""Data-parallel training under ``torchrun``: process group, sampler, reductions, rank-0-only output.

``torchrun --nproc_per_node=N -m hookexp ...`` sets WORLD_SIZE/RANK/LOCAL_RANK; the trainer then
trains with DistributedDataParallel (gloo on CPU, nccl on GPU). Hooks are attached to the model
*before* it is wrapped, so targets keep their names and:

- ``grad`` and ``post_accumulate`` hooks run before DDP's all-reduce: they see each rank's local
  gradient (a clamp there clamps each rank's gradient, and the ranks' results are then averaged);
- ``pre_step`` hooks and the gradient statistics see the averaged gradient, identical on every rank.

Loss and accuracy are summed over ranks on log steps; only rank 0 writes files and logs to W&B.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hookexp.errors import ConfigError


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def place(self, device: torch.device) -> torch.device:
        """The device this rank trains on: under DDP on CUDA, its own GPU (``cuda:LOCAL_RANK``)."""
        return torch.device("cuda", self.local_rank) if self.enabled and device.type == "cuda" else device

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


def setup(device: torch.device) -> Dist:
    """Join the process group when launched by torchrun; one process otherwise.

    The backend follows ``trainer.device``, not what the machine has: nccl with one GPU per process
    when it is CUDA, gloo otherwise (so ``trainer.device=cpu`` trains CPU ranks on a GPU machine too).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", local + 1))
    if device.type == "cuda" and nproc > torch.cuda.device_count():
        raise ConfigError(f"torchrun started {nproc} processes on this node but it has "
                          f"{torch.cuda.device_count()} CUDA device(s), and each process trains on its own GPU. "
                          f"Use --nproc_per_node={torch.cuda.device_count()} or fewer, or trainer.device=cpu to "
                          f"train the ranks on the CPU (gloo).", key="trainer.device")
    ranks = Dist(rank, world, local)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(ranks.place(device))
        dist.init_process_group(backend=backend)
    return ranks


def teardown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
