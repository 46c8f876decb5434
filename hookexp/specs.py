"""Hook specs: the user's interface, parsed and checked before anything touches a model.

A spec says *where* (``target`` + ``types`` / ``exclude``), *when in forward/backward* (``kind``),
*what* (``transform`` + ``args``) and *on which steps* (``enabled``, ``every``, ``start_step``,
``end_step``, ``phase``). Specs come as a mapping ``{name: spec}`` (what Hydra merges) or as a list
(names default to ``<kind>:<target>``). Parsing is strict: an unknown field, a wrong type or an
unknown kind/transform is a :class:`~hookexp.errors.SpecError` that names the key and the fix, so
that a typo never silently turns a hook off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hookexp.errors import SpecError, did_you_mean
from hookexp.kinds import KINDS
from hookexp.transforms import TRANSFORMS

PHASES = ("train", "eval", "both")


@dataclass(frozen=True)
class HookSpec:
    """One declared hook. Field names are the config keys of ``hooks.<name>``."""

    name: str
    target: str
    kind: str
    transform: str | Mapping[str, Any] = "identity"
    args: Mapping[str, Any] = field(default_factory=dict)
    enabled: bool = True
    every: int = 1
    start_step: int = 0
    end_step: int | None = None
    phase: str = "train"
    types: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    optional: bool = False
    index: int | None = None

    def active_at(self, step: int) -> bool:
        """Whether the schedule (window and ``every``) lets the hook act on training step ``step``."""
        if step < self.start_step or (self.end_step is not None and step >= self.end_step):
            return False
        return (step - self.start_step) % self.every == 0

    def allows_phase(self, training: bool) -> bool:
        return self.phase == "both" or (self.phase == "train") == training


SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(HookSpec) if f.name != "name")
_REQUIRED = ("target", "kind")


def _check_type(name: str, key: str, value: Any, types: tuple[type, ...], what: str) -> None:
    # bool is an int in Python; a spec that says `every: true` is a typo, not 1.
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        raise SpecError(f"expected {what}, got {value!r} ({type(value).__name__}).", spec=name, field=key)


def _str_tuple(name: str, key: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SpecError(f"expected a list of strings, got {value!r}.", spec=name, field=key)


def parse_spec(name: str, raw: Mapping[str, Any] | HookSpec) -> HookSpec:
    """Check one raw spec mapping and turn it into a :class:`HookSpec`."""
    if isinstance(raw, HookSpec):
        return raw if raw.name == name else dataclasses.replace(raw, name=name)
    if not isinstance(raw, Mapping):
        raise SpecError(
            f"a hook spec must be a mapping with at least 'target' and 'kind', got {raw!r}. "
            f"Write it as `{name}: {{target: conv, kind: output_grad, transform: clamp, args: {{min: 0}}}}`.",
            spec=name,
        )
    raw = dict(raw)
    raw.pop("name", None)
    for key in raw:
        if key not in SPEC_FIELDS:
            raise SpecError(
                f"unknown field {key!r}.{did_you_mean(key, SPEC_FIELDS)} "
                f"A spec has the fields: {', '.join(SPEC_FIELDS)}.",
                spec=name,
                field=key,
            )
    for key in _REQUIRED:
        if raw.get(key) is None:
            raise SpecError(
                f"missing required field {key!r}. Every spec needs 'target' (a module or parameter name, "
                f"glob or re: pattern) and 'kind' (one of {', '.join(KINDS)}).",
                spec=name,
                field=key,
            )
    _check_type(name, "target", raw["target"], (str,), "a string (exact name, glob, or 're:' regex)")
    kind = raw["kind"]
    _check_type(name, "kind", kind, (str,), "a kind name")
    if kind not in KINDS:
        raise SpecError(
            f"unknown kind {kind!r}.{did_you_mean(kind, KINDS)} Known kinds: {', '.join(KINDS)}.",
            spec=name,
            field="kind",
        )
    transform = raw.get("transform", "identity")
    if isinstance(transform, str):
        if transform not in TRANSFORMS:
            raise SpecError(
                f"unknown transform {transform!r}.{did_you_mean(transform, TRANSFORMS)} "
                f"Known transforms: {', '.join(sorted(TRANSFORMS))}; or give a user function as "
                "{_target_: my_pkg.my_module.my_fn}.",
                spec=name,
                field="transform",
            )
    elif isinstance(transform, Mapping):
        if not isinstance(transform.get("_target_"), str):
            raise SpecError(
                "a user transform must be a mapping with '_target_' naming an importable callable, "
                f"e.g. {{_target_: my_pkg.my_module.my_fn}}; got {dict(transform)!r}.",
                spec=name,
                field="transform",
            )
    else:
        raise SpecError(
            f"expected a transform name or {{_target_: ...}}, got {transform!r}.", spec=name, field="transform"
        )
    args = raw.get("args") or {}
    if not isinstance(args, Mapping):
        raise SpecError(f"expected a mapping of keyword arguments, got {args!r}.", spec=name, field="args")
    for key, types, what in (
        ("enabled", (bool,), "true or false"),
        ("optional", (bool,), "true or false"),
        ("every", (int,), "a positive integer"),
        ("start_step", (int,), "a non-negative integer"),
    ):
        if key in raw:
            _check_type(name, key, raw[key], types, what)
    for key in ("end_step", "index"):
        if raw.get(key) is not None:
            _check_type(name, key, raw[key], (int,), "an integer or null")
    if raw.get("every", 1) < 1:
        raise SpecError(f"must be at least 1, got {raw['every']}.", spec=name, field="every")
    if raw.get("start_step", 0) < 0:
        raise SpecError(f"must be non-negative, got {raw['start_step']}.", spec=name, field="start_step")
    if raw.get("end_step") is not None and raw["end_step"] <= raw.get("start_step", 0):
        raise SpecError(
            f"end_step ({raw['end_step']}) must be greater than start_step ({raw.get('start_step', 0)}): "
            "the window [start_step, end_step) would be empty.",
            spec=name,
            field="end_step",
        )
    phase = raw.get("phase", "train")
    if phase not in PHASES:
        raise SpecError(
            f"unknown phase {phase!r}.{did_you_mean(str(phase), PHASES)} Use one of: {', '.join(PHASES)}.",
            spec=name,
            field="phase",
        )
    return HookSpec(
        name=name,
        target=raw["target"],
        kind=kind,
        transform=dict(transform) if isinstance(transform, Mapping) else transform,
        args=dict(args),
        enabled=raw.get("enabled", True),
        every=raw.get("every", 1),
        start_step=raw.get("start_step", 0),
        end_step=raw.get("end_step"),
        phase=phase,
        types=_str_tuple(name, "types", raw.get("types")),
        exclude=_str_tuple(name, "exclude", raw.get("exclude")),
        optional=raw.get("optional", False),
        index=raw.get("index"),
    )


SpecsLike = Mapping[str, Any] | Sequence[Any] | HookSpec | None


def parse_specs(specs: SpecsLike) -> list[HookSpec]:
    """Parse a mapping ``{name: spec}``, a list of specs, or a single spec, in declaration order."""
    if specs is None:
        return []
    if isinstance(specs, HookSpec):
        return [specs]
    if isinstance(specs, Mapping):
        if "target" in specs and "kind" in specs and not isinstance(specs.get("target"), Mapping):
            raise SpecError(
                "got a single spec where a mapping of named specs was expected. Wrap it in a name: "
                "`{'my_hook': {'target': ..., 'kind': ...}}`, or pass a list of specs."
            )
        return [parse_spec(str(name), raw) for name, raw in specs.items()]
    if isinstance(specs, Sequence) and not isinstance(specs, str):
        parsed: list[HookSpec] = []
        seen: set[str] = set()
        for i, raw in enumerate(specs):
            if isinstance(raw, HookSpec):
                name = raw.name
            elif isinstance(raw, Mapping):
                name = str(raw.get("name") or f"{raw.get('kind')}:{raw.get('target')}")
            else:
                raise SpecError(f"item {i} of the spec list is {raw!r}, not a mapping.")
            if name in seen:
                raise SpecError(
                    f"two specs have the name {name!r}. Give one of them a 'name' of its own.", spec=name
                )
            seen.add(name)
            parsed.append(parse_spec(name, raw))
        return parsed
    raise SpecError(f"hook specs must be a mapping {{name: spec}} or a list of specs, got {type(specs).__name__}.")
