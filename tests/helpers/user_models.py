"""A user's own model, as ``model._target_=user_models.Net`` names it (tests/helpers is on the path, as a user's
folder is on PYTHONPATH): a forward of its own (torch.compile compiles it and runs the model's hooks outside it),
a ModuleList of residual blocks called with a keyword argument, a LayerNorm and a head, on digits' 8x8 images."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.act(self.lin(x))


class Net(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 32, depth: int = 2, in_features: int = 64):
        super().__init__()
        self.embed = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.flatten(1))
        for block in self.blocks:
            h = block(h, scale=0.5)
        return self.head(self.norm(h))
