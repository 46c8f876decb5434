"""The transform registry: what a hook does to the tensors it sees.

A transform is ``fn(x, ctx, **args) -> Tensor``. It works *out of place* and keeps shape, dtype and
device; the engine checks all of that on every call (metadata only, no host sync) and names the spec
when a transform breaks the contract. ``ctx`` is a :class:`HookContext`: the step, the spec and target
names, the tensor's position in a tuple, the other side of the hook call (``aux``: grad_output for
backward kinds, the inputs for ``forward``), and a per-spec ``state`` dict for things like generators.

Registering one is a decorator (Opacus style)::

    @register_transform("clamp", batched=_clamp_)
    def clamp(x, ctx, min=None, max=None): ...

``batched`` is an optional in-place version over a list of tensors that the ``pre_step`` kind uses to
run every parameter of a group in one ``torch._foreach_*`` call. ``structured=True`` transforms (record)
see the whole hook value (a tensor or a tuple) at once instead of one tensor at a time.

A user transform is any importable callable, given as ``{_target_: pkg.mod.fn, **args}``; it gets
``ctx`` if it has a parameter named ``ctx`` (or a second positional parameter).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hookexp.errors import SpecError, TransformArgsError, did_you_mean

log = logging.getLogger("hookexp.transforms")

TransformFn = Callable[..., Any]
BatchedFn = Callable[..., None]


@dataclass
class HookContext:
    """What a transform knows about the call it is in. Valid for the duration of the call."""

    spec: str
    kind: str
    target: str
    step: int
    index: int | None = None
    aux: Any = None
    state: dict[str, Any] = field(default_factory=dict)
    records: list[Record] | None = None
    measuring: bool = False
    emitted: dict[str, list[torch.Tensor]] | None = None

    def emit(self, name: str, value: torch.Tensor | float) -> None:
        """Report a measurement (mean over calls) as ``hook/<spec>/<name>``; only while measuring,
        i.e. on log steps. Keep ``value`` on the device: it is read back with the other statistics."""
        if self.measuring and self.emitted is not None:
            self.emitted.setdefault(name, []).append(torch.as_tensor(value, dtype=torch.float32).detach())


@dataclass
class Record:
    """One value a ``record`` transform kept: detached copies, never part of the autograd graph."""

    spec: str
    target: str
    step: int
    value: Any
    aux: Any = None


@dataclass(frozen=True)
class TransformInfo:
    name: str
    fn: TransformFn
    batched: BatchedFn | None = None
    structured: bool = False
    aliases: Mapping[str, str] = field(default_factory=dict)
    check: Callable[..., None] | None = None
    value_dependent: bool = False  # acts on magnitudes: a scaled gradient (fp16) changes what it does
    doc: str = ""


TRANSFORMS: dict[str, TransformInfo] = {}


def register_transform(
    name: str,
    *,
    batched: BatchedFn | None = None,
    structured: bool = False,
    aliases: Mapping[str, str] | None = None,
    check: Callable[..., None] | None = None,
    value_dependent: bool = False,
) -> Callable[[TransformFn], TransformFn]:
    """Decorator that adds ``fn`` to the registry under ``name``.

    ``check(**args)`` validates argument values when a spec is bound, before any hook fires; it raises
    :class:`TransformArgsError` with the fix. ``value_dependent``: the result depends on magnitudes
    (clamp, add, ...), so the trainer warns when such a transform sees fp16-scaled gradients.
    """

    def deco(fn: TransformFn) -> TransformFn:
        if name in TRANSFORMS:
            raise ValueError(f"transform {name!r} is already registered")
        doc = inspect.getdoc(fn) or ""
        TRANSFORMS[name] = TransformInfo(name, fn, batched, structured, dict(aliases or {}), check, value_dependent,
                                         doc)
        return fn

    return deco


def detach_copy(value: Any, to_cpu: bool = False) -> Any:
    """Detached copies of every tensor in a value (tensor, tuple/list, dict, None)."""
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
        return out.cpu() if to_cpu else out
    if isinstance(value, (tuple, list)):
        return type(value)(detach_copy(v, to_cpu) for v in value)
    if isinstance(value, Mapping):
        return {k: detach_copy(v, to_cpu) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------------------------------
# The built-in transforms.


@register_transform("identity", batched=lambda xs, ctx: None)
def identity(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
    """Return the tensor unchanged: attach a hook only to count calls and measure."""
    return x


@register_transform("record", structured=True)
def record(x: Any, ctx: HookContext, aux: bool = False, max_records: int | None = None,
           to_cpu: bool = False) -> Any:
    """Keep a detached copy of the value (a tensor, or the whole tuple) in ``hooks.records[spec]``.

    ``aux: true`` also keeps the other side of the call (grad_output for backward kinds, inputs for
    forward). ``max_records`` keeps only the first N; ``to_cpu`` moves copies off the accelerator.
    """
    if ctx.records is not None and (max_records is None or len(ctx.records) < max_records):
        ctx.records.append(
            Record(ctx.spec, ctx.target, ctx.step, detach_copy(x, to_cpu),
                   detach_copy(ctx.aux, to_cpu) if aux else None)
        )
    return x


@register_transform("dead_units")
def dead_units(x: torch.Tensor, ctx: HookContext, dim: int = 1) -> torch.Tensor:
    """A probe: leave the activation unchanged; on log steps emit ``dead_frac``, the fraction of units
    (entries along ``dim``, the channel/feature dimension) that are not positive anywhere in the batch."""
    if ctx.measuring and x.dim() > dim:
        alive = (x.detach() > 0).transpose(0, dim).reshape(x.shape[dim], -1).any(dim=1)
        ctx.emit("dead_frac", 1.0 - alive.float().mean())
    return x


@register_transform("print")
def print_(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
    """Log shape, dtype, norm and range of the tensor (costs a host sync on every call)."""
    where = f"[{ctx.index}]" if ctx.index is not None else ""
    log.info(
        "hook %s (%s) %s%s step %d: shape=%s dtype=%s norm=%.6g min=%.6g max=%.6g",
        ctx.spec, ctx.kind, ctx.target, where, ctx.step, tuple(x.shape), str(x.dtype).removeprefix("torch."),
        torch.linalg.vector_norm(x.float()).item(), x.min().item(), x.max().item(),
    )
    return x


def _add_(xs: list[torch.Tensor], ctx: HookContext, value: float) -> None:
    torch._foreach_add_(xs, value)


@register_transform("add", batched=_add_, value_dependent=True)
def add(x: torch.Tensor, ctx: HookContext, value: float) -> torch.Tensor:
    """``x + value``."""
    return x + value


def _scale_(xs: list[torch.Tensor], ctx: HookContext, factor: float) -> None:
    torch._foreach_mul_(xs, factor)


@register_transform("scale", batched=_scale_)
def scale(x: torch.Tensor, ctx: HookContext, factor: float) -> torch.Tensor:
    """``x * factor``."""
    return x * factor


def _check_bounds(min: float | None = None, max: float | None = None) -> None:
    if min is None and max is None:
        raise TransformArgsError("needs at least one of 'min' and 'max', e.g. args: {min: 0.0}.")
    if min is not None and max is not None and min > max:
        raise TransformArgsError(f"has min ({min}) greater than max ({max}).")


def _clamp_(xs: list[torch.Tensor], ctx: HookContext, min: float | None = None, max: float | None = None) -> None:
    if min is not None:
        torch._foreach_clamp_min_(xs, min)
    if max is not None:
        torch._foreach_clamp_max_(xs, max)


@register_transform("clamp", batched=_clamp_, check=_check_bounds, value_dependent=True)
def clamp(x: torch.Tensor, ctx: HookContext, min: float | None = None, max: float | None = None) -> torch.Tensor:
    """Clamp every element into ``[min, max]`` (either bound may be omitted)."""
    return x.clamp(min=min, max=max)


def _zero_(xs: list[torch.Tensor], ctx: HookContext) -> None:
    torch._foreach_zero_(xs)


@register_transform("zero", batched=_zero_)
def zero(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
    """All zeros (e.g. freeze a parameter by zeroing its gradient)."""
    return torch.zeros_like(x)


@register_transform("zero_ablate")
def zero_ablate(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
    """Replace an activation by zeros (zero ablation)."""
    return torch.zeros_like(x)


@register_transform("mean_ablate")
def mean_ablate(x: torch.Tensor, ctx: HookContext, dim: int = 0) -> torch.Tensor:
    """Replace an activation by its mean over ``dim`` (the batch), broadcast back (mean ablation)."""
    return x.mean(dim=dim, keepdim=True).expand_as(x).contiguous()


def _negate_(xs: list[torch.Tensor], ctx: HookContext) -> None:
    torch._foreach_neg_(xs)


@register_transform("negate", batched=_negate_)
def negate(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
    """``-x``."""
    return -x


@register_transform("reverse", aliases={"lambda": "lambd"})
def reverse(x: torch.Tensor, ctx: HookContext, lambd: float = 1.0) -> torch.Tensor:
    """Gradient reversal (Ganin & Lempitsky 2015): ``-lambda * x``. Use on a gradient kind."""
    return x * (-lambd)


def _sign_(xs: list[torch.Tensor], ctx: HookContext) -> None:
    torch._foreach_sign_(xs)


@register_transform("sign", batched=_sign_)
def sign(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
    """``sign(x)`` (signSGD-style gradients)."""
    return x.sign()


def _positive(name: str) -> Callable[..., None]:
    def check(**args: Any) -> None:
        value = args.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise TransformArgsError(f"needs {name} > 0, got {value!r}.")

    return check


@register_transform("quantize", check=_positive("step"), value_dependent=True)
def quantize(x: torch.Tensor, ctx: HookContext, step: float) -> torch.Tensor:
    """Round to the nearest multiple of ``step``."""
    return torch.round(x / step) * step


@register_transform("replace", value_dependent=True)
def replace(x: torch.Tensor, ctx: HookContext, value: float) -> torch.Tensor:
    """A tensor of the same shape filled with ``value`` (activation patching with a constant)."""
    return torch.full_like(x, value)


def _norm_scale(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    norm = torch.linalg.vector_norm(x, dtype=torch.float32)
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def _clip_norm_(xs: list[torch.Tensor], ctx: HookContext, max_norm: float) -> None:
    norms = torch._foreach_norm(xs)
    scales = torch._foreach_div(torch._foreach_add(norms, 1e-6), max_norm)
    torch._foreach_maximum_(scales, 1.0)
    torch._foreach_reciprocal_(scales)
    torch._foreach_mul_(xs, [s.to(x.dtype) for s, x in zip(scales, xs, strict=True)])


@register_transform("clip_norm", batched=_clip_norm_, check=_positive("max_norm"),
                    value_dependent=True)
def clip_norm(x: torch.Tensor, ctx: HookContext, max_norm: float) -> torch.Tensor:
    """Rescale so that the tensor's L2 norm is at most ``max_norm`` (per tensor, no host sync)."""
    return x * _norm_scale(x, max_norm).to(x.dtype)


def _generator(ctx: HookContext, device: torch.device, seed: int | None) -> torch.Generator:
    """One generator per spec and device, seeded from ``seed`` or from torch's seed and the spec name.

    Seeding from the spec name keeps two noise specs independent and makes every run with the same
    global seed draw the same noise.
    """
    key = f"generator:{device}"
    gen = ctx.state.get(key)
    if gen is None:
        base = seed if seed is not None else (torch.initial_seed() + zlib.crc32(ctx.spec.encode())) % (2**63)
        gen = torch.Generator(device=device)
        gen.manual_seed(base)
        ctx.state[key] = gen
        ctx.state["seed"] = base
    return gen


def _check_noise(std: float = 0.0, gamma: float = 0.0, seed: int | None = None) -> None:
    if not isinstance(std, (int, float)) or std < 0:
        raise TransformArgsError(f"needs std >= 0, got {std!r}.")
    if not isinstance(gamma, (int, float)) or gamma < 0:
        raise TransformArgsError(f"needs gamma >= 0 (the annealing exponent), got {gamma!r}.")


@register_transform("noise", check=_check_noise, value_dependent=True)
def noise(x: torch.Tensor, ctx: HookContext, std: float, gamma: float = 0.0, seed: int | None = None) -> torch.Tensor:
    """Add Gaussian noise with standard deviation ``std / (1 + step) ** gamma``.

    Annealed gradient noise (Neelakantan et al. 2015) uses variance ``eta / (1 + t) ** 0.55``, that is
    ``std = sqrt(eta)`` and ``gamma = 0.275``. Draws come from a seeded generator of the spec's own:
    ``torch.randn(x.shape, generator=g, dtype=float32)`` scaled, then cast to ``x.dtype``.
    """
    sigma = std / (1.0 + ctx.step) ** gamma
    gen = _generator(ctx, x.device, seed)
    eps = torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float32)
    return x + (eps * sigma).to(x.dtype)


def _check_mask(p: float | None = None, index: Any = None, dim: int | None = None, seed: int | None = None) -> None:
    if (p is None) == (index is None):
        raise TransformArgsError("needs exactly one of 'p' (a fraction to zero) or 'index' (entries to zero).")
    if p is not None and not 0.0 <= p <= 1.0:
        raise TransformArgsError(f"needs 0 <= p <= 1, got {p}.")


@register_transform("mask", check=_check_mask)
def mask(x: torch.Tensor, ctx: HookContext, p: float | None = None, index: int | Sequence[int] | None = None,
         dim: int | None = None, seed: int | None = None) -> torch.Tensor:
    """Zero a random fraction ``p`` of elements (seeded), or the entries ``index`` along ``dim``.

    ``dim`` defaults to the feature/channel dimension: 1 for tensors of 2 or more dimensions, else 0.
    """
    if p is not None:
        keep = torch.rand(x.shape, generator=_generator(ctx, x.device, seed), device=x.device) >= p
        return x * keep.to(x.dtype)
    d = dim if dim is not None else (1 if x.dim() >= 2 else 0)
    idx = [index] if isinstance(index, int) else list(index)  # type: ignore[arg-type]
    keep = torch.ones(x.shape[d], dtype=x.dtype, device=x.device)
    keep[idx] = 0
    shape = [1] * x.dim()
    shape[d] = x.shape[d]
    return x * keep.view(shape)


# ----------------------------------------------------------------------------------------------------
# Binding a transform to a spec: arguments checked once, before any hook fires.


def _locate(path: str, spec: str) -> Callable[..., Any]:
    module_name, _, attr = path.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name) if module_name else None
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise SpecError(
            f"cannot import the user transform {path!r} ({type(e).__name__}: {e}). Give the full dotted "
            "path of a function importable from the run's Python path, e.g. my_pkg.transforms.my_fn.",
            spec=spec,
            field="transform",
        ) from None
    if not callable(obj):
        raise SpecError(f"the user transform {path!r} is not callable.", spec=spec, field="transform")
    return obj


@dataclass
class BoundTransform:
    """A transform with its checked arguments and the per-spec state it keeps across calls."""

    name: str
    fn: TransformFn
    args: dict[str, Any]
    batched: BatchedFn | None = None
    structured: bool = False
    value_dependent: bool = False
    wants_ctx: bool = True
    state: dict[str, Any] = field(default_factory=dict)

    def __call__(self, x: Any, ctx: HookContext) -> Any:
        if self.wants_ctx:
            return self.fn(x, ctx, **self.args)
        return self.fn(x, **self.args)

    def batch_key(self) -> tuple[Any, ...] | None:
        """Transforms with equal keys can run as one batched call over all their tensors."""
        if self.batched is None:
            return None
        return (self.name, tuple(sorted((k, repr(v)) for k, v in self.args.items())))


def _check_args(fn: TransformFn, args: dict[str, Any], name: str, spec: str, skip: int) -> None:
    params = list(inspect.signature(fn).parameters.values())[skip:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    allowed = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in args:
        if key not in allowed:
            listing = ", ".join(allowed) if allowed else "none"
            raise TransformArgsError(
                f"transform {name!r} has no argument {key!r}.{did_you_mean(key, allowed)} "
                f"Its arguments: {listing}.",
                spec=spec,
                field=f"args.{key}",
            )
    missing = [p.name for p in params if p.default is p.empty and p.kind is not p.VAR_POSITIONAL
               and p.name not in args]
    if missing:
        raise TransformArgsError(
            f"transform {name!r} needs the argument(s) {', '.join(missing)}: add them under args, "
            f"e.g. args: {{{missing[0]}: ...}}.",
            spec=spec,
            field="args",
        )


def bind_transform(transform: str | Mapping[str, Any], args: Mapping[str, Any], spec: str) -> BoundTransform:
    """Look up (or import) the transform and check its arguments against its signature."""
    args = dict(args)
    if isinstance(transform, Mapping):
        extra = {k: v for k, v in transform.items() if k != "_target_"}
        path = str(transform["_target_"])
        fn = _locate(path, spec)
        merged = {**extra, **args}
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        wants_ctx = any(p.name == "ctx" for p in params) or len(positional) - len(
            [p for p in positional if p.name in merged]) >= 2
        if params:
            _check_args(fn, merged, path, spec, skip=2 if wants_ctx else 1)
        return BoundTransform(path, fn, merged, wants_ctx=wants_ctx)
    info = TRANSFORMS.get(transform)
    if info is None:  # parse_specs catches this first; kept for direct callers
        raise SpecError(f"unknown transform {transform!r}.", spec=spec, field="transform")
    args = {info.aliases.get(k, k): v for k, v in args.items()}
    _check_args(info.fn, args, info.name, spec, skip=2)
    if info.check is not None:
        try:
            info.check(**args)
        except TransformArgsError as e:
            raise TransformArgsError(f"transform {info.name!r} {e}", spec=spec, field="args") from None
    return BoundTransform(info.name, info.fn, args, info.batched, info.structured, info.value_dependent)
