"""The Lightning and ``transformers`` scaffolding the callback tests share, each around a plain torch model whose
children it takes over (so the parameter names are the model's): a LightningModule, a logger that keeps the rows
of hookexp's log steps, and a HF Trainer over fixed batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def lightning_module(net: nn.Module, loss: Callable[[Any, Any], torch.Tensor],
                     optimizer: Callable[[Any], torch.optim.Optimizer]) -> Any:
    """A LightningModule whose ``forward`` is ``net``'s, ``training_step`` returns ``loss(module, batch)``,
    and ``configure_optimizers`` returns ``optimizer(parameters)``."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            for name, child in net.named_children():
                self.add_module(name, child)

        def forward(self, x):
            return net(x)

        def training_step(self, batch, i):
            return loss(self, batch)

        def configure_optimizers(self):
            return optimizer(self.parameters())

    return Module()


def capture_logger() -> Any:
    """A Lightning logger keeping the rows hookexp logs (those with ``trainer/step``) by step in ``.rows``."""
    from lightning.pytorch.loggers import Logger

    class Capture(Logger):
        name, version = "capture", 0

        def __init__(self):
            super().__init__()
            self.rows: dict[int, dict] = {}

        def log_metrics(self, metrics, step=None):
            if "trainer/step" in metrics:
                self.rows[step] = metrics

        def log_hyperparams(self, *args, **kwargs):
            pass

    return Capture()


def hf_model(net: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> nn.Module:
    """What a HF Trainer wants of ``net``: a mapping in (``x``, ``labels``), ``{"loss": loss(net(x), x, labels)}``
    out."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            for name, child in net.named_children():
                self.add_module(name, child)

        def forward(self, x, labels):
            return {"loss": loss(net(x), x, labels)}

    return Wrapper()


def hf_trainer(batches: list[tuple[torch.Tensor, torch.Tensor]], **kwargs: Any) -> Any:
    """A ``transformers.Trainer`` that trains on ``batches`` (pairs of x and labels) as they are."""
    import transformers

    class Batches(transformers.Trainer):
        def get_train_dataloader(self):
            return torch.utils.data.DataLoader([{"x": x, "labels": y} for x, y in batches], batch_size=None)

    return Batches(**kwargs)
