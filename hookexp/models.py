"""The models the configs name. Each is an ``nn.Sequential`` with named children, so hook targets
read like the architecture (``conv1``, ``relu1``, ``fc1.bias``) and globs such as ``conv*`` or
``fc*.bias`` work across models. Input shape and class count come from the data config.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn


class SmallCNN(nn.Sequential):
    """Two 3x3 conv layers and two linear layers: the default model for 8x8 digits (~40k parameters)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8, width: int = 16,
                 hidden: int = 64):
        pooled = image_size // 2
        super().__init__(OrderedDict([
            ("conv1", nn.Conv2d(in_channels, width, 3, padding=1)),
            ("relu1", nn.ReLU()),
            ("conv2", nn.Conv2d(width, 2 * width, 3, padding=1)),
            ("relu2", nn.ReLU()),
            ("pool", nn.MaxPool2d(2)),
            ("flatten", nn.Flatten()),
            ("fc1", nn.Linear(2 * width * pooled * pooled, hidden)),
            ("relu3", nn.ReLU()),
            ("fc2", nn.Linear(hidden, num_classes)),
        ]))


class MLP(nn.Sequential):
    """``depth`` linear layers of ``width`` units with ReLU between them (``fc1`` ... ``fc<depth>``).

    ``init_std`` (when set) draws every weight from N(0, init_std^2) and zeroes the biases: a badly
    initialised deep network for gradient-noise studies. ``norm="layer"`` puts a LayerNorm
    (``norm<i>``) after every hidden linear layer.
    """

    def __init__(self, in_channels: int = 1, image_size: int = 8, num_classes: int = 10, depth: int = 3,
                 width: int = 128, init_std: float | None = None, norm: str | None = None):
        if norm not in (None, "layer"):
            raise ValueError(f"model.norm must be null or 'layer', got {norm!r}")
        if depth < 1:
            raise ValueError(f"model.depth must be at least 1, got {depth}")
        layers: list[tuple[str, nn.Module]] = [("flatten", nn.Flatten())]
        fan_in = in_channels * image_size * image_size
        for i in range(1, depth):
            layers.append((f"fc{i}", nn.Linear(fan_in, width)))
            if norm == "layer":
                layers.append((f"norm{i}", nn.LayerNorm(width)))
            layers.append((f"relu{i}", nn.ReLU()))
            fan_in = width
        layers.append((f"fc{depth}", nn.Linear(fan_in, num_classes)))
        super().__init__(OrderedDict(layers))
        if init_std is not None:
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=init_std)
                    nn.init.zeros_(m.bias)


class SeedNet(nn.Sequential):
    """The network of the seed example: Conv2d(3, 10, k=2, s=2) -> ReLU -> flatten -> Linear(160, 5)
    on 3x8x8 inputs (channels, classes and size follow the data config)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 5, image_size: int = 8):
        side = image_size // 2
        super().__init__(OrderedDict([
            ("conv", nn.Conv2d(in_channels, 10, kernel_size=2, stride=2)),
            ("relu", nn.ReLU()),
            ("flatten", nn.Flatten()),
            ("fc1", nn.Linear(10 * side * side, num_classes)),
        ]))


class PatchTransformer(nn.Module):
    """A small pre-norm transformer encoder for images: each row of pixels is a token.

    ``embed`` (Linear) -> ``layers.<i>`` (nn.TransformerEncoderLayer: ``self_attn``, ``linear1``,
    ``linear2``, ``norm1``, ``norm2``) -> mean over tokens -> ``head``. Targets such as
    ``re:^layers\\.\\d+\\.self_attn$`` reach every attention block.
    """

    def __init__(self, in_channels: int = 1, image_size: int = 8, num_classes: int = 10, d_model: int = 128,
                 depth: int = 4, heads: int = 4, ff: int = 256):
        super().__init__()
        self.embed = nn.Linear(in_channels * image_size, d_model)
        self.pos = nn.Parameter(torch.zeros(1, image_size, d_model))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(depth))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = self.embed(x.permute(0, 2, 1, 3).reshape(b, h, c * w)) + self.pos
        for layer in self.layers:
            tokens = layer(tokens)
        return self.head(self.norm(tokens).mean(dim=1))
