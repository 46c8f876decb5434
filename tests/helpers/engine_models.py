"""Small models for the engine tests, written as the real ones are (importable as `engine_models`).

- :class:`GPT`: the module names ARCHITECTURE.md fixes for ``hookexp.workloads.models.GPT`` (embed, pos_embed,
  blocks.N.{ln1, attn.{qkv, proj}, ln2, mlp.{fc, act, proj}}, norm, head), its blocks calling ``attn``
  with a keyword argument; a stand-in until the package's model lands, so the alias table is keyed on
  the same names.
- :class:`KwModel`: a submodule called with keyword arguments only, and a ``ModelOutput``-like return
  (an ``OrderedDict`` subclass read by attribute), as transformers' modules are.
- :class:`BasicBlock`: torchvision's ResNet block (bn1 -> in-place ReLU, ``out += identity``), by hand.
"""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_mlp: int):
        super().__init__()
        self.fc = nn.Linear(d_model, d_mlp)
        self.act = nn.GELU()
        self.proj = nn.Linear(d_mlp, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, 4 * d_model)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attention_mask=attention_mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 17, block_size: int = 8, n_layer: int = 2, n_head: int = 4,
                 d_model: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos_embed(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x, attention_mask=attention_mask)
        return self.head(self.norm(x))


class Output(OrderedDict):
    """What transformers' ModelOutput is to its callers: a mapping whose fields are also attributes."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


@dataclass
class DataOut:
    hidden: torch.Tensor
    extra: torch.Tensor


Pair = namedtuple("Pair", ["hidden", "gate"])


class Inner(nn.Module):
    def __init__(self, d: int = 6):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, hidden_states: torch.Tensor, scale: float = 1.0, gate: torch.Tensor | None = None) -> Output:
        h = self.lin(hidden_states) * scale
        if gate is not None:
            h = h * gate
        return Output(last_hidden_state=h, pooled=h.mean(dim=1))


class KwModel(nn.Module):
    """Calls ``inner`` with keywords only and reads its output by attribute."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.inner = Inner(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> Output:
        out = self.inner(hidden_states=x, scale=2.0, gate=torch.sigmoid(x))
        return Output(logits=self.head(out.last_hidden_state) + out.pooled.unsqueeze(1).sum(-1, keepdim=True))


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock, by hand (torchvision does not install here)."""

    def __init__(self, planes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out += identity
        return self.relu(out)


class ResNetish(nn.Module):
    def __init__(self, planes: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(1, planes, 3, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(planes), BasicBlock(planes))
        self.fc = nn.Linear(planes, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer1(self.stem(x)).mean(dim=(2, 3)))
