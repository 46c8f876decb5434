"""hookexp: declarative PyTorch hook experiments. The library API (no Hydra, no W&B)::

    from hookexp import attach
    with attach(model, {"clamp": {"target": "conv", "kind": "output_grad",
                                  "transform": "clamp", "args": {"min": 0.0}}}) as hooks:
        model(x).sum().backward()
    hooks.stats()

``hookexp.watch(model, optimizer, every=10, log=wandb.run)`` logs the trainer's statistics from any loop; the
command line is :mod:`hookexp.cli`. Names load on first use: ``import hookexp`` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    **dict.fromkeys(("HookHandle", "attach", "check_on_batch", "ValidationReport", "match", "KINDS", "register_kind",
                     "HookSpec", "parse_specs", "TRANSFORMS", "HookContext", "Record", "Transform",
                     "register_transform", "register_transform_alias", "register_aliases"), "hookexp.engine"),
    **dict.fromkeys(("ConfigError", "HookCheckError", "HookCompatibilityError", "HookexpError", "HookRuntimeError",
                     "RegistryError", "SpecError", "SpecErrors", "TargetError", "TransformArgsError",
                     "TransformOutputError", "HookWarning", "CheckpointError", "MissingExtraError", "NonFiniteError",
                     "RunDirError", "RunFilesError"), "hookexp.errors"),
    **dict.fromkeys(("watch", "Watch"), "hookexp.telemetry.watch"),
    "replay": "hookexp.run.replay",
}

__all__ = [
    "KINDS",
    "TRANSFORMS",
    "CheckpointError",
    "ConfigError",
    "HookCheckError",
    "HookCompatibilityError",
    "HookContext",
    "HookHandle",
    "HookRuntimeError",
    "HookSpec",
    "HookWarning",
    "HookexpError",
    "MissingExtraError",
    "NonFiniteError",
    "Record",
    "RegistryError",
    "RunDirError",
    "RunFilesError",
    "SpecError",
    "SpecErrors",
    "TargetError",
    "Transform",
    "TransformArgsError",
    "TransformOutputError",
    "ValidationReport",
    "Watch",
    "attach",
    "check_on_batch",
    "match",
    "parse_specs",
    "register_aliases",
    "register_kind",
    "register_transform",
    "register_transform_alias",
    "replay",
    "watch",
]

if TYPE_CHECKING:
    from hookexp.engine import (
        KINDS,
        TRANSFORMS,
        HookContext,
        HookHandle,
        HookSpec,
        Record,
        Transform,
        ValidationReport,
        attach,
        check_on_batch,
        match,
        parse_specs,
        register_aliases,
        register_kind,
        register_transform,
        register_transform_alias,
    )
    from hookexp.errors import (
        CheckpointError,
        ConfigError,
        HookCheckError,
        HookCompatibilityError,
        HookexpError,
        HookRuntimeError,
        HookWarning,
        MissingExtraError,
        NonFiniteError,
        RegistryError,
        RunDirError,
        RunFilesError,
        SpecError,
        SpecErrors,
        TargetError,
        TransformArgsError,
        TransformOutputError,
    )
    from hookexp.run.replay import replay
    from hookexp.telemetry.watch import Watch, watch


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hookexp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
