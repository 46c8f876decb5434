"""Spec parsing against the live registries: :mod:`hookexp.engine.schema` checks, kinds and transforms known.

The schema itself (fields, defaults, kinds' facts) imports no torch; this module adds what only the
engine knows (registered kinds and transforms, including users') and raises every error at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from hookexp.engine.bound import bind_transform
from hookexp.engine.kinds import KINDS
from hookexp.engine.schema import HookSpec, SpecsLike, check_specs
from hookexp.engine.transforms import TRANSFORMS
from hookexp.errors import HookexpError, SpecErrors


def raise_all(errors: Sequence[HookexpError]) -> None:
    """Raise nothing, the one error, or :class:`SpecErrors` holding all of them."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise SpecErrors(list(errors))


def collect_specs(specs: SpecsLike) -> tuple[list[HookSpec], list[HookexpError]]:
    """The valid specs and the static errors of the others, checked against the registries."""
    parsed, errors = check_specs(specs, kinds=KINDS, transforms=TRANSFORMS)
    return parsed, list(errors)


def parse_specs(specs: SpecsLike) -> list[HookSpec]:
    """Parse specs (a mapping ``{name: spec}``, a list, or one :class:`HookSpec`) and check all that needs no model:
    the fields, the kind, the transform and its arguments; every error raised together."""
    parsed, errors = collect_specs(specs)
    for spec in parsed:
        try:
            bind_transform(spec.transform, spec.args, spec.name)
        except HookexpError as e:
            errors.append(e)
    raise_all(errors)
    return parsed
