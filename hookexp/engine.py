"""The hook engine: specs in, torch hooks attached, one handle that owns and removes them.

``attach(model, specs, optimizer=None)`` parses every spec, resolves every target and runs every
compatibility check *before* attaching anything, so a bad config attaches nothing. It returns a
:class:`HookHandle`, a context manager in the style of TransformerLens' hook points: leaving the
``with`` block (also by an exception) removes exactly the hooks this handle attached.

Memory: torch hooks close over a :class:`SpecBinding` (spec, transform, counters), never over modules
or tensors; the handle keeps the model and parameters through weak references; records hold detached
copies. So a handle cannot keep a model or an autograd graph alive.

Cost: on every call a binding checks the schedule, counts the call and checks the transform's result
(shape/dtype/device/``_version``: metadata, no host sync). Measuring what a hook did (norm of the
change, cosine, fraction changed) runs only while ``handle.measuring`` is true; the trainer turns it on
for log steps only. This module imports neither Hydra nor W&B.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookexp.errors import (
    HookCompatibilityError,
    HookexpError,
    HookRuntimeError,
    SpecError,
    TransformOutputError,
)
from hookexp.kinds import KINDS, KindInfo
from hookexp.specs import HookSpec, SpecsLike, parse_specs
from hookexp.targets import Target, resolve
from hookexp.transforms import BoundTransform, HookContext, Record, bind_transform


@dataclass
class Clock:
    """The training step the hooks are in, and whether this step measures hook effects."""

    step: int = 0
    measuring: bool = True
    ignore_schedule: bool = False  # validation: act on every call, whatever the step window says


class SpecBinding:
    """One spec bound to its transform and targets; the object every torch hook of the spec calls."""

    def __init__(self, spec: HookSpec, kind: KindInfo, transform: BoundTransform, targets: list[Target],
                 clock: Clock):
        self.spec = spec
        self.kind = kind
        self.transform = transform
        self.targets = targets
        self.clock = clock
        self.alive = True
        self.calls = 0
        self.calls_by_target: Counter[str] = Counter()
        self.calls_last_step = 0
        self._calls_at_step_start = 0
        self.records: list[Record] = []
        self.notes: dict[str, set[str]] = {}
        self.emitted: dict[str, list[torch.Tensor]] = {}  # ctx.emit() measurements since the last stats()
        self._effect_sum: torch.Tensor | None = None  # [sum |y-x|, sum cos(x, y), elements changed]
        self._effect_tensors = 0
        self._effect_numel = 0

    # -- called by the kinds' torch hooks --------------------------------------------------------
    def live(self, training: bool | None) -> bool:
        """Whether the hook acts now: attached, in its step window, and (forward kinds) in its phase."""
        if not self.alive:
            return False
        if training is not None and not self.spec.allows_phase(training):
            return False
        return self.clock.ignore_schedule or self.spec.active_at(self.clock.step)

    def note(self, target: str, event: str) -> None:
        self.notes.setdefault(target, set()).add(event)

    def count(self, target: str) -> None:
        self.calls += 1
        self.calls_by_target[target] += 1

    def apply(self, value: Any, target: str, aux: Any = None, index: int | None = None) -> Any:
        """Run the transform on what a torch hook saw; returns the value torch should use."""
        self.count(target)
        ctx = HookContext(self.spec.name, self.spec.kind, target, self.clock.step, index, aux,
                          self.transform.state, self.records, self.clock.measuring, self.emitted)
        try:
            return self._apply(value, ctx)
        except HookexpError:
            raise
        except Exception as e:
            raise HookRuntimeError(
                f"transform {self.transform.name!r} failed on target {target!r} (kind {self.spec.kind!r}) "
                f"at step {self.clock.step}: {type(e).__name__}: {e}",
                spec=self.spec.name, field="transform",
            ) from e

    def apply_in_place(self, grad: torch.Tensor, target: str) -> None:
        """For the kinds that own a ``.grad`` (post_accumulate, pre_step): transform it out of place,
        as every transform does, and write the result back into the same tensor."""
        new = self.apply(grad, target)
        if new is not grad:
            with torch.no_grad():
                grad.copy_(new)

    # -- internals ------------------------------------------------------------------------------
    def _apply(self, value: Any, ctx: HookContext) -> Any:
        pick = self.spec.index
        if pick is not None and isinstance(value, (tuple, list)):
            if not -len(value) <= pick < len(value):
                raise SpecError(
                    f"index {pick} is out of range: target {ctx.target!r} gives a tuple of {len(value)} "
                    f"values here (kind {self.spec.kind!r}).", spec=self.spec.name, field="index")
            ctx.index = pick
            new = self._one(value[pick], ctx)
            if new is value[pick]:
                return value
            out = list(value)
            out[pick] = new
            return type(value)(out)
        if self.transform.structured:
            return self.transform(value, ctx)
        return self._map(value, ctx)

    def _map(self, value: Any, ctx: HookContext) -> Any:
        if isinstance(value, torch.Tensor):
            return self._one(value, ctx)
        if isinstance(value, (tuple, list)):
            out = []
            for i, v in enumerate(value):
                ctx.index = i
                out.append(self._one(v, ctx) if isinstance(v, torch.Tensor) else v)
            return value if all(a is b for a, b in zip(out, value, strict=True)) else type(value)(out)
        if isinstance(value, Mapping):
            return {k: self._one(v, ctx) if isinstance(v, torch.Tensor) else v for k, v in value.items()}
        return value  # None and non-tensors pass through

    def _one(self, x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        version = x._version
        y = self.transform(x, ctx)
        where = f"target {ctx.target!r}" + (f"[{ctx.index}]" if ctx.index is not None else "")
        if x._version != version:
            raise TransformOutputError(
                f"transform {self.transform.name!r} modified its input in place on {where}. Transforms must "
                "work out of place: return a new tensor (x.clamp(...), not x.clamp_(...)).",
                spec=self.spec.name, field="transform")
        if y is x:
            if self.clock.measuring:
                self.measure(x, x)
            return x
        if not isinstance(y, torch.Tensor):
            raise TransformOutputError(
                f"transform {self.transform.name!r} returned {type(y).__name__} on {where}; it must return a "
                f"tensor of shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}.",
                spec=self.spec.name, field="transform")
        if y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
            raise TransformOutputError(
                f"transform {self.transform.name!r} changed the tensor on {where} (kind {self.spec.kind!r}): "
                f"expected shape {tuple(x.shape)}, {x.dtype}, {x.device}; got shape {tuple(y.shape)}, "
                f"{y.dtype}, {y.device}. A hook must keep shape, dtype and device.",
                spec=self.spec.name, field="transform")
        if self.clock.measuring:
            self.measure(x, y)
        return y

    def measure(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """Accumulate what the hook did to one tensor, on device (read back by ``HookHandle.stats``)."""
        with torch.no_grad():
            xf = before.detach().reshape(-1).float()
            yf = after.detach().reshape(-1).float()
            change = torch.linalg.vector_norm(yf - xf)
            cos = torch.nn.functional.cosine_similarity(xf, yf, dim=0, eps=1e-12)
            changed = (yf != xf).sum().float()
            row = torch.stack([change, cos, changed])
            self._effect_sum = row if self._effect_sum is None else self._effect_sum + row.to(self._effect_sum.device)
        self._effect_tensors += 1
        self._effect_numel += before.numel()

    def take_effects(self) -> tuple[torch.Tensor | None, int, int]:
        out = (self._effect_sum, self._effect_tensors, self._effect_numel)
        self._effect_sum, self._effect_tensors, self._effect_numel = None, 0, 0
        return out

    def end_step(self) -> None:
        self.calls_last_step = self.calls - self._calls_at_step_start
        self._calls_at_step_start = self.calls


class _PreStepEntry:
    """One parameter of one ``pre_step`` spec; ``remove()`` takes it out of the runner."""

    def __init__(self, handle: HookHandle, binding: SpecBinding, target: Target):
        self._handle = weakref.ref(handle)
        self.binding = binding
        self.name = target.name
        self.param = weakref.ref(target.obj)

    def remove(self) -> None:
        handle = self._handle()
        if handle is not None and self in handle._pre_step:
            handle._pre_step.remove(self)


class HookHandle:
    """The hooks one ``attach`` call added. Use as a context manager, or call :meth:`remove`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, measure: bool = True):
        self._model = weakref.ref(model)
        self.optimizer = optimizer
        self.clock = Clock(measuring=measure)
        self.bindings: list[SpecBinding] = []
        self._torch_handles: list[Any] = []
        self._pre_step: list[_PreStepEntry] = []
        self._pre_step_hook: Any = None
        self.removed = False

    # -- the AttachSite protocol the kinds use -------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this hook handle no longer exists")
        return model

    def add_pre_step(self, binding: SpecBinding, target: Target) -> _PreStepEntry:
        entry = _PreStepEntry(self, binding, target)
        self._pre_step.append(entry)
        if self._pre_step_hook is None:
            assert self.optimizer is not None  # the kind's check refused this before
            self._pre_step_hook = self.optimizer.register_step_pre_hook(self._run_pre_step)
        return entry

    # -- the user's API ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.clock.step

    def set_step(self, step: int) -> None:
        """Set the training step the schedules (``every``, ``start_step``, ``end_step``) look at.

        With an optimizer given to ``attach`` the step advances by itself after every optimizer.step().
        """
        if step != self.clock.step:
            for b in self.bindings:
                b.end_step()
        self.clock.step = step

    @property
    def measuring(self) -> bool:
        return self.clock.measuring

    @measuring.setter
    def measuring(self, on: bool) -> None:
        self.clock.measuring = on

    @property
    def specs(self) -> list[HookSpec]:
        return [b.spec for b in self.bindings]

    @property
    def records(self) -> dict[str, list[Record]]:
        """What ``record`` transforms kept, by spec name."""
        return {b.spec.name: b.records for b in self.bindings if b.transform.name == "record"}

    def stats(self, reset: bool = True) -> dict[str, dict[str, float]]:
        """What each spec did: calls (total, last step) and, when measured, the effect of its transform.

        ``change_norm`` is the mean L2 norm of (output - input) per tensor, ``cosine`` the mean cosine
        between them, ``frac_changed`` the fraction of elements the transform changed, all over the
        tensors measured since the last ``stats(reset=True)``. One host sync for all specs.
        """
        values, decode = self.pending_stats(reset)
        return decode(values.tolist() if values is not None else [])

    def pending_stats(self, reset: bool = True) -> tuple[torch.Tensor | None,
                                                         Callable[[list[float]], dict[str, dict[str, float]]]]:
        """:meth:`stats` in two halves, so that a caller can read the device values together with its
        own: the values (on the device; None when nothing was measured) and what turns them, read
        back as a list, into the dict :meth:`stats` returns."""
        taken = [b.take_effects() if reset else (b._effect_sum, b._effect_tensors, b._effect_numel)
                 for b in self.bindings]
        emitted = [(b, name, torch.stack([v.to(values[0].device) for v in values]).mean())
                   for b in self.bindings for name, values in b.emitted.items() if values]
        if reset:
            for b in self.bindings:
                b.emitted.clear()
        device_values = [s for s, _, _ in taken if s is not None] + [m.reshape(1) for _, _, m in emitted]
        calls = [(float(b.calls), float(b.calls_last_step)) for b in self.bindings]

        def decode(values: list[float]) -> dict[str, dict[str, float]]:
            host = iter(values)
            out: dict[str, dict[str, float]] = {}
            for b, (s, n, numel), (total, last) in zip(self.bindings, taken, calls, strict=True):
                row: dict[str, float] = {"calls": total, "calls_last_step": last, "targets": float(len(b.targets))}
                if s is not None:
                    change, cos, changed = next(host), next(host), next(host)
                    row.update(change_norm=change / n, cosine=cos / n, frac_changed=changed / max(numel, 1))
                out[b.spec.name] = row
            for b, name, _ in emitted:
                out[b.spec.name][name] = next(host)
            return out

        if not device_values:
            return None, decode
        return torch.cat([v.to(device_values[0].device).reshape(-1) for v in device_values]), decode

    def table(self) -> list[dict[str, Any]]:
        """The resolved hooks: one row per spec, for manifests, dry runs and W&B tables."""
        rows = []
        for b in self.bindings:
            s = b.spec
            rows.append({
                "spec": s.name, "kind": s.kind, "transform": b.transform.name, "args": dict(b.transform.args),
                "enabled": s.enabled, "targets": [t.name for t in b.targets],
                "aliases": {t.name: list(t.aliases) for t in b.targets if t.aliases},
                "every": s.every, "start_step": s.start_step, "end_step": s.end_step, "phase": s.phase,
            })
        return rows

    def state_dict(self) -> dict[str, Any]:
        """The step, each spec's counters and its transform's generators: what a checkpoint keeps so
        that a resumed run's hooks act (and draw noise) exactly as an uninterrupted run's would."""
        specs = {}
        for b in self.bindings:
            state = b.transform.state
            specs[b.spec.name] = {
                "calls": b.calls, "calls_by_target": dict(b.calls_by_target), "calls_last_step": b.calls_last_step,
                "generators": {k: v.get_state() for k, v in state.items() if isinstance(v, torch.Generator)},
                "seed": state.get("seed"),
            }
        return {"step": self.clock.step, "specs": specs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock.step = int(state["step"])
        for b in self.bindings:
            saved = state["specs"].get(b.spec.name)
            if saved is None:
                continue
            b.calls = b._calls_at_step_start = int(saved["calls"])
            b.calls_by_target = Counter(saved["calls_by_target"])
            b.calls_last_step = int(saved["calls_last_step"])
            if saved.get("seed") is not None:
                b.transform.state["seed"] = saved["seed"]
            for key, gen_state in saved["generators"].items():
                gen = torch.Generator(device=key.split(":", 1)[1])
                gen.set_state(gen_state)
                b.transform.state[key] = gen

    def remove(self) -> None:
        """Remove every hook this handle attached (and only those). Safe to call more than once."""
        for b in self.bindings:
            b.alive = False  # tensor and Node hooks of a graph still in flight become no-ops
        for h in self._torch_handles:
            h.remove()
        self._torch_handles.clear()
        self._pre_step.clear()
        if self._pre_step_hook is not None:
            self._pre_step_hook.remove()
            self._pre_step_hook = None
        self.removed = True

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else f"{len(self._torch_handles) + len(self._pre_step)} hooks"
        return f"HookHandle({', '.join(b.spec.name for b in self.bindings)}; {state})"

    def advance(self, *_: Any) -> None:
        """Move to the next training step (the optimizer's post-step hook calls it)."""
        self.set_step(self.clock.step + 1)

    def _run_pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Run the ``pre_step`` specs: consecutive specs with the same transform and arguments form one
        group, and a group runs as one batched (``torch._foreach_*``) in-place call on the ``.grad``s.
        Declaration order is kept for every parameter."""
        groups: list[tuple[tuple[Any, ...] | None, list[_PreStepEntry]]] = []
        for entry in self._pre_step:
            b = entry.binding
            if not b.live(None):
                continue
            key = b.transform.batch_key()
            same_batch = key is not None and groups and groups[-1][0] == key
            same_spec = key is None and groups and groups[-1][1][0].binding is b
            if same_batch or same_spec:
                groups[-1][1].append(entry)
            else:
                groups.append((key, [entry]))
        with torch.no_grad():
            for key, entries in groups:
                live = [(e, p) for e in entries if (p := e.param()) is not None and p.grad is not None]
                if not live:
                    continue
                if key is None:
                    for e, p in live:
                        e.binding.apply_in_place(p.grad, e.name)
                    continue
                self._run_batched(live)

    def _run_batched(self, live: list[tuple[_PreStepEntry, torch.Tensor]]) -> None:
        first = live[0][0].binding
        grads = [p.grad for _, p in live]
        before = [g.clone() for g in grads] if self.clock.measuring else None
        ctx = HookContext(first.spec.name, "pre_step", "*", self.clock.step, state=first.transform.state)
        try:
            first.transform.batched(grads, ctx, **first.transform.args)  # type: ignore[misc]
        except Exception as error:
            names = sorted({entry.binding.spec.name for entry, _ in live})
            raise HookRuntimeError(
                f"batched transform {first.transform.name!r} failed at step {self.clock.step} on "
                f"{len(grads)} parameters of spec(s) {', '.join(names)}: {type(error).__name__}: {error}",
                spec=first.spec.name, field="transform") from error
        for i, (entry, _) in enumerate(live):
            entry.binding.count(entry.name)
            if before is not None:
                entry.binding.measure(before[i], grads[i])


def explain_torch_error(exc: BaseException, hooks: HookHandle) -> Exception | None:
    """Turn torch's error for in-place ops around full backward hooks into one that names the spec."""
    text = str(exc)
    if "BackwardHookFunction" in text and "inplace" in text:
        names = [b.spec.name for b in hooks.bindings
                 if b.spec.kind in ("backward", "backward_pre") and b.spec.enabled]
        return HookCompatibilityError(
            f"an in-place op modified the input or output of a module with a full backward hook (spec(s) "
            f"{', '.join(names) or '?'}), which torch forbids. Use kind 'output_grad' or 'node' for these "
            "targets, or make the in-place op out of place (e.g. nn.ReLU(inplace=False)).",
            spec=names[0] if len(names) == 1 else None,
        )
    return None


def attach(model: nn.Module, specs: SpecsLike, optimizer: torch.optim.Optimizer | None = None, *,
           measure: bool = True) -> HookHandle:
    """Attach hook specs to ``model``; returns the :class:`HookHandle` that owns them.

    ``specs``: a mapping ``{name: spec}``, a list of specs, or one :class:`HookSpec`. ``optimizer`` is
    needed by ``pre_step`` specs and makes the step counter advance after every ``optimizer.step()``.
    ``measure``: whether hook effects are measured (the trainer turns it on for log steps only).
    Every spec is parsed, resolved and checked before anything is attached.
    """
    if type(model).__name__ == "OptimizedModule":
        raise HookCompatibilityError(
            "the model is already compiled with torch.compile, and hooks added after compiling are "
            "silently ignored by torch. Attach the hooks to the eager model first, then compile it."
        )
    parsed = parse_specs(specs)
    handle = HookHandle(model, optimizer, measure)
    for spec in parsed:
        kind = KINDS[spec.kind]
        transform = bind_transform(spec.transform, spec.args, spec.name)
        targets = resolve(model, spec, kind.on)
        binding = SpecBinding(spec, kind, transform, targets, handle.clock)
        if kind.check is not None and spec.enabled:
            for target in targets:
                kind.check(binding, target, handle)
        handle.bindings.append(binding)
    try:
        for binding in handle.bindings:
            if binding.spec.enabled:
                for target in binding.targets:
                    handle._torch_handles.extend(binding.kind.attach(binding, target, handle))
        if optimizer is not None:
            handle._torch_handles.append(optimizer.register_step_post_hook(handle.advance))
    except BaseException:
        handle.remove()
        raise
    return handle
