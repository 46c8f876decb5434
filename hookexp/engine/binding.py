"""The per-call path: one spec bound to its transform and targets, and the code every torch hook runs.

A :class:`SpecBinding` holds a spec's transform, its kind (:class:`KindInfo`, what the kind registry
keeps), its schedule state and counters; a :class:`Site` is one target of it, the object a torch hook
closes over (never the module or a tensor). The path a hook call takes is kept short because it runs on
every forward/backward of every hooked module: one attribute check (``binding.active``, recomputed when
the step or a pause changes, not per call), :meth:`SpecBinding.call` (two counters, and errors named
after the spec), the transform, and a metadata check of its result (shape/dtype/device/``_version``; no
host sync). A context object is filled in only for transforms that read it, and effects are measured
only while ``clock.measuring``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import torch
from torch import nn

from hookexp.engine import values
from hookexp.engine.bound import BoundTransform
from hookexp.engine.context import HookContext, Record
from hookexp.engine.schema import HookSpec, Value
from hookexp.engine.shards import Shards, local_shard
from hookexp.engine.values import Selector
from hookexp.errors import HookexpError, HookRuntimeError, HookWarning, SpecError, TransformOutputError

if TYPE_CHECKING:
    from hookexp.engine.aliases import Resolved
    from hookexp.engine.targets import Target

R = TypeVar("R")


class AttachSite(Protocol):
    """What a kind needs from the handle it attaches into."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None

    def add_pre_step(self, site: Site) -> Any: ...

    def ran(self, site: Site) -> None: ...


Attach = Callable[["Site", AttachSite], list[Any]]
Check = Callable[["Site", AttachSite], None]
Stage = Literal["forward", "backward", "step"]


@dataclass(frozen=True)
class KindInfo:
    """A registered hook kind (:func:`hookexp.engine.kinds.register_kind`): its facts, and the functions that
    attach its torch hooks to one target and check, before anything is attached, that it can work there."""

    name: str
    on: Literal["module", "parameter"]
    stage: Stage  # when it fires: in forward, in backward (sees fp16-scaled grads), before optimizer.step
    torch_api: str
    sees: str
    value: Value
    attach: Attach
    check: Check | None = None


@dataclass
class Clock:
    """The training step the hooks are in, and whether this step measures hook effects."""

    step: int = 0
    measuring: bool = True
    ignore_schedule: bool = False  # validation: act on every call, whatever the step window says


class Site:
    """One target of one spec: what that target's torch hooks call, with its own counters."""

    __slots__ = ("acting", "binding", "calls", "ctx", "empty", "empty_why", "input", "name", "obj", "shards", "target",
                 "warned")

    def __init__(self, binding: SpecBinding, target: Target):
        self.binding = binding
        self.target = target
        self.name = target.name
        self.obj = target.obj
        self.calls = 0
        self.empty = 0  # calls on which the transform saw no tensor
        self.empty_why = ""
        self.warned = False
        self.ctx: HookContext | None = None  # made at the first call of a transform that reads it
        self.input: tuple[str, int | None] | None = None  # `input:` resolved: (name, position or None)
        self.shards: Shards | None = None  # parameter kinds under FSDP: the gradient's shard groups
        self.acting = False  # under torch.compile: whether the forward-side call now running acts (enter_traced)


class SpecBinding:
    """One spec bound to its transform and targets; the object every torch hook of the spec calls."""

    def __init__(self, spec: HookSpec, kind: KindInfo, transform: BoundTransform, targets: list[Target],
                 clock: Clock, alias: Resolved | None = None):
        self.spec = spec
        self.kind = kind
        self.transform = transform
        self.targets = targets
        self.alias = alias
        self.clock = clock
        self.sites = [Site(self, t) for t in targets]
        self.alive = True
        self.paused = False  # attached but idle (HookHandle.pause): e.g. record specs waiting for a spike
        self.active = False
        self.train_phase: bool | None = None if kind.stage != "forward" else {"train": True, "eval": False,
                                                                               "both": None}[spec.phase]
        self.index = spec.index
        self.select = Selector(spec.select) if spec.select is not None else None
        # a tensor goes straight to the transform: the forward hooks' shortcut for the common case
        self.plain = self.index is None and self.select is None and not transform.structured
        self.calls = 0
        self.calls_last_step = 0
        self._calls_at_step_start = 0
        self.records: list[Record] = []
        self.notes: dict[str, set[str]] = {}
        self.cut_sites: dict[str, int | None] = {}  # target -> the step the transform first cut it from the graph
        self.phase_warned = False  # skipped_for_phase said so
        self.emitted: dict[str, list[torch.Tensor]] = {}  # ctx.emit() measurements since the last stats()
        self._effect_sum: torch.Tensor | None = None  # [sum |y-x|, sum cos(x, y), elements changed], on device
        self._same = 0  # measured tensors the transform returned unchanged: change 0, cosine 1, nothing changed
        self._effect_tensors = 0
        self._effect_numel = 0
        self.refresh()

    # -- schedule ----------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Recompute whether the hooks act now (called when the step, the pause or the schedule changes):
        attached and switched on, and inside the spec's step window (or the dry run, which ignores it)."""
        switched_on = self.alive and self.spec.enabled and not self.paused
        in_window = self.clock.ignore_schedule or self.spec.active_at(self.clock.step)
        self.active = switched_on and in_window

    def live(self, training: bool | None) -> bool:
        """Whether the hook acts now: attached, in its step window, and (forward kinds) in its phase."""
        return self.active and (training is None or self.train_phase is None or training is self.train_phase)

    def live_in(self, site: Site, training: bool) -> bool:
        """:meth:`live` for a forward-side call on a module in mode ``training``; a call skipped for the spec's
        phase is said once (:meth:`skipped_for_phase`)."""
        if self.live(training):
            return True
        if self.active:
            self.skipped_for_phase(site, training)
        return False

    # -- under torch.compile (hookexp.engine.traced) ------------------------------------------------
    @property
    def traceable(self) -> bool:
        """Whether a forward-side hook of this spec can be traced by torch.compile: its transform reads no context
        (so neither the step nor per-spec state) and acts on tensors, and no ``index``/``select`` picks a part."""
        tf = self.transform
        return not tf.needs_ctx and not tf.structured and self.index is None and self.select is None

    def enter_traced(self, site: Site, training: bool) -> bool:
        """A traced forward-side call reaching Python when the graph runs: whether it acts (counted if so)."""
        site.acting = self.live_in(site, training)
        if site.acting:
            self.calls += 1
            site.calls += 1
        return site.acting

    def measure_traced(self, site: Site, pairs: list[torch.Tensor]) -> None:
        """What the traced transform did (``pairs``: the acting flag, then input and result of each tensor) on a
        measured step, as :meth:`apply_tensor` measures it; a result that is its input counts as unchanged."""
        if site.acting and self.clock.measuring:
            for x, y in zip(pairs[1::2], pairs[2::2], strict=True):
                same = y.data_ptr() == x.data_ptr() and y.shape == x.shape and y.stride() == x.stride()
                self.measure(x, x if same else y, site.shards)

    def end_step(self) -> None:
        self.calls_last_step = self.calls - self._calls_at_step_start
        self._calls_at_step_start = self.calls

    @property
    def calls_by_target(self) -> Counter[str]:
        return Counter({s.name: s.calls for s in self.sites if s.calls})

    def set_counts(self, calls: int, by_target: dict[str, int], last_step: int) -> None:
        """Restore the counters (a resumed run)."""
        self.calls = self._calls_at_step_start = calls
        self.calls_last_step = last_step
        for s in self.sites:
            s.calls = int(by_target.get(s.name, 0))

    def note(self, target: str, event: str) -> None:
        self.notes.setdefault(target, set()).add(event)

    # -- the per-call path ------------------------------------------------------------------------
    def call(self, site: Site, fn: Callable[..., R], *args: Any, counted: bool = True) -> R:
        """``fn(*args)`` as one call of this spec's hook on ``site``: counted (``counted=False``: a hook that
        only registers the hooks that will act, on tensors or autograd Nodes), and an error that is not already
        hookexp's raised as :meth:`failure`, naming the spec, the target and the step."""
        if counted:
            self.calls += 1
            site.calls += 1
        try:
            return fn(*args)
        except HookexpError:
            raise
        except Exception as e:
            raise self.failure(e, site) from e

    def failure(self, error: BaseException, site: Site) -> HookRuntimeError:
        """A torch (or user) error raised inside one of this spec's hooks, as an error naming the spec."""
        return HookRuntimeError(
            f"transform {self.transform.name!r} failed on target {site.name!r} (kind {self.spec.kind!r}) "
            f"at step {self.clock.step}: {type(error).__name__}: {error}", spec=self.spec.name, field="transform")

    def apply(self, value: Any, site: Site, aux: Any = None) -> Any:
        """Run the transform on what a torch hook saw (``index`` picks an element first); returns the value
        torch should use: the same object when nothing changed, else one of the same type."""
        if self.index is None:
            return self.apply_value(value, site, aux, None)
        try:
            key = values.locate(value, self.index)
        except LookupError as e:
            raise SpecError(f"{e} (target {site.name!r}, kind {self.spec.kind!r}).", spec=self.spec.name,
                            field="index") from None
        elem = values.get(value, key)
        new = self.apply_value(elem, site, aux, self.index if key is None else key)
        if new is elem:
            return value
        return new if key is None else values.rebuild(value, {key: new})

    def apply_value(self, value: Any, site: Site, aux: Any, index: int | str | None) -> Any:
        """The transform on a value already picked: a tensor, or each tensor at the top of a structure."""
        if isinstance(value, torch.Tensor):
            return self.apply_tensor(value, site, aux, index)
        if self.transform.structured:
            if not values.has_tensor(value):
                self.saw_nothing(site, "the value holds no tensor")
            return self.transform(value, self._ctx(site, aux, index))
        new, seen = values.map_tensors(
            value, lambda t, k: self.apply_tensor(t, site, aux, k if index is None else index))
        if not seen:
            self.saw_nothing(site, f"the value is {_describe(value)}")
        return new

    def apply_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], site: Site) -> Any:
        """``forward_pre``: the transform on the inputs (``input:`` one of them by name); returns None (torch
        keeps its inputs) or the new ``(args, kwargs)``."""
        if site.input is not None:
            name, pos = site.input
            if name in kwargs:
                new = self.apply(kwargs[name], site)
                return None if new is kwargs[name] else (args, {**kwargs, name: new})
            if pos is not None and pos < len(args):
                new = self.apply(args[pos], site)
                return None if new is args[pos] else (values.rebuild(args, {pos: new}), kwargs)
            self.saw_nothing(site, f"input {name!r} was not passed")
            return None
        if self.index is not None or self.transform.structured or not kwargs:
            value = args if not kwargs or self.index is not None else (args, kwargs)
            new = self.apply(value, site)
            if new is value:
                return None
            return (new, kwargs) if value is args else new

        def fn(t: torch.Tensor, k: int | str | None) -> torch.Tensor:
            return self.apply_tensor(t, site, None, k)

        new_args, seen_args = values.map_tensors(args, fn)
        new_kwargs, seen_kwargs = values.map_tensors(kwargs, fn)
        if not (seen_args or seen_kwargs):
            self.saw_nothing(site, "no input is a tensor")
        return None if new_args is args and new_kwargs is kwargs else (new_args, new_kwargs)

    def apply_in_place(self, grad: torch.Tensor, site: Site) -> None:
        """For the kinds that own a ``.grad`` (post_accumulate, pre_step): transform it out of place,
        as every transform does, and write the result back into the same tensor. Under FSDP the transform sees
        this rank's shard (``ctx.shards`` says so; ``ctx.sum_over_shards`` gives whole-tensor sums)."""
        local, site.shards = local_shard(grad)
        new = self.apply(local, site)
        if new is not local:
            with torch.no_grad():
                local.copy_(new)

    def apply_tensor(self, x: torch.Tensor, site: Site, aux: Any, index: int | str | None) -> torch.Tensor:
        sel = self.select
        part = x if sel is None else self._take(sel, x, site)
        version = part._version
        tf = self.transform
        if not tf.wants_ctx:
            y = tf.call(part)
        elif tf.needs_ctx:
            y = tf.call(part, self._ctx(site, aux, index))
        else:
            y = tf.call(part, None)
        if part._version != version:
            raise TransformOutputError(
                f"transform {tf.name!r} modified its input in place on {_where(site, index)}. Transforms must "
                "work out of place: return a new tensor (x.clamp(...), not x.clamp_(...)).",
                spec=self.spec.name, field="transform")
        if y is part:
            if self.clock.measuring:
                self.measure(part, part, site.shards)
            return x
        if not isinstance(y, torch.Tensor):
            raise TransformOutputError(
                f"transform {tf.name!r} returned {type(y).__name__} on {_where(site, index)}; it must return a "
                f"tensor of shape {tuple(part.shape)}, dtype {part.dtype}, device {part.device}.",
                spec=self.spec.name, field="transform")
        if y.shape != part.shape or y.dtype != part.dtype or y.device != part.device:
            raise TransformOutputError(
                f"transform {tf.name!r} changed the tensor on {_where(site, index)} (kind {self.spec.kind!r}): "
                f"expected shape {tuple(part.shape)}, {part.dtype}, {part.device}; got shape {tuple(y.shape)}, "
                f"{y.dtype}, {y.device}. A hook must keep shape, dtype and device.",
                spec=self.spec.name, field="transform")
        if sel is None and part.requires_grad and not y.requires_grad and torch.is_grad_enabled():
            self.cut_graph(site)  # (a slice put back into x leaves the rest of x in the graph: nothing is cut)
        if self.clock.measuring:
            self.measure(part, y, site.shards)
        return y if sel is None else sel.put(x, y)

    def _take(self, sel: Selector, x: torch.Tensor, site: Site) -> torch.Tensor:
        try:
            return sel.take(x)
        except LookupError as e:
            raise SpecError(f"{e} (target {site.name!r}, kind {self.spec.kind!r}).", spec=self.spec.name,
                            field="select") from None

    def _ctx(self, site: Site, aux: Any, index: int | str | None) -> HookContext:
        ctx = site.ctx
        if ctx is None:
            ctx = site.ctx = HookContext(self.spec.name, self.spec.kind, site.name, 0, state=self.transform.state,
                                         records=self.records, emitted=self.emitted)
        ctx.step = self.clock.step
        ctx.index = index
        ctx.aux = aux
        ctx.measuring = self.clock.measuring
        ctx.shards = site.shards
        return ctx

    def cut_graph(self, site: Site) -> None:
        """The transform returned a tensor that no longer requires grad while its input did: nothing before the
        target gets a gradient through it. Intended in a stop-gradient or an ablation in training; a mistake
        (``.detach()``, ``.data``) otherwise: a one-time warning, and the name :meth:`HookHandle.explain` gives
        when torch then finds a loss without a graph."""
        if site.name not in self.cut_sites:
            self.cut_sites[site.name] = None if self.clock.ignore_schedule else self.clock.step
            if not self.clock.ignore_schedule:
                warnings.warn(HookWarning(
                    f"hooks.{self.spec.name}: transform {self.transform.name!r} returned a tensor cut from the "
                    f"autograd graph at target {site.name!r} at step {self.clock.step} (its input requires grad, its "
                    "output does not), so nothing before it gets a gradient through it. Intended for a stop-gradient "
                    "or an ablation; otherwise return a result computed from the input (not x.detach() or x.data)."),
                    stacklevel=3)

    def skipped_for_phase(self, site: Site, training: bool) -> None:
        """A forward-side call skipped because the module is in the mode the spec's phase leaves out. Said once per
        spec, when a ``train`` spec (the default) meets a module in eval mode before it ever acted: the library's
        analysis on an ``eval()`` model, whose output would otherwise equal the unhooked model's without a word.
        (The trainer trains first, so its ``train`` specs act before any evaluation; ``phase: eval`` is asked for.)"""
        if training or self.calls or self.phase_warned or self.clock.ignore_schedule:
            return
        self.phase_warned = True
        warnings.warn(HookWarning(
            f"hooks.{self.spec.name}: skipped at target {site.name!r}: the module is in eval mode and the spec's "
            f"phase is {self.spec.phase!r} (the default), so the {self.spec.kind!r} hook does nothing here. Set "
            "phase: eval (evaluation only) or phase: both to act in eval mode, or call model.train()."), stacklevel=3)

    def saw_nothing(self, site: Site, why: str) -> None:
        """The transform saw no tensor on this call: a dry-run error, and a one-time warning in training."""
        site.empty += 1
        site.empty_why = why
        if not site.warned and not self.clock.ignore_schedule:
            site.warned = True
            warnings.warn(HookWarning(
                f"hooks.{self.spec.name}: the transform saw no tensor at target {site.name!r} (kind "
                f"{self.spec.kind!r}: {why}), so the hook does nothing there. {_fix_for(self.spec)}"), stacklevel=3)

    # -- measuring --------------------------------------------------------------------------------
    def measure(self, before: torch.Tensor, after: torch.Tensor, shards: Shards | None = None) -> None:
        """Accumulate what the hook did to one tensor, on device (read back by ``HookHandle.stats``). ``shards``:
        ``before`` is this rank's shard of a sharded gradient (FSDP), measured as the whole tensor."""
        if shards is not None:  # every rank takes part in the sum over the shards, changed here or not
            with torch.no_grad():
                self.add_effects(effect_rows([before], [after], shards)[0], 1, shards.numel)
            return
        if after is before:  # returned unchanged: change 0, cosine 1, nothing changed; no tensor op
            self._same += 1
            self._effect_tensors += 1
            self._effect_numel += before.numel()
            return
        self.measure_many([before], [after])

    def measure_many(self, before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
        """:meth:`measure` for several tensors at once. Tensors returned unchanged cost nothing."""
        changed = [(x, y) for x, y in zip(before, after, strict=True) if y is not x]
        self._same += len(before) - len(changed)
        self._effect_tensors += len(before)
        self._effect_numel += sum(x.numel() for x in before)
        if changed:
            with torch.no_grad():
                rows = effect_rows([x for x, _ in changed], [y for _, y in changed])
            self.add_effects(rows.sum(dim=0))

    def add_effects(self, row: torch.Tensor, tensors: int = 0, numel: int = 0) -> None:
        """Add summed ``[change, cosine, changed]`` rows (and, when not counted yet, their tensors and elements)."""
        self._effect_tensors += tensors
        self._effect_numel += numel
        self._effect_sum = row if self._effect_sum is None else self._effect_sum + row.to(self._effect_sum.device)

    def effects(self, reset: bool) -> tuple[torch.Tensor | None, int, int, int]:
        """(device sums, tensors returned unchanged, tensors measured, elements measured) since the last reset."""
        out = (self._effect_sum, self._same, self._effect_tensors, self._effect_numel)
        if reset:
            self._effect_sum, self._same, self._effect_tensors, self._effect_numel = None, 0, 0, 0
        return out


def effect_rows(before: list[torch.Tensor], after: list[torch.Tensor], shards: Shards | None = None) -> torch.Tensor:
    """What a hook did to each tensor pair, in float32: ``[‖y - x‖, cos(x, y), elements changed]`` (``[n, 3]``,
    on the device). Four foreach norms and one subtraction whatever the number of tensors; the dot product
    comes from the norms (``x·y = (‖x‖² + ‖y‖² - ‖y - x‖²) / 2``). A zero tensor has cosine 0 with anything.
    ``shards``: the tensors are this rank's shards (FSDP); squared norms and counts are summed over the shards
    (one all-reduce, as the gradient statistics are), so that the rows describe the whole tensors."""
    xs = [t.detach() if t.dtype == torch.float32 else t.detach().float() for t in before]
    ys = [t.detach() if t.dtype == torch.float32 else t.detach().float() for t in after]
    diff = torch._foreach_sub(ys, xs)
    change, nx, ny = (torch.stack(torch._foreach_norm(v)) for v in (diff, xs, ys))
    # elements changed: the L1 norm of sign(y - x) (a count-nonzero norm, ord 0, is several times slower on the CPU)
    changed = torch.stack(torch._foreach_norm(torch._foreach_sign(diff), 1))
    if shards is not None:
        summed = shards.sum(torch.stack([change.square(), nx.square(), ny.square(), changed]))
        change, nx, ny = summed[:3].sqrt().unbind()
        changed = summed[3]
    dot = (nx.square() + ny.square() - change.square()) / 2
    cos = (dot / (nx * ny).clamp(min=1e-12)).clamp(-1.0, 1.0)
    return torch.stack([change, cos, changed], dim=1)


def _where(site: Site, index: int | str | None) -> str:
    step = f" at step {site.binding.clock.step}" if not site.binding.clock.ignore_schedule else ""
    return f"target {site.name!r}" + (f"[{index!r}]" if index is not None else "") + step


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if values.is_structured(value):
        return f"a {type(value).__name__} without tensors"
    return f"a {type(value).__name__}, not a tensor"


def _fix_for(spec: HookSpec) -> str:
    if spec.input is not None:
        return f"Check that the module is called with {spec.input!r} (positionally or by keyword)."
    if spec.index is not None:
        return f"Check that index {spec.index!r} picks a tensor."
    if spec.kind in ("backward", "backward_legacy"):
        return "grad_input holds grads w.r.t. the module inputs: None where the input needs no grad (a first layer)."
    return "Check the target and kind."
