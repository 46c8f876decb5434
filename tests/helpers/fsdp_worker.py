"""Every hook kind on the package's GPT sharded with FSDP2, against the same model unsharded.

    torchrun --nproc_per_node=2 tests/helpers/fsdp_worker.py OUT.json

Each rank trains a sharded copy (:func:`hookexp.run.distributed.shard`, ``blocks.N`` as units, then the root) on
its half of every batch, with one hook set attached to the sharded model; rank 0 also trains the unsharded model
on the whole batches with the same hooks (what one process would do), and a third copy with no hooks at all.
Three SGD steps, hook effects measured on the first (as on a log step), not on the others. The transforms are
chosen so that the unsharded result is the exact target: the sharded ranks see the gradients of their own half
batch (twice the whole batch's per example, since each rank's loss is a mean over its half), so the module-side
transforms are positively homogeneous (scale, clamp at 0); the parameter kinds act after the reduction, on the
averaged gradient's shard, as the unsharded ones act on the whole batch's gradient.

Rank 0 writes, per case: the losses of both runs, the largest parameter difference between them and between the
hooked and the hook-free unsharded runs (the hooks must matter), each run's hook calls and hook effects (rank 0's:
under FSDP they must describe the whole tensors, not its shards), or the error.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from hookexp.engine import attach
from hookexp.run.distributed import Dist, shard
from hookexp.workloads.models import GPT

VOCAB, T, STEPS = 16, 8, 3
CASES = {
    "forward_pre": {"target": "blocks.1.mlp", "kind": "forward_pre", "transform": "scale", "args": {"factor": 0.5}},
    "forward": {"target": "blocks.0.attn", "kind": "forward", "transform": "scale", "args": {"factor": 0.5}},
    "forward_on_unit": {"target": "blocks.1", "kind": "forward", "transform": "scale", "args": {"factor": 0.5}},
    "output_grad": {"target": "blocks.*.mlp", "kind": "output_grad", "transform": "clamp", "args": {"min": 0.0}},
    "backward": {"target": "blocks.0.mlp", "kind": "backward", "transform": "scale", "args": {"factor": 0.5}},
    "backward_on_unit": {"target": "blocks.1", "kind": "backward", "transform": "scale", "args": {"factor": 0.5}},
    "backward_pre_on_unit": {"target": "blocks.1", "kind": "backward_pre", "transform": "scale",
                             "args": {"factor": 0.5}},
    "backward_legacy": {"target": "blocks.1.mlp.fc", "kind": "backward_legacy", "transform": "scale",
                        "args": {"factor": 0.5}},
    "node": {"target": "blocks.1.attn", "kind": "node", "transform": "scale", "args": {"factor": 0.5}},
    "node_pre_on_unit": {"target": "blocks.0", "kind": "node_pre", "transform": "scale", "args": {"factor": 0.5}},
    "post_accumulate_clamp": {"target": "*.weight", "kind": "post_accumulate", "transform": "clamp",
                              "args": {"min": -0.01, "max": 0.01}},
    "post_accumulate_clip_norm": {"target": "*.weight", "kind": "post_accumulate", "transform": "clip_norm",
                                  "args": {"max_norm": 0.05}},
    "pre_step_clamp": {"target": "*", "kind": "pre_step", "transform": "clamp", "args": {"min": -0.01, "max": 0.01}},
    "pre_step_clip_norm": {"target": "*", "kind": "pre_step", "transform": "clip_norm", "args": {"max_norm": 0.05}},
}
FSDP = OmegaConf.create({"fsdp": {"wrap": "blocks.?", "reshard_after_forward": True}})


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, d_model=32)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (4, T), generator=gen), torch.randint(0, VOCAB, (4, T), generator=gen))
            for _ in range(STEPS)]


def train(net: torch.nn.Module, spec: dict | None, part: slice, world: int) -> tuple[list[float], dict, dict]:
    """STEPS SGD steps on rows ``part`` of each batch; the losses (averaged over ranks), the hooks' calls and what
    they did on the measured step (change_norm, cosine, frac_changed)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    hooks = attach(net, {"h": spec} if spec else {}, opt, measure=False)
    losses = []
    for i, (x, y) in enumerate(batches()):
        hooks.measuring = i == 0
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x[part]).reshape(-1, VOCAB), y[part].reshape(-1))
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    stats = hooks.stats()
    calls = {name: row["calls"] for name, row in stats.items()}
    effects = {name: {k: row[k] for k in ("change_norm", "cosine", "frac_changed") if k in row}
               for name, row in stats.items()}
    hooks.remove()
    return losses, calls, effects


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = Dist(rank, world, rank, "fsdp")
    results = {}
    for case, spec in CASES.items():
        row: dict = {}
        try:
            sharded = shard(model(), FSDP, ranks, torch.device("cpu"))
            row["sharded_losses"], row["sharded_calls"], row["sharded_effects"] = train(
                sharded, spec, slice(2 * rank, 2 * rank + 2), world)
            params = {n: full(p.detach()) for n, p in sharded.named_parameters()}
            if rank == 0:
                plain, bare = model(), model()
                row["losses"], row["calls"], row["effects"] = train(plain, spec, slice(0, 4), 1)
                train(bare, None, slice(0, 4), 1)
                ref = dict(plain.named_parameters())
                row["param_diff"] = max(float((params[n] - ref[n].detach()).abs().max()) for n in ref)
                row["hook_effect"] = max(float((p - q).detach().abs().max()) for p, q in zip(plain.parameters(),
                                                                                   bare.parameters(), strict=True))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()
        results[case] = row
        dist.barrier()
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
