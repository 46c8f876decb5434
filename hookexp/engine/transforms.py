"""The built-in transforms, registered on import: ``fn(x, ctx, **args) -> Tensor``, out of place.

Each may have a batched in-place version for ``pre_step`` (the same bits, checked by the tests on every floating
dtype) and an argument check; its argument defaults are written once, in its signature (the engine passes them
to the check and the batched version). docs/transforms.md lists them; :mod:`hookexp.engine.registry` has the
contract.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hookexp.engine.context import HookContext, Record
from hookexp.engine.registry import (
    TRANSFORMS,
    BatchedFn,
    TransformFn,
    TransformInfo,
    register_transform,
    register_transform_alias,
)
from hookexp.engine.values import detach_copy
from hookexp.errors import TransformArgsError

__all__ = ["TRANSFORMS", "BatchedFn", "TransformFn", "TransformInfo", "register_transform",
           "register_transform_alias"]

log = logging.getLogger("hookexp.transforms")


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


def _check_bounds(min: float | None, max: float | None) -> None:
    if min is None and max is None:
        raise TransformArgsError("needs at least one of 'min' and 'max', e.g. args: {min: 0.0}.")
    if min is not None and max is not None and min > max:
        raise TransformArgsError(f"has min ({min}) greater than max ({max}).")


def _clamp_(xs: list[torch.Tensor], ctx: HookContext, min: float | None, max: float | None) -> None:
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
def quantize(x: torch.Tensor, ctx: HookContext, step: float, straight_through: bool = False) -> torch.Tensor:
    """Round to the nearest multiple of ``step``. Rounding's gradient is zero: on a forward-side kind nothing below
    learns, unless ``straight_through`` (the gradient passes unchanged, as quantization-aware training does)."""
    q = torch.round(x / step) * step
    return x + (q - x).detach() if straight_through else q


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


def _check_noise(std: float, gamma: float, seed: int | None) -> None:
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


def _check_mask(p: float | None, index: Any, dim: int | None, seed: int | None) -> None:
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


def _check_ema(alpha: float, lamb: float) -> None:
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0.0 <= alpha <= 1.0:
        raise TransformArgsError(f"needs 0 <= alpha <= 1 (the EMA's momentum), got {alpha!r}.")
    if not isinstance(lamb, (int, float)) or isinstance(lamb, bool):
        raise TransformArgsError(f"needs a number lamb (the amplification), got {lamb!r}.")


def _on(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t if t.device == x.device else t.to(x.device)  # state restored from a checkpoint on another device


def _ema_amplify_(xs: list[torch.Tensor], ctx: HookContext, alpha: float, lamb: float) -> None:
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


def _check_ma(window: int, lamb: float, warmup: bool) -> None:
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


def _ma_amplify_(xs: list[torch.Tensor], ctx: HookContext, window: int, lamb: float, warmup: bool) -> None:
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
