"""hookexp: declarative PyTorch hook experiments.

The library API (no Hydra, no W&B)::

    from hookexp import attach
    with attach(model, {"clamp": {"target": "conv", "kind": "output_grad",
                                  "transform": "clamp", "args": {"min": 0.0}}}) as hooks:
        model(x).sum().backward()
    hooks.stats()
    # forward kinds act in the module mode their phase names: "train" (default), "eval" (analysis) or "both"
    with torch.no_grad(), attach(model.eval(), {"ablate": {"target": "@attn", "kind": "forward", "transform": "zero",
                                                           "phase": "eval"}}):
        logits = model(x)

    hookexp.watch(model, optimizer, every=10, log=wandb.run)   # the trainer's statistics in any loop

The command line (``python -m hookexp``) lives in :mod:`hookexp.cli`. Names load on first use (PEP 562),
so ``import hookexp`` and the CLI's ``--help`` import no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    **dict.fromkeys(("HookHandle", "attach", "validate", "ValidationReport", "match", "KINDS", "register_kind",
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
    "match",
    "parse_specs",
    "register_aliases",
    "register_kind",
    "register_transform",
    "register_transform_alias",
    "replay",
    "validate",
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
        match,
        parse_specs,
        register_aliases,
        register_kind,
        register_transform,
        register_transform_alias,
        validate,
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
