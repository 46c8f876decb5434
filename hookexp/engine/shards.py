"""FSDP2 shards: a DTensor gradient's local shard and the process groups to sum whole-tensor quantities over."""

from __future__ import annotations

from typing import Any

import torch


class Shards:
    """The process groups a DTensor gradient is sharded over (FSDP2): a transform that acts on this rank's shard
    sums a whole-tensor quantity (a squared norm) over them, one all-reduce."""

    def __init__(self, groups: list[Any], numel: int = 0):
        self.groups = groups
        self.numel = numel  # the whole tensor's elements

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.clone()
        for group in self.groups:
            dist.all_reduce(t, group=group)
        return t


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor (a view); a plain tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]


def local_shard(t: torch.Tensor) -> tuple[torch.Tensor, Shards | None]:
    """A DTensor's local shard (a view: writing it writes the DTensor) and its shard groups; a plain tensor as is."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return t, None
    mesh = t.device_mesh  # type: ignore[attr-defined]
    groups = [mesh.get_group(i) for i, p in enumerate(placements) if p.is_shard()]
    return t.to_local(), (Shards(groups, t.numel()) if groups else None)  # type: ignore[attr-defined]
