"""``trainer.precision``: autocast, the fp16 GradScaler, and the unscale before the update."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ClassVar

import torch

from hookexp.errors import ConfigError, did_you_mean

log = logging.getLogger("hookexp.build")  # where the fp16 warning was logged before precision had its module

DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class MixedPrecision:
    """``trainer.precision``: autocast in bf16 or fp16; fp16 scales the loss with a GradScaler and unscales the
    gradients before ``optimizer.step()``, so that ``pre_step`` hooks, the guard and the statistics see true
    gradients. ``grad``-kind hooks run inside backward and see scaled ones: a value-dependent transform there gets
    a warning naming ``pre_step``. The scaler's state (its scale) is part of a checkpoint."""

    DTYPES: ClassVar[dict[str, torch.dtype | None]] = DTYPES

    def __init__(self, precision: str, device: torch.device, hooks: Any):
        if precision not in self.DTYPES:
            raise ConfigError(f"unknown precision {precision!r}.{did_you_mean(str(precision), self.DTYPES)} Use fp32, "
                              "bf16 or fp16.", key="trainer.precision")
        self.device_type = device.type
        self.dtype = self.DTYPES[precision]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        if self.scaler is not None:
            for b in hooks.bindings:
                if b.kind.stage == "backward" and b.transform.value_dependent and b.spec.enabled:
                    log.warning("hooks.%s: with trainer.precision=fp16 the gradients a %r hook sees are multiplied by "
                                "the GradScaler's scale, so %r acts on scaled values. Use kind 'pre_step' to act on "
                                "the unscaled gradient.", b.spec.name, b.spec.kind, b.transform.name)

    def autocast(self) -> Any:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skips the update (and the hooks' step) when gradients overflowed
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
