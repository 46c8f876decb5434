"""The transform registry: what a hook does to the tensors it sees.

A transform is ``fn(x, ctx, **args) -> Tensor``. It works *out of place* and keeps shape, dtype and
device; the engine checks all of that on every call (metadata only, no host sync) and names the spec
when a transform breaks the contract. ``ctx`` is a :class:`HookContext`: the step, the spec and target
names, the tensor's position or key in a structured value, the other side of the hook call (``aux``:
grad_output for backward kinds, the inputs for ``forward``), and a per-spec ``state`` dict (generators,
running averages) that :meth:`HookHandle.state_dict` saves.

Registering one is a decorator (Opacus style)::

    @register_transform("clamp", batched=_clamp_, needs_ctx=False)
    def clamp(x, ctx, min=None, max=None): ...

``batched`` is an optional in-place version over a list of tensors that the ``pre_step`` kind uses to
run every parameter of a group in one ``torch._foreach_*`` call; it must give the same bits as the
per-tensor function (the tests check every one, on every floating dtype). ``structured=True`` transforms
(record) see the whole hook value at once instead of one tensor at a time. ``needs_ctx=False``: the
function ignores ``ctx``, so the engine passes None and builds no context on that call.

Other names for a transform are aliases (:func:`register_transform_alias`): ``zero_ablate`` is ``zero``,
``negate`` is ``scale(factor=-1)``, ``reverse(lambda)`` is ``scale(factor=-lambda)``.

A user transform is any importable callable, given as ``{_target_: pkg.mod.fn, **args}``, or in the
Python API any callable, or :class:`Transform` (a callable with a batched in-place version); it gets
``ctx`` if it has a parameter named ``ctx`` (or a second positional parameter).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import typing
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hookexp.engine.values import detach_copy
from hookexp.errors import RegistryError, SpecError, TransformArgsError, did_you_mean

log = logging.getLogger("hookexp.transforms")

TransformFn = Callable[..., Any]
BatchedFn = Callable[..., None]


class Shards:
    """The process groups a DTensor gradient is sharded over (FSDP2): a transform that acts on this rank's shard
    sums a whole-tensor quantity (a squared norm) over them, one all-reduce."""

    def __init__(self, groups: list[Any], numel: int = 0):
        self.groups = groups
        self.numel = numel  # the whole tensor's elements

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.clone()
        for group in self.groups:
            dist.all_reduce(t, group=group)
        return t


def local_shard(t: torch.Tensor) -> tuple[torch.Tensor, Shards | None]:
    """A DTensor's local shard (a view: writing it writes the DTensor) and its shard groups; a plain tensor as is."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return t, None
    mesh = t.device_mesh  # type: ignore[attr-defined]
    groups = [mesh.get_group(i) for i, p in enumerate(placements) if p.is_shard()]
    return t.to_local(), (Shards(groups, t.numel()) if groups else None)  # type: ignore[attr-defined]


@dataclass
class HookContext:
    """What a transform knows about the call it is in. Valid for the duration of the call only: the
    engine reuses one context per target rather than allocating one per call."""

    spec: str
    kind: str
    target: str
    step: int
    index: int | str | None = None
    aux: Any = None
    state: dict[str, Any] = field(default_factory=dict)
    records: list[Record] | None = None
    measuring: bool = False
    emitted: dict[str, list[torch.Tensor]] | None = None
    targets: list[str] | None = None  # batched pre_step calls: the target of each tensor, in order
    shards: Shards | None = None  # parameter kinds under FSDP: the tensor is this rank's shard of these groups

    def sum_over_shards(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks holding the other shards of the tensor (``t`` itself when unsharded)."""
        return t if self.shards is None else self.shards.sum(t)

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
    """A registry entry. An alias has ``alias_of`` (the transform it runs) and ``translate`` (its own
    arguments -> the target's arguments)."""

    name: str
    fn: TransformFn
    batched: BatchedFn | None = None
    structured: bool = False
    arg_aliases: Mapping[str, str] = field(default_factory=dict)
    check: Callable[..., None] | None = None
    value_dependent: bool = False  # acts on magnitudes: a scaled gradient (fp16) changes what it does
    needs_ctx: bool = True
    stateful: bool = False  # keeps per-target state in ctx.state (saved by HookHandle.state_dict)
    doc: str = ""
    alias_of: str | None = None
    translate: Callable[..., dict[str, Any]] | None = None


TRANSFORMS: dict[str, TransformInfo] = {}


def register_transform(
    name: str,
    *,
    batched: BatchedFn | None = None,
    structured: bool = False,
    arg_aliases: Mapping[str, str] | None = None,
    check: Callable[..., None] | None = None,
    value_dependent: bool = False,
    needs_ctx: bool = True,
    stateful: bool = False,
) -> Callable[[TransformFn], TransformFn]:
    """Decorator that adds ``fn`` to the registry under ``name`` (a name already taken is refused).

    ``check(**args)`` validates argument values when a spec is bound, before any hook fires; it raises
    :class:`TransformArgsError` with the fix. ``value_dependent``: the result depends on magnitudes
    (clamp, add, ...), so the trainer warns when such a transform sees fp16-scaled gradients.
    ``arg_aliases``: other spellings of arguments (``{"lambda": "lambd"}``: a YAML key that is a Python
    keyword). ``stateful``: the transform keeps per-target state in ``ctx.state``.
    """

    def deco(fn: TransformFn) -> TransformFn:
        if name in TRANSFORMS:
            raise RegistryError(f"transform {name!r} is already registered; pick another name.")
        TRANSFORMS[name] = TransformInfo(name, fn, batched, structured, dict(arg_aliases or {}), check,
                                         value_dependent, needs_ctx, stateful, inspect.getdoc(fn) or "")
        return fn

    return deco


def register_transform_alias(name: str, *, of: str, translate: Callable[..., dict[str, Any]] | None = None,
                             arg_aliases: Mapping[str, str] | None = None, doc: str = "") -> None:
    """Register ``name`` as another name of transform ``of``. ``translate(**args)`` maps the alias's own
    arguments to ``of``'s (its signature is what the alias accepts); without it the alias takes ``of``'s."""
    if name in TRANSFORMS:
        raise RegistryError(f"transform {name!r} is already registered; pick another name.")
    target = TRANSFORMS.get(of)
    if target is None or target.alias_of is not None:
        raise RegistryError(f"transform alias {name!r}: {of!r} is not a registered transform (aliases of aliases "
                            "are not allowed).")
    TRANSFORMS[name] = TransformInfo(name, target.fn, target.batched, target.structured,
                                     dict(arg_aliases or target.arg_aliases), target.check, target.value_dependent,
                                     target.needs_ctx, target.stateful, doc or f"Alias of {of}.", of, translate)


# ----------------------------------------------------------------------------------------------------
# The built-in transforms.


@register_transform("identity", batched=lambda xs, ctx: None, needs_ctx=False)
def identity(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
    """Return the tensor unchanged: attach a hook only to count calls and measure."""
    return x


@register_transform("record", structured=True)
def record(x: Any, ctx: HookContext, aux: bool = False, max_records: int | None = None,
           to_cpu: bool = False) -> Any:
    """Keep a detached copy of the value (a tensor, or the whole structure) in ``hooks.records[spec]``.

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


@register_transform("add", batched=_add_, value_dependent=True, needs_ctx=False)
def add(x: torch.Tensor, ctx: HookContext, value: float) -> torch.Tensor:
    """``x + value``."""
    return x + value


def _scale_(xs: list[torch.Tensor], ctx: HookContext, factor: float) -> None:
    # In place with a Python float, torch rounds the factor to a half/bfloat16 tensor's own dtype first, unlike
    # `x * factor` (which multiplies in float32): a 0-dim float64 factor gives x * factor's bits on every dtype.
    device = xs[0].device
    torch._foreach_mul_(xs, torch.tensor(factor, dtype=torch.float32 if device.type == "mps" else torch.float64,
                                         device=device))


@register_transform("scale", batched=_scale_, needs_ctx=False)
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


@register_transform("clamp", batched=_clamp_, check=_check_bounds, value_dependent=True, needs_ctx=False)
def clamp(x: torch.Tensor, ctx: HookContext, min: float | None = None, max: float | None = None) -> torch.Tensor:
    """Clamp every element into ``[min, max]`` (either bound may be omitted)."""
    return x.clamp(min=min, max=max)


def _zero_(xs: list[torch.Tensor], ctx: HookContext) -> None:
    torch._foreach_zero_(xs)


@register_transform("zero", batched=_zero_, needs_ctx=False)
def zero(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
    """All zeros: freeze a parameter by zeroing its gradient, or zero-ablate an activation."""
    return torch.zeros_like(x)


@register_transform("mean_ablate", needs_ctx=False)
def mean_ablate(x: torch.Tensor, ctx: HookContext, dim: int = 0) -> torch.Tensor:
    """Replace an activation by its mean over ``dim`` (the batch), broadcast back (mean ablation)."""
    return x.mean(dim=dim, keepdim=True).expand_as(x).contiguous()


def _sign_(xs: list[torch.Tensor], ctx: HookContext) -> None:
    torch._foreach_sign_(xs)


@register_transform("sign", batched=_sign_, needs_ctx=False)
def sign(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
    """``sign(x)`` (signSGD-style gradients)."""
    return x.sign()


def _positive(name: str) -> Callable[..., None]:
    def check(**args: Any) -> None:
        value = args.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise TransformArgsError(f"needs {name} > 0, got {value!r}.")

    return check


@register_transform("quantize", check=_positive("step"), value_dependent=True, needs_ctx=False)
def quantize(x: torch.Tensor, ctx: HookContext, step: float) -> torch.Tensor:
    """Round to the nearest multiple of ``step``."""
    return torch.round(x / step) * step


@register_transform("replace", value_dependent=True, needs_ctx=False)
def replace(x: torch.Tensor, ctx: HookContext, value: float) -> torch.Tensor:
    """A tensor of the same shape filled with ``value`` (activation patching with a constant)."""
    return torch.full_like(x, value)


def _norm_dtype(x: torch.Tensor) -> torch.dtype:
    """Norms of half-precision tensors are taken in float32 (as torch's clip_grad_norm_ sums), others in their own."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _clip_coef(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor, ``min(max_norm / (norm + 1e-6), 1)``, elementwise."""
    return (max_norm / (norms + 1e-6)).clamp(max=1.0)


def _clip_norm_(xs: list[torch.Tensor], ctx: HookContext, max_norm: float) -> None:
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(xs):
        by_dtype.setdefault(_norm_dtype(x), []).append(i)
    for dtype, picks in by_dtype.items():
        group = [xs[i] for i in picks]
        # the same per-element formula as clip_norm on one stacked vector: elementwise ops give the same bits
        norms = torch.stack(torch._foreach_norm(group, 2, dtype=dtype))
        if ctx is not None and ctx.shards is not None:  # FSDP: the norms of the whole gradients
            norms = ctx.sum_over_shards(norms.square()).sqrt()
        coefs = _clip_coef(norms, max_norm)
        torch._foreach_mul_(group, [c.to(x.dtype) for c, x in zip(coefs.unbind(), group, strict=True)])


@register_transform("clip_norm", batched=_clip_norm_, check=_positive("max_norm"), value_dependent=True)
def clip_norm(x: torch.Tensor, ctx: HookContext, max_norm: float) -> torch.Tensor:
    """Rescale so that the tensor's L2 norm is at most ``max_norm``: ``x * min(max_norm / (norm + 1e-6), 1)``,
    torch's ``clip_grad_norm_`` formula applied per tensor (no host sync). Under FSDP the norm is the whole
    gradient's, summed over the shards."""
    norm = torch.linalg.vector_norm(x, dtype=_norm_dtype(x))
    if ctx is not None and ctx.shards is not None:
        norm = ctx.sum_over_shards(norm.square()).sqrt()
    return x * _clip_coef(norm, max_norm).to(x.dtype)


def _generator(ctx: HookContext, device: torch.device, seed: int | None) -> torch.Generator:
    """One generator per spec and device, seeded from ``seed`` or from torch's seed and the spec name.

    Seeding from the spec name keeps two noise specs independent and makes every run with the same
    global seed draw the same noise. On FSDP's shards each rank draws its own stream (its shard's noise is
    independent of the others', not a slice of one process's draw).
    """
    key = f"generator:{device}"
    gen = ctx.state.get(key)
    if gen is None:
        base = seed if seed is not None else (torch.initial_seed() + zlib.crc32(ctx.spec.encode())) % (2**63)
        if ctx.shards is not None:
            import torch.distributed as dist

            base = (base + 7919 * dist.get_rank()) % (2**63)
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


@register_transform("noise", check=_check_noise, value_dependent=True, stateful=True)
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


@register_transform("mask", check=_check_mask, stateful=True)
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


# -- Grokfast (Lee et al. 2024): amplify the slow component of the gradient. The update rules are those of
# the paper's reference code (github.com/ironjr/grokfast, grokfast.py: gradfilter_ema / gradfilter_ma),
# including the order of its floating-point operations, so that results match it bit for bit.


def _check_ema(alpha: float = 0.98, lamb: float = 2.0) -> None:
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0.0 <= alpha <= 1.0:
        raise TransformArgsError(f"needs 0 <= alpha <= 1 (the EMA's momentum), got {alpha!r}.")
    if not isinstance(lamb, (int, float)) or isinstance(lamb, bool):
        raise TransformArgsError(f"needs a number lamb (the amplification), got {lamb!r}.")


def _on(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t if t.device == x.device else t.to(x.device)  # state restored from a checkpoint on another device


def _ema_amplify_(xs: list[torch.Tensor], ctx: HookContext, alpha: float = 0.98, lamb: float = 2.0) -> None:
    emas = ctx.state.setdefault("ema", {})
    assert ctx.targets is not None
    prev = [x if (e := emas.get(n)) is None else _on(e, x) for n, x in zip(ctx.targets, xs, strict=True)]
    new = torch._foreach_mul(prev, alpha)
    torch._foreach_add_(new, torch._foreach_mul(xs, 1 - alpha))
    emas.update(zip(ctx.targets, new, strict=True))
    torch._foreach_add_(xs, torch._foreach_mul(new, lamb))


@register_transform("ema_amplify", batched=_ema_amplify_, check=_check_ema, value_dependent=True, stateful=True)
def ema_amplify(x: torch.Tensor, ctx: HookContext, alpha: float = 0.98, lamb: float = 2.0) -> torch.Tensor:
    """Grokfast-EMA: ``ema = ema * alpha + g * (1 - alpha)``, return ``g + ema * lamb``; the average starts
    at the first gradient seen (as the reference code's). State per target: ``ctx.state["ema"][target]``."""
    emas = ctx.state.setdefault("ema", {})
    prev = emas.get(ctx.target)
    prev = x if prev is None else _on(prev, x)
    ema = prev * alpha + x * (1 - alpha)
    emas[ctx.target] = ema
    return x + ema * lamb


def _check_ma(window: int = 100, lamb: float = 5.0, warmup: bool = True) -> None:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise TransformArgsError(f"needs an integer window >= 1, got {window!r}.")
    if not isinstance(lamb, (int, float)) or isinstance(lamb, bool):
        raise TransformArgsError(f"needs a number lamb (the amplification), got {lamb!r}.")
    if not isinstance(warmup, bool):
        raise TransformArgsError(f"needs warmup true or false, got {warmup!r}.")


def _ma_push(states: dict[str, Any], name: str, x: torch.Tensor, window: int) -> dict[str, Any]:
    """Write ``x`` into the target's ring buffer of the last ``window`` gradients; returns its state."""
    st = states.get(name)
    if st is None:
        st = states[name] = {"buf": torch.empty((window, *x.shape), dtype=x.dtype, device=x.device), "count": 0,
                             "next": 0}
    st["buf"] = _on(st["buf"], x)
    st["buf"][st["next"]].copy_(x)
    st["next"] = (st["next"] + 1) % window
    st["count"] = min(st["count"] + 1, window)
    return st


def _ma_order(st: dict[str, Any], window: int) -> list[int]:
    """Ring positions from the oldest gradient to the newest."""
    first = (st["next"] - st["count"]) % window
    return [(first + i) % window for i in range(st["count"])]


def _ma_amplify_(xs: list[torch.Tensor], ctx: HookContext, window: int = 100, lamb: float = 5.0,
                 warmup: bool = True) -> None:
    states = ctx.state.setdefault("ma", {})
    assert ctx.targets is not None
    sts = [_ma_push(states, n, x, window) for n, x in zip(ctx.targets, xs, strict=True)]
    groups: dict[tuple[int, ...], list[int]] = {}  # targets whose windows line up are summed together
    for i, st in enumerate(sts):
        if not warmup or st["count"] == window:
            groups.setdefault(tuple(_ma_order(st, window)), []).append(i)
    for order, picks in groups.items():
        bufs = [sts[i]["buf"] for i in picks]
        total = torch._foreach_add([b[order[0]] for b in bufs], 0)  # sum() starts from 0: -0.0 becomes 0.0
        for pos in order[1:]:
            torch._foreach_add_(total, [b[pos] for b in bufs])
        torch._foreach_div_(total, len(order))
        torch._foreach_add_([xs[i] for i in picks], torch._foreach_mul(total, lamb))


@register_transform("ma_amplify", batched=_ma_amplify_, check=_check_ma, value_dependent=True, stateful=True)
def ma_amplify(x: torch.Tensor, ctx: HookContext, window: int = 100, lamb: float = 5.0,
               warmup: bool = True) -> torch.Tensor:
    """Grokfast-MA: keep the last ``window`` gradients (this one included) and return ``g + mean * lamb``,
    the mean summed from the oldest. With ``warmup`` (the reference's default) the gradient passes
    unchanged until the window is full. State per target: a ring buffer ``ctx.state["ma"][target]``."""
    st = _ma_push(ctx.state.setdefault("ma", {}), ctx.target, x, window)
    if warmup and st["count"] < window:
        return x
    order = _ma_order(st, window)
    buf = st["buf"]
    total = buf[order[0]] + 0  # sum() starts from 0: -0.0 becomes 0.0
    for pos in order[1:]:
        total.add_(buf[pos])
    return x + (total / len(order)) * lamb


register_transform_alias("zero_ablate", of="zero", doc="Alias of zero: replace an activation by zeros (zero ablation).")
register_transform_alias("negate", of="scale", translate=lambda: {"factor": -1.0},
                         doc="Alias of scale(factor=-1): ``-x``.")


def _reverse(lambd: float = 1.0) -> dict[str, Any]:
    return {"factor": -lambd}


register_transform_alias("reverse", of="scale", translate=_reverse, arg_aliases={"lambda": "lambd"},
                         doc="Alias of scale(factor=-lambda): gradient reversal (Ganin & Lempitsky 2015); "
                             "use on a gradient kind.")


# ----------------------------------------------------------------------------------------------------
# Binding a transform to a spec: arguments checked once, before any hook fires.


class Transform:
    """A Python callable as a transform, with an optional batched in-place version for ``pre_step``::

        attach(model, {"c": {"target": "*", "kind": "pre_step",
                             "transform": Transform(my_clip, batched=my_clip_)}}, optimizer)

    ``fn(x[, ctx], **args) -> Tensor`` works out of place; ``batched(xs, ctx, **args)`` modifies the list
    of tensors in place and must give the same bits as ``fn`` on each.
    """

    def __init__(self, fn: TransformFn, *, batched: BatchedFn | None = None, name: str | None = None,
                 structured: bool = False, value_dependent: bool = False):
        if not callable(fn):
            raise TypeError(f"Transform needs a callable, got {fn!r}")
        self.fn, self.batched, self.structured, self.value_dependent = fn, batched, structured, value_dependent
        self.name = name or getattr(fn, "__qualname__", None) or repr(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Transform({self.name})"


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
    """A transform with its checked arguments and the per-spec state it keeps across calls.

    ``call`` is the function with its arguments bound (``call(x, ctx)``, or ``call(x)`` when
    ``wants_ctx`` is false); ``needs_ctx`` says whether the context must be filled in (else None is
    passed, and the engine builds nothing on that call).
    """

    name: str
    fn: TransformFn
    args: dict[str, Any]
    batched: BatchedFn | None = None
    structured: bool = False
    value_dependent: bool = False
    wants_ctx: bool = True
    needs_ctx: bool = True
    stateful: bool = False
    alias_of: str | None = None
    state: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.call: Callable[..., Any] = functools.partial(self.fn, **self.args) if self.args else self.fn

    def __call__(self, x: Any, ctx: HookContext | None) -> Any:
        return self.call(x, ctx) if self.wants_ctx else self.call(x)

    def batch_key(self) -> tuple[Any, ...] | None:
        """Transforms with equal keys can run as one batched call over all their tensors. Stateful ones keep
        their state per spec, so they batch within their own spec only."""
        if self.batched is None:
            return None
        key = (self.name, tuple(sorted((k, repr(v)) for k, v in self.args.items())))
        return (*key, id(self)) if self.stateful else key


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
    _check_numbers(fn, args, name, spec)


def _check_numbers(fn: TransformFn, args: dict[str, Any], name: str, spec: str) -> None:
    """An argument its signature types as a number (``min: float | None``) must be one: ``args.min=abc`` from
    the command line is an error here, not a TypeError inside the first hook call."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # annotations a user wrote that do not evaluate: nothing to check against
        return
    for key, value in args.items():
        hint = hints.get(key)
        if hint is None or value is None:
            continue
        allowed = set(typing.get_args(hint)) or {hint}
        numeric = allowed & {int, float}
        if numeric and allowed <= {int, float, type(None)} and (
                not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise TransformArgsError(f"transform {name!r} takes a number for {key!r}, got {value!r}.", spec=spec,
                                     field=f"args.{key}")


def _bind_callable(fn: Callable[..., Any], args: dict[str, Any], name: str, spec: str, **extra: Any) -> BoundTransform:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    wants_ctx = any(p.name == "ctx" for p in params) or len(positional) - len(
        [p for p in positional if p.name in args]) >= 2
    if params:
        _check_args(fn, args, name, spec, skip=2 if wants_ctx else 1)
    return BoundTransform(name, fn, args, wants_ctx=wants_ctx, needs_ctx=wants_ctx, **extra)


def bind_transform(transform: Any, args: Mapping[str, Any], spec: str) -> BoundTransform:
    """Look up (or import, or wrap) the transform and check its arguments against its signature."""
    args = dict(args)
    if isinstance(transform, Mapping):
        extra = {k: v for k, v in transform.items() if k != "_target_"}
        path = str(transform["_target_"])
        return _bind_callable(_locate(path, spec), {**extra, **args}, path, spec)
    if isinstance(transform, Transform):
        return _bind_callable(transform.fn, args, transform.name, spec, batched=transform.batched,
                              structured=transform.structured, value_dependent=transform.value_dependent)
    if callable(transform):
        name = getattr(transform, "__qualname__", None) or repr(transform)
        return _bind_callable(transform, args, name, spec)
    info = TRANSFORMS.get(transform)
    if info is None:  # parse_specs catches this first; kept for direct callers
        raise SpecError(f"unknown transform {transform!r}.", spec=spec, field="transform")
    args = {info.arg_aliases.get(k, k): v for k, v in args.items()}
    if info.alias_of is not None:
        if info.translate is not None:
            _check_args(info.translate, args, info.name, spec, skip=0)
            args = info.translate(**args)
        target = TRANSFORMS[info.alias_of]
    else:
        target = info
    _check_args(target.fn, args, info.name, spec, skip=2)
    if target.check is not None:
        try:
            target.check(**args)
        except TransformArgsError as e:
            raise TransformArgsError(f"transform {info.name!r} {e}", spec=spec, field="args") from None
    return BoundTransform(info.name, target.fn, args, target.batched, target.structured, target.value_dependent,
                          True, target.needs_ctx, target.stateful, info.alias_of)
