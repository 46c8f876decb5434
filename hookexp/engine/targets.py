"""Target resolution: one grammar for every kind, over ``named_modules()`` / ``named_parameters()``.

A target (and each ``exclude`` entry) is an exact name (``conv``, ``fc1.bias``, ``""`` the root), a glob
(``layer*.conv?``, ``*.bias``; ``*`` crosses dots), a regular expression after ``re:`` (``re.search``), or an
alias (``@attn``, ...; :mod:`hookexp.engine.aliases`), for parameter kinds the modules' parameters. ``types``
narrows to modules whose class (or a base) has one of the names. Shared modules and tied parameters resolve
once, under the first name ``named_modules()`` gives (the others kept as ``aliases``), as torch fires their
hooks once per call. docs/targets.md has the grammar with examples.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from hookexp.engine.aliases import Resolved, alias_hint, expand
from hookexp.engine.patterns import compile_pattern
from hookexp.engine.schema import HookSpec
from hookexp.errors import ConfigError, HookexpError, SpecError, TargetError, did_you_mean

TargetKind = Literal["module", "parameter"]


@dataclass(frozen=True)
class Target:
    """A resolved target: its canonical name, the object, and its other names (shared/tied)."""

    name: str
    obj: nn.Module | torch.Tensor
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class Resolution:
    """A spec's targets, and what its ``@alias`` (if any) became."""

    targets: list[Target]
    alias: Resolved | None = None


class _Errors:
    """Builds the right error class: a hook spec's (TargetError naming ``hooks.<spec>.<field>``) or another
    setting's (ConfigError naming its key, without hook advice)."""

    def __init__(self, spec: str | None, config_key: str | None):
        self.spec, self.config_key = spec, config_key

    def __call__(self, message: str, field: str = "target") -> HookexpError:
        if self.config_key is not None:
            return ConfigError(message, key=self.config_key)
        return TargetError(message, spec=self.spec, field=field)


def _grouped(named: Iterable[tuple[str, object]]) -> list[Target]:
    """Group names by object identity, keeping torch's order: shared/tied objects become one Target."""
    order: list[int] = []
    names: dict[int, list[str]] = {}
    objs: dict[int, object] = {}
    for name, obj in named:
        key = id(obj)
        if key not in names:
            order.append(key)
            names[key] = []
            objs[key] = obj
        names[key].append(name)
    return [Target(names[k][0], objs[k], tuple(names[k][1:])) for k in order]  # type: ignore[arg-type]


def module_targets(model: nn.Module) -> list[Target]:
    return _grouped(model.named_modules(remove_duplicate=False))


def parameter_targets(model: nn.Module) -> list[Target]:
    return _grouped(model.named_parameters(remove_duplicate=False))


def _class_names(cls: type) -> set[str]:
    out: set[str] = set()
    for c in cls.__mro__:
        out.add(c.__name__)
        out.add(f"{c.__module__}.{c.__qualname__}")
    return out


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    owner_name = param_name.rpartition(".")[0]
    return model.get_submodule(owner_name) if owner_name else model


def _predicate(model: nn.Module, pattern: str, what: TargetKind, spec: str | None, field: str,
               fail: _Errors, optional: bool = False) -> tuple[Callable[[str], bool], Resolved | None]:
    if pattern.startswith("@"):
        try:
            resolved = expand(model, pattern, what, missing_ok=optional)
        except LookupError as e:
            raise fail(f"target {pattern!r}: {e}", field) from None
        rx = re.compile(resolved.regex)
        return (lambda name: rx.search(name) is not None), resolved
    return compile_pattern(pattern, spec=spec, field=field), None


def resolve(model: nn.Module, spec: HookSpec, what: TargetKind, config_key: str | None = None) -> Resolution:
    """The targets ``spec`` names in ``model``; raises :class:`TargetError` when it names nothing.

    ``what`` says whether the spec's kind attaches to modules or to parameters. ``config_key``: the
    pattern is not a hook's but another setting's (``stats.grads``); its errors are
    :class:`ConfigError` naming that key, without hook advice.
    """
    fail = _Errors(spec.name, config_key)
    candidates = module_targets(model) if what == "module" else parameter_targets(model)
    match, alias = _predicate(model, spec.target, what, spec.name, "target", fail, spec.optional)
    found = [t for t in candidates if any(match(n) for n in t.names)]

    if spec.types:
        present: set[str] = set()
        for m in model.modules():
            present |= _class_names(type(m))
        for t in spec.types:
            if t not in present:
                simple = sorted({n for n in present if "." not in n and not n.startswith("_") and n != "object"})
                raise fail(f"type {t!r} is not the class of any module in {type(model).__name__}."
                           f"{did_you_mean(t, simple)} Classes present: {', '.join(simple)}.", "types")
        wanted = set(spec.types)

        def owner_class(t: Target) -> type:
            return type(t.obj) if what == "module" else type(_owner(model, t.name))

        found = [t for t in found if _class_names(owner_class(t)) & wanted]

    for i, pattern in enumerate(spec.exclude):
        drop, _ = _predicate(model, pattern, what, spec.name, f"exclude[{i}]", fail, optional=True)
        found = [t for t in found if not any(drop(n) for n in t.names)]

    if not found and not spec.optional:
        raise fail(_nothing_matched(model, spec, what, match, alias, hook=config_key is None))
    return Resolution(found, alias)


def match(model: nn.Module, pattern: str, on: TargetKind = "module", key: str = "stats") -> list[tuple[str, Any]]:
    """``(name, module or parameter)`` for every target ``pattern`` names, with the hook target grammar
    (aliases included), for settings other than hooks; errors are :class:`ConfigError` naming ``key``."""
    if not isinstance(pattern, str):
        raise ConfigError(f"expected a target pattern (a name, glob, 're:' regex or @alias), got {pattern!r}.", key=key)
    spec = HookSpec(name=key, target=pattern, kind="grad" if on == "parameter" else "forward")
    try:
        return [(t.name, t.obj) for t in resolve(model, spec, on, config_key=key).targets]
    except SpecError as e:  # a pattern that does not compile: the setting's key, not a hook spec's
        raise ConfigError(e.message, key=key) from None


def _nothing_matched(model: nn.Module, spec: HookSpec, what: TargetKind, match: Callable[[str], bool],
                     alias: Resolved | None, hook: bool = True) -> str:
    own = [n for t in (module_targets(model) if what == "module" else parameter_targets(model)) for n in t.names]
    other_what: TargetKind = "parameter" if what == "module" else "module"
    other = [n for t in (parameter_targets(model) if what == "module" else module_targets(model)) for n in t.names]
    model_name = type(model).__name__
    kind_note = f" (kind {spec.kind!r} attaches to {what}s)" if hook else ""
    shown = f"{spec.target!r} ({alias.describe()})" if alias else repr(spec.target)
    narrowing = []
    if any(match(n) for n in own):  # the name matched; types/exclude removed everything
        if spec.types:
            narrowing.append(f"types {list(spec.types)}")
        if spec.exclude:
            narrowing.append(f"exclude {list(spec.exclude)}")
    narrowed = f" after narrowing by {' and '.join(narrowing)}" if narrowing else ""

    hits = [n for n in other if match(n)]
    if hits and not narrowing and alias is None:
        if what == "module":
            fix = (
                f"{spec.target!r} names {other_what}s ({', '.join(hits[:4])}). Use a parameter kind "
                "(grad, post_accumulate, pre_step) for parameters, or target the owning module."
            )
        else:
            fix = (
                f"{spec.target!r} names {other_what}s ({', '.join(hits[:4])}). Target their parameters, "
                f"e.g. '{hits[0]}.*' or '{hits[0]}.weight'" if hits[0] else "e.g. '*.weight'"
            ) + ", or use a module kind (forward, output_grad, backward, ...)."
        return f"target {spec.target!r} matches no {what} of {model_name}{kind_note}. {fix}"
    names = [n for n in own if n]
    hint = (alias_hint(model, spec.target, what) or did_you_mean(spec.target.removeprefix("re:"), names)
            if alias is None else "")
    listing = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    optional = ", or set optional: true if the spec may match nothing" if hook else ""
    return (
        f"target {shown} matches no {what} of {model_name}{narrowed}{kind_note}.{hint} "
        f"Its {what}s are: {listing}. Fix the name, use a glob ('*.bias') or 're:' pattern{optional}."
    )
