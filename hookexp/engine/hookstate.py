"""A transform's state (``ctx.state``) as a checkpoint keeps it: tensors, numbers, strings and dicts only, a
generator as its device and state, so that ``torch.load(weights_only=True)`` reads it back."""

from __future__ import annotations

from typing import Any

import torch

from hookexp.errors import HookRuntimeError


def generator(device: str, state: torch.Tensor) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.set_state(state)
    return gen



def save_state(value: Any, spec: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, torch.Generator):
        return {"__generator__": str(value.device), "state": value.get_state()}
    if isinstance(value, dict):
        return {str(k): save_state(v, spec) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [save_state(v, spec) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise HookRuntimeError(f"the transform's state holds a {type(value).__name__}, which a checkpoint cannot keep "
                           "(keep tensors, numbers, strings, generators and dicts of them in ctx.state).",
                           spec=spec, field="transform")



def load_state(value: Any) -> Any:
    if isinstance(value, dict):
        if "__generator__" in value:
            return generator(value["__generator__"], value["state"])
        return {k: load_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [load_state(v) for v in value]
    return value

