"""The hook engine: specs in, torch hooks attached, one handle that owns and removes them. Other layers use it
only through these names; importing it imports no torch (names load on first use)::

    attach(model, specs, optimizer=None, *, measure="read") -> HookHandle
    output_hooks(model, pattern, fn, *, key, phase="train", on=True) -> OutputHooks   (instruments: no spec)
    check_on_batch(model, specs, example_batch, optimizer=None, loss_fn=None, *, forward=None) -> ValidationReport
    match(model, pattern, on="module" | "parameter", key="stats.grads") -> [(name, module or parameter)]
    register_transform / register_transform_alias / register_kind / register_aliases (decorators/functions)
    Transform(fn, batched=fn_)  HookContext  Record  HookSpec  parse_specs  KINDS  TRANSFORMS  ALIASES
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "attach": "handle", "HookHandle": "handle",
    "SpecBinding": "binding", "Site": "binding",
    "check_on_batch": "dryrun", "ValidationReport": "dryrun",
    "output_hooks": "observe", "OutputHooks": "observe",
    "match": "targets", "Target": "targets", "resolve": "targets",
    "register_aliases": "aliases", "ALIASES": "aliases",
    "register_kind": "kinds", "KINDS": "kinds",
    "register_transform": "transforms", "register_transform_alias": "transforms", "Transform": "bound",
    "HookContext": "context", "Record": "context", "TRANSFORMS": "transforms",
    "parse_specs": "specs",
    "HookSpec": "schema", "KIND_DOCS": "schema",
}

__all__ = [
    "ALIASES",
    "KINDS",
    "KIND_DOCS",
    "TRANSFORMS",
    "HookContext",
    "HookHandle",
    "HookSpec",
    "OutputHooks",
    "Record",
    "Site",
    "SpecBinding",
    "Target",
    "Transform",
    "ValidationReport",
    "attach",
    "check_on_batch",
    "match",
    "output_hooks",
    "parse_specs",
    "register_aliases",
    "register_kind",
    "register_transform",
    "register_transform_alias",
    "resolve",
]

if TYPE_CHECKING:
    from hookexp.engine.aliases import ALIASES, register_aliases
    from hookexp.engine.binding import Site, SpecBinding
    from hookexp.engine.bound import Transform
    from hookexp.engine.context import HookContext, Record
    from hookexp.engine.dryrun import ValidationReport, check_on_batch
    from hookexp.engine.handle import HookHandle, attach
    from hookexp.engine.kinds import KINDS, register_kind
    from hookexp.engine.observe import OutputHooks, output_hooks
    from hookexp.engine.schema import KIND_DOCS, HookSpec
    from hookexp.engine.specs import parse_specs
    from hookexp.engine.targets import Target, match, resolve
    from hookexp.engine.transforms import TRANSFORMS, register_transform, register_transform_alias


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hookexp.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hookexp.engine.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
