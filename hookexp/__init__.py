"""hookexp: declarative PyTorch hook experiments.

The library API (no Hydra, no W&B)::

    from hookexp import attach
    with attach(model, {"clamp": {"target": "conv", "kind": "output_grad",
                                  "transform": "clamp", "args": {"min": 0.0}}}) as hooks:
        model(x).sum().backward()
    hooks.stats()

The command line (``python -m hookexp``) lives in :mod:`hookexp.cli`.
"""

from hookexp.engine import HookHandle, attach
from hookexp.errors import (
    ConfigError,
    HookCheckError,
    HookCompatibilityError,
    HookexpError,
    HookRuntimeError,
    SpecError,
    TargetError,
    TransformArgsError,
    TransformOutputError,
)
from hookexp.kinds import KINDS, register_kind
from hookexp.specs import HookSpec, parse_specs
from hookexp.transforms import TRANSFORMS, HookContext, Record, register_transform
from hookexp.validate import ValidationReport, validate

__version__ = "0.1.0"

__all__ = [
    "KINDS",
    "TRANSFORMS",
    "ConfigError",
    "HookCheckError",
    "HookCompatibilityError",
    "HookContext",
    "HookHandle",
    "HookRuntimeError",
    "HookSpec",
    "HookexpError",
    "Record",
    "SpecError",
    "TargetError",
    "TransformArgsError",
    "TransformOutputError",
    "ValidationReport",
    "attach",
    "parse_specs",
    "register_kind",
    "register_transform",
    "validate",
]
