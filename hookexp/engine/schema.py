"""The hook spec's schema, written once: fields, defaults, kinds, and every static check. Imports no torch.

:class:`HookSpec` is the one definition of a spec's fields (where: ``target``, ``types``, ``exclude``; when:
``kind``; what it sees: ``input``, ``index``, ``select``; what it does: ``transform``, ``args``; on which
steps: ``enabled``, ``every``, ``start_step``, ``end_step``, ``phase``). The Hydra schema is derived from it
(:func:`config_fields`) and ``--help`` lists the kinds from :data:`KIND_DOCS` without torch. :func:`check_specs`
returns every error of every spec at once, each a :class:`~hookexp.errors.SpecError` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hookexp.errors import SpecError, did_you_mean

PHASES = ("train", "eval", "both")


def _meta(config: Any, doc: str) -> dict[str, Any]:
    return {"config": config, "doc": doc}


@dataclass(frozen=True)
class HookSpec:
    """One declared hook. Field names are the config keys of ``hooks.<name>``; ``metadata`` holds each
    field's type in the Hydra schema and its one-line meaning."""

    name: str
    target: str = field(metadata=_meta(str, "module/parameter name, glob, 're:' regex or @alias"))
    kind: str = field(metadata=_meta(str, "where in forward/backward (see KIND_DOCS)"))
    transform: Any = field(default="identity", metadata=_meta(Any, "registry name, {_target_: pkg.fn}, a callable"))
    args: Mapping[str, Any] = field(default_factory=dict, metadata=_meta(dict[str, Any], "the transform's args"))
    enabled: bool = field(default=True, metadata=_meta(bool, "false: resolved and reported, not attached"))
    every: int = field(default=1, metadata=_meta(int, "act on every N-th training step"))
    start_step: int = field(default=0, metadata=_meta(int, "first step of the window [start_step, end_step)"))
    end_step: int | None = field(default=None, metadata=_meta(Optional[int], "end of the window (exclusive)"))  # noqa: UP045
    phase: str = field(default="train", metadata=_meta(str, "train | eval | both (forward kinds)"))
    types: tuple[str, ...] = field(default=(), metadata=_meta(list[str], "narrow to modules of these classes"))
    exclude: tuple[str, ...] = field(default=(), metadata=_meta(list[str], "patterns dropped from the match"))
    optional: bool = field(default=False, metadata=_meta(bool, "true: matching nothing is allowed"))
    index: int | str | None = field(default=None, metadata=_meta(Any, "an element of a structured value: position/key"))
    input: str | None = field(default=None, metadata=_meta(Optional[str], "forward_pre/forward: a forward() input"))  # noqa: UP045
    select: Mapping[str, Any] | None = field(
        default=None, metadata=_meta(Optional[dict[str, Any]], "{dim, index} or {heads, num_heads}: a slice"))  # noqa: UP045

    def active_at(self, step: int) -> bool:
        """Whether the schedule (window and ``every``) lets the hook act on training step ``step``."""
        if step < self.start_step or (self.end_step is not None and step >= self.end_step):
            return False
        return (step - self.start_step) % self.every == 0


SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(HookSpec) if f.name != "name")
REQUIRED_FIELDS = tuple(f.name for f in dataclasses.fields(HookSpec)
                 if f.name != "name" and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
# what a spec that leaves a field out gets: HookSpec's defaults, the one place they are written
DEFAULTS = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(HookSpec) if f.name != "name" and f.name not in REQUIRED_FIELDS}


def config_fields(missing: Any) -> list[tuple[str, Any, Any]]:
    """``(name, type, dataclasses.field)`` for every spec field, for ``dataclasses.make_dataclass``: the Hydra
    schema's types come from each field's metadata, tuples become lists, required fields default to
    ``missing`` (OmegaConf's ``MISSING``)."""
    out = []
    for f in dataclasses.fields(HookSpec):
        if f.name == "name":
            continue
        if f.default_factory is not dataclasses.MISSING:
            default = field(default_factory=f.default_factory)
        elif f.default is dataclasses.MISSING:
            default = field(default=missing)
        elif isinstance(f.default, tuple):
            default = field(default_factory=list)
        else:
            default = field(default=f.default)
        out.append((f.name, f.metadata["config"], default))
    return out


# ----------------------------------------------------------------------------------------------------
# Kinds: what each attaches to and what its transform sees. The torch side (hookexp.engine.kinds)
# registers an implementation under each of these names.

Value = Literal["inputs", "output", "tuple", "tensor"]


@dataclass(frozen=True)
class KindDoc:
    """A kind's facts: what it attaches to, when it fires, the torch API, and the value its transform sees
    (``value``: ``inputs`` = forward inputs; ``output`` = any structure; ``tuple`` = a tuple of grads;
    ``tensor`` = one gradient). ``index`` and ``input`` are checked against ``value``."""

    on: Literal["module", "parameter"]
    stage: Literal["forward", "backward", "step"]
    torch_api: str
    sees: str
    value: Value


KIND_DOCS: dict[str, KindDoc] = {
    "forward_pre": KindDoc("module", "forward", "register_forward_pre_hook (with_kwargs)",
                           "the inputs, positional and keyword (`input:` picks one by name)", "inputs"),
    "forward": KindDoc("module", "forward", "register_forward_hook (with_kwargs)",
                       "the output (replace it = ablation / patching)", "output"),
    "output_grad": KindDoc("module", "backward", "forward hook, then Tensor.register_hook on each output",
                           "grad w.r.t. each output tensor (safe with in-place ops)", "output"),
    "backward_pre": KindDoc("module", "backward", "register_full_backward_pre_hook", "grad_output (tuple)", "tuple"),
    "backward": KindDoc("module", "backward", "register_full_backward_hook",
                        "grad_input (tuple; grads w.r.t. the module inputs)", "tuple"),
    "backward_legacy": KindDoc("module", "backward", "register_backward_hook (deprecated; warns)",
                               "grad_input of the module's last op", "tuple"),
    "node": KindDoc("module", "backward", "grad_fn.register_hook on the module output",
                    "grad_inputs of the output's autograd Node", "tuple"),
    "node_pre": KindDoc("module", "backward", "grad_fn.register_prehook on the module output",
                        "grad_outputs of the output's autograd Node", "tuple"),
    "grad": KindDoc("parameter", "backward", "Tensor.register_hook", "the gradient before accumulation", "tensor"),
    "post_accumulate": KindDoc("parameter", "backward", "register_post_accumulate_grad_hook",
                               ".grad after accumulation (written back with copy_)", "tensor"),
    "pre_step": KindDoc("parameter", "step", "Optimizer.register_step_pre_hook",
                        "the final .grad right before optimizer.step()", "tensor"),
}


# The portable target aliases every architecture entry may define (hookexp.engine.aliases has the table).
ALIAS_NAMES = ("blocks", "attn", "mlp", "embed", "unembed", "norm")


def help_list(what: str) -> str:
    """``python -m hookexp --help``'s lists (``${hookexp_help:kinds}``, ``${hookexp_help:aliases}``)."""
    if what == "kinds":
        return " ".join(KIND_DOCS)
    if what == "aliases":
        return " ".join("@" + a for a in ALIAS_NAMES)
    raise ValueError(f"hookexp_help knows 'kinds' and 'aliases', not {what!r}")


# ----------------------------------------------------------------------------------------------------
# Static checks: every field of every spec, all errors collected.


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # `every: true` is a typo, not 1


def _int_list(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, Sequence) and not isinstance(v, str) and len(v) > 0
                          and all(_is_int(i) for i in v))


def _check_select(sel: Any) -> str | None:
    """Why ``select`` is malformed, or None. Two forms: ``{dim, index}`` and ``{heads, num_heads}``."""
    example = "select: {dim: -1, index: [3, 7]} or select: {heads: [0, 5], num_heads: 12}"
    if not isinstance(sel, Mapping):
        return f"expected a mapping, got {sel!r}. Write {example}."
    keys = set(sel)
    if keys == {"dim", "index"}:
        if not _is_int(sel["dim"]):
            return f"'dim' must be an integer, got {sel['dim']!r}."
        if not _int_list(sel["index"]):
            return f"'index' must be an integer or a non-empty list of integers, got {sel['index']!r}."
        return None
    if keys == {"heads", "num_heads"}:
        h = sel["num_heads"]
        if not _is_int(h) or h < 1:
            return f"'num_heads' must be a positive integer, got {h!r}."
        heads = sel["heads"]
        if not _int_list(heads):
            return f"'heads' must be an integer or a non-empty list of integers, got {heads!r}."
        bad = [i for i in ([heads] if _is_int(heads) else heads) if not 0 <= i < h]
        if bad:
            return f"heads {bad} are out of range for num_heads={h} (valid: 0..{h - 1})."
        return None
    unknown = sorted(keys - {"dim", "index", "heads", "num_heads"})
    hint = did_you_mean(unknown[0], ("dim", "index", "heads", "num_heads")) if unknown else ""
    return f"has keys {sorted(keys)}; expected exactly {{dim, index}} or {{heads, num_heads}}.{hint} Write {example}."


def _str_tuple(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _transform_error(transform: Any, transforms: Collection[str] | None) -> str | None:
    if isinstance(transform, str):
        if transforms is not None and transform not in transforms:
            return (f"unknown transform {transform!r}.{did_you_mean(transform, transforms)} "
                    f"Known transforms: {', '.join(sorted(transforms))}; or give a user function as "
                    "{_target_: my_pkg.my_module.my_fn}.")
        return None
    if isinstance(transform, Mapping):
        if not isinstance(transform.get("_target_"), str):
            return ("a user transform must be a mapping with '_target_' naming an importable callable, "
                    f"e.g. {{_target_: my_pkg.my_module.my_fn}}; got {dict(transform)!r}.")
        return None
    if callable(transform):  # the Python API: a function or hookexp.engine.Transform
        return None
    return f"expected a transform name, {{_target_: ...}} or a callable, got {transform!r}."


def check_spec(name: str, raw: Mapping[str, Any] | HookSpec, *, kinds: Collection[str] | None = None,
               transforms: Collection[str] | None = None) -> tuple[HookSpec | None, list[SpecError]]:
    """Check one raw spec; returns the :class:`HookSpec` (None when it has errors) and every error found.

    ``kinds`` / ``transforms``: the names to accept (the engine passes its registries; None accepts any
    transform name and the built-in kinds).
    """
    kinds = KIND_DOCS if kinds is None else kinds
    errors: list[SpecError] = []

    def err(message: str, key: str | None = None) -> None:
        errors.append(SpecError(message, spec=name, field=key))

    if isinstance(raw, HookSpec):
        raw = {f: getattr(raw, f) for f in SPEC_FIELDS}
    if not isinstance(raw, Mapping):
        err(f"a hook spec must be a mapping with at least 'target' and 'kind', got {raw!r}. "
            f"Write it as `{name}: {{target: conv, kind: output_grad, transform: clamp, args: {{min: 0}}}}`.")
        return None, errors
    raw = dict(raw)
    raw.pop("name", None)
    for key in raw:
        if key not in SPEC_FIELDS:
            err(f"unknown field {key!r}.{did_you_mean(key, SPEC_FIELDS)} A spec has the fields: "
                f"{', '.join(SPEC_FIELDS)}.", key)
    raw = {**DEFAULTS, **raw}
    for key in REQUIRED_FIELDS:
        if raw.get(key) is None:
            err(f"missing required field {key!r}. Every spec needs 'target' (a module or parameter name, glob, "
                f"'re:' pattern or @alias) and 'kind' (one of {', '.join(kinds)}).", key)

    target, kind = raw.get("target"), raw.get("kind")
    if target is not None and not isinstance(target, str):
        err(f"expected a string (exact name, glob, 're:' regex or @alias), got {target!r} ({type(target).__name__}).",
            "target")
    doc: KindDoc | None = None
    if kind is not None:
        if not isinstance(kind, str):
            err(f"expected a kind name, got {kind!r} ({type(kind).__name__}).", "kind")
        elif kind not in kinds:
            err(f"unknown kind {kind!r}.{did_you_mean(kind, kinds)} Known kinds: {', '.join(kinds)}.", "kind")
        else:
            doc = KIND_DOCS.get(kind)
    transform = raw["transform"]
    why = _transform_error(transform, transforms)
    if why:
        err(why, "transform")
    args = raw["args"] or {}
    if not isinstance(args, Mapping):
        err(f"expected a mapping of keyword arguments, got {args!r}.", "args")

    for key, want, what in (("enabled", bool, "true or false"), ("optional", bool, "true or false")):
        if key in raw and not isinstance(raw[key], want):
            err(f"expected {what}, got {raw[key]!r} ({type(raw[key]).__name__}).", key)
    every, start, end = raw["every"], raw["start_step"], raw["end_step"]
    if not _is_int(every):
        err(f"expected a positive integer, got {every!r} ({type(every).__name__}).", "every")
    elif every < 1:
        err(f"must be at least 1, got {every}.", "every")
    if not _is_int(start):
        err(f"expected a non-negative integer, got {start!r} ({type(start).__name__}).", "start_step")
    elif start < 0:
        err(f"must be non-negative, got {start}.", "start_step")
    if end is not None and not _is_int(end):
        err(f"expected an integer or null, got {end!r} ({type(end).__name__}).", "end_step")
    elif end is not None and _is_int(start) and end <= start:
        err(f"end_step ({end}) must be greater than start_step ({start}): the window [start_step, end_step) "
            "would be empty.", "end_step")
    phase = raw["phase"]
    if phase not in PHASES:
        err(f"unknown phase {phase!r}.{did_you_mean(str(phase), PHASES)} Use one of: {', '.join(PHASES)}.", "phase")
    types, exclude = _str_tuple(raw["types"]), _str_tuple(raw["exclude"])
    if types is None:
        err(f"expected a list of strings, got {raw['types']!r}.", "types")
    if exclude is None:
        err(f"expected a list of strings, got {raw['exclude']!r}.", "exclude")

    index, inp, sel = raw["index"], raw["input"], raw["select"]
    if index is not None:
        if not (_is_int(index) or isinstance(index, str)):
            err(f"expected a position (integer) or a key name (string), got {index!r}.", "index")
        elif doc is not None and doc.value == "tensor":
            err(f"kind {kind!r} sees one gradient tensor, which has no elements to pick: remove 'index' (to act on "
                "part of the tensor, use select: {dim: 0, index: [...]}).", "index")
        elif doc is not None and doc.value == "tuple" and isinstance(index, str):
            err(f"kind {kind!r} sees a tuple of gradients, picked by position: use an integer, not {index!r}.", "index")
        elif doc is not None and doc.value == "inputs" and isinstance(index, str):
            err(f"to pick a forward input by name use input: {index} (index picks a positional input by number).",
                "index")
    if inp is not None:
        if not isinstance(inp, str) or not inp:
            err(f"expected the name of a forward() parameter, got {inp!r}.", "input")
        elif doc is not None and doc.value != "inputs" and kind != "forward":
            err(f"'input' picks a module input by name, which kinds 'forward_pre' and 'forward' see; kind {kind!r} "
                "does not. Remove it, or use kind 'forward_pre'.", "input")
    if sel is not None:
        why = _check_select(sel)
        if why:
            err(why, "select")

    if errors:
        return None, errors
    return HookSpec(
        name=name, target=target, kind=kind,
        transform=dict(transform) if isinstance(transform, Mapping) else transform,
        args=dict(args), enabled=raw["enabled"], every=every, start_step=start, end_step=end, phase=phase,
        types=types or (), exclude=exclude or (), optional=raw["optional"], index=index, input=inp,
        select=dict(sel) if sel is not None else None,
    ), errors


SpecsLike = Mapping[str, Any] | Sequence[Any] | HookSpec | None


def spec_name(raw: Any) -> str:
    """The name of a spec given in a list: its ``name``, else ``<kind>:<target>`` (the one rule for every
    place that names a spec of a list: parsing, error order, the FSDP refusal)."""
    if isinstance(raw, HookSpec):
        return raw.name
    if isinstance(raw, Mapping):
        return str(raw.get("name") or f"{raw.get('kind')}:{raw.get('target')}")
    return "?"


def check_specs(specs: SpecsLike, *, kinds: Collection[str] | None = None,
                transforms: Collection[str] | None = None) -> tuple[list[HookSpec], list[SpecError]]:
    """Parse a mapping ``{name: spec}``, a list of specs (names default to ``<kind>:<target>``), or a single
    :class:`HookSpec`, in declaration order. Returns the valid specs and every error of every spec."""
    if specs is None:
        return [], []
    if isinstance(specs, HookSpec):
        specs = [specs]
    items: list[tuple[str, Any]]
    if isinstance(specs, Mapping):
        if "target" in specs and "kind" in specs and not isinstance(specs.get("target"), Mapping):
            return [], [SpecError("got a single spec where a mapping of named specs was expected. Wrap it in a "
                                  "name: `{'my_hook': {'target': ..., 'kind': ...}}`, or pass a list of specs.")]
        items = [(str(k), v) for k, v in specs.items()]
    elif isinstance(specs, Sequence) and not isinstance(specs, str):
        items = []
        for i, raw in enumerate(specs):
            if not isinstance(raw, (Mapping, HookSpec)):
                return [], [SpecError(f"item {i} of the spec list is {raw!r}, not a mapping.")]
            items.append((spec_name(raw), raw))
    else:
        return [], [SpecError(f"hook specs must be a mapping {{name: spec}} or a list of specs, got "
                              f"{type(specs).__name__}.")]
    parsed: list[HookSpec] = []
    errors: list[SpecError] = []
    seen: set[str] = set()
    for name, raw in items:
        if name in seen:
            errors.append(SpecError(f"two specs have the name {name!r}. Give one of them a 'name' of its own.",
                                    spec=name))
            continue
        seen.add(name)
        spec, errs = check_spec(name, raw, kinds=kinds, transforms=transforms)
        errors.extend(errs)
        if spec is not None:
            parsed.append(spec)
    return parsed, errors

