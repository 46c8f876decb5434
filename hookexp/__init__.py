"""hookexp: declarative PyTorch hook experiments.

The library API (no Hydra, no W&B)::

    from hookexp import attach
    with attach(model, {"clamp": {"target": "conv", "kind": "output_grad",
                                  "transform": "clamp", "args": {"min": 0.0}}}) as hooks:
        model(x).sum().backward()
    hooks.stats()

The command line (``python -m hookexp``) lives in :mod:`hookexp.cli`. Names are imported on first use
(PEP 562), so that ``import hookexp`` — and the CLI's ``--help`` — does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "attach": "hookexp.engine", "HookHandle": "hookexp.engine", "validate": "hookexp.validate",
    "ValidationReport": "hookexp.validate", "KINDS": "hookexp.kinds", "register_kind": "hookexp.kinds",
    "HookSpec": "hookexp.specs", "parse_specs": "hookexp.specs", "TRANSFORMS": "hookexp.transforms",
    "HookContext": "hookexp.transforms", "Record": "hookexp.transforms", "register_transform": "hookexp.transforms",
    **{name: "hookexp.errors" for name in (
        "ConfigError", "HookCheckError", "HookCompatibilityError", "HookexpError", "HookRuntimeError", "SpecError",
        "TargetError", "TransformArgsError", "TransformOutputError", "CheckpointError", "NonFiniteError",
        "RunDirError", "RunFilesError")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hookexp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
