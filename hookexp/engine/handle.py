"""Specs in, torch hooks attached, one handle that owns and removes them.

``attach(model, specs, optimizer=None)`` parses every spec, resolves every target and runs every
compatibility check *before* attaching anything, and reports all the static errors together, so a bad
config attaches nothing and needs one run to see every mistake. It returns a :class:`HookHandle`, a
context manager in the style of TransformerLens' hook points: leaving the ``with`` block (also by an
exception) removes exactly the hooks this handle attached.

Memory: torch hooks close over a :class:`~hookexp.engine.binding.Site` (the spec's binding and the target
it hooks), never over tensors of a forward; the handle keeps the root model through a weak reference;
records hold detached copies. So a handle cannot keep a model or an autograd graph alive.

Cost: measuring what a hook did (norm of the change, cosine, fraction changed) costs a few tensor ops
per hooked tensor, so it follows a schedule and a hook otherwise costs what a hand-written hook costs.
By default (``measure="read"``) the effects of step 0 are measured, and of the step after each
``stats()`` read: a loop that reads the stats every k steps measures one step in k, and one that never
reads them pays for one step. ``measure=N`` measures every N-th step (0, N, 2N, ...), ``measure=True``
every step, ``measure=False`` only while the owner sets ``handle.measuring`` (the trainer: on its log
steps). The step advances with ``optimizer.step()`` when ``attach`` has the optimizer, or with
:meth:`HookHandle.set_step`. This module imports neither Hydra nor W&B.

Instruments that only read (telemetry's activation statistics) use no spec: see
:func:`hookexp.engine.observe.output_hooks`.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from hookexp.engine.binding import Clock, Site, SpecBinding, effect_rows
from hookexp.engine.kinds import KINDS, refuse_compiled
from hookexp.engine.schema import HookSpec, SpecsLike, spec_name
from hookexp.engine.specs import collect_specs, raise_all
from hookexp.engine.targets import resolve
from hookexp.engine.transforms import HookContext, Record, bind_transform, local_shard
from hookexp.errors import (
    ConfigError,
    HookCompatibilityError,
    HookexpError,
    HookRuntimeError,
    TransformOutputError,
)

Measure = Literal["read"] | bool | int
_FULL_BACKWARD = ("backward", "backward_pre")


class _PreStepEntry:
    """One parameter of one ``pre_step`` spec; ``remove()`` takes it out of the handle's runner."""

    def __init__(self, handle: HookHandle, site: Site):
        self._handle = weakref.ref(handle)
        self.site = site

    def remove(self) -> None:
        handle = self._handle()
        if handle is not None:
            handle.drop_pre_step(self.site)


class HookHandle:
    """The hooks one ``attach`` call added. Use as a context manager, or call :meth:`remove`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, measure: Measure = True):
        if not (measure == "read" or isinstance(measure, bool) or (isinstance(measure, int) and measure >= 1)):
            raise ConfigError(f"expected 'read', True, False or a positive number of steps, got {measure!r}.",
                              key="attach(measure=...)")
        self._model = weakref.ref(model)
        self.optimizer = optimizer
        self.measure = measure
        # the schedule: measure every N-th step (True: every step), else on reads ("read") or by hand (False)
        self._every = int(measure) if measure is not False and measure != "read" else None
        self.clock = Clock(measuring=measure is not False)
        self.bindings: list[SpecBinding] = []
        self._torch_handles: list[Any] = []
        self._pre_step: list[Site] = []
        self._groups: list[tuple[tuple[Any, ...] | None, list[Site]]] | None = None
        self._pre_step_hook: Any = None
        self._pre_step_by_hand = False  # apply_pre_step() is called by the loop (run_pre_step_by_hand)
        # full-backward-hooked modules run in the current forward, in order (bounded: a submodule called on its
        # own never passes the root's pre-hook that clears it)
        self._ran: deque[Site] = deque(maxlen=64)
        self._outer_exc: BaseException | None = None
        self.removed = False

    # -- what the kinds use ---------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this hook handle no longer exists")
        return model

    def add_pre_step(self, site: Site) -> _PreStepEntry:
        self._pre_step.append(site)
        self._groups = None
        if self._pre_step_hook is None and not self._pre_step_by_hand:
            assert self.optimizer is not None  # the kind's check refused this before
            self._pre_step_hook = self.optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.apply_pre_step())
        return _PreStepEntry(self, site)

    def run_pre_step_by_hand(self) -> None:
        """Stop running the ``pre_step`` specs from the optimizer's step pre-hook: the caller calls
        :meth:`apply_pre_step` itself, once the gradients are final. For loops whose ``optimizer.step(closure)``
        runs the forward and backward inside the closure (Lightning's automatic optimization, LBFGS): torch runs
        step pre-hooks before the closure, on the previous step's gradients."""
        self._pre_step_by_hand = True
        if self._pre_step_hook is not None:
            self._pre_step_hook.remove()
            self._pre_step_hook = None

    def drop_pre_step(self, site: Site) -> None:
        if site in self._pre_step:
            self._pre_step.remove(site)
            self._groups = None

    def ran(self, site: Site) -> None:
        """A module with a full backward hook finished its forward (to name it if torch raises later)."""
        self._ran.append(site)

    # -- the step and the measuring schedule ------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.clock.step

    def set_step(self, step: int) -> None:
        """Set the training step the schedules (``every``, ``start_step``, ``end_step``, measuring) look at.

        With an optimizer given to ``attach`` the step advances by itself after every optimizer.step().
        """
        if step == self.clock.step:
            return
        for b in self.bindings:
            b.end_step()
        self.clock.step = step
        self._schedule()
        self._refresh()

    def advance(self, *_: Any) -> None:
        """Move to the next training step (the optimizer's post-step hook calls it)."""
        self.set_step(self.clock.step + 1)

    def _schedule(self) -> None:
        """Measuring for a new step: N (True: 1) every N-th step; "read" off until the next stats() read;
        False: left as the owner set it."""
        if self._every is not None:
            self.clock.measuring = self.clock.step % self._every == 0
        elif self.measure == "read":
            self.clock.measuring = False

    @property
    def measuring(self) -> bool:
        """Whether hook effects are measured now. Setting it overrides the schedule until the step changes."""
        return self.clock.measuring

    @measuring.setter
    def measuring(self, on: bool) -> None:
        self.clock.measuring = on

    @contextlib.contextmanager
    def unscheduled(self) -> Iterator[None]:
        """Act on every call whatever the step windows say, and warn about nothing (the dry run)."""
        before = self.clock.ignore_schedule
        self.clock.ignore_schedule = True
        self._refresh()
        try:
            yield
        finally:
            self.clock.ignore_schedule = before
            self._refresh()

    def pause(self, names: list[str] | tuple[str, ...], paused: bool = True) -> None:
        """Keep the specs ``names`` attached but idle (``paused=False``: acting again), e.g. ``record`` specs
        that the spike recorder turns on for a few steps."""
        known = {b.spec.name: b for b in self.bindings}
        missing = [n for n in names if n not in known]
        if missing:
            raise ConfigError(f"no hook spec named {missing[0]!r}; the specs are: {', '.join(known) or 'none'}.",
                              key="HookHandle.pause(names)")
        for n in names:
            known[n].paused = paused
            known[n].refresh()

    def _refresh(self) -> None:
        for b in self.bindings:
            b.refresh()

    # -- pre_step -------------------------------------------------------------------------------------
    @property
    def has_pre_step(self) -> bool:
        return bool(self._pre_step)

    def _build_groups(self) -> list[tuple[tuple[Any, ...] | None, list[Site]]]:
        """Consecutive specs with the same batched transform and arguments form one group, run as one
        ``torch._foreach_*`` call; the others run per tensor. Declaration order is kept for every parameter."""
        groups: list[tuple[tuple[Any, ...] | None, list[Site]]] = []
        for site in self._pre_step:
            b = site.binding
            key = b.transform.batch_key() if b.select is None else None
            last = groups[-1] if groups else None
            if last is not None and ((key is not None and last[0] == key) or (key is None and last[0] is None
                                                                                and last[1][0].binding is b)):
                last[1].append(site)
            else:
                groups.append((key, [site]))
        return groups

    def apply_pre_step(self) -> None:
        """Run the ``pre_step`` specs on the current ``.grad``s now: what the optimizer's pre-step hook does
        (the dry run calls it without an optimizer step)."""
        groups = self._groups
        if groups is None:
            groups = self._groups = self._build_groups()
        with torch.no_grad():
            for key, sites in groups:
                live = [(s, g) for s in sites if s.binding.active and (g := s.obj.grad) is not None]
                if not live:
                    continue
                if key is not None:
                    self._run_batched(live)
                    continue
                for s, g in live:
                    s.binding.call(s, s.binding.apply_in_place, g, s)

    def _run_batched(self, live: list[tuple[Site, torch.Tensor]]) -> None:
        first = live[0][0].binding
        tf = first.transform
        local = [local_shard(g) for _, g in live]  # under FSDP: this rank's shards (views of the DTensors)
        grads = [g for g, _ in local]
        shards = local[0][1]
        before = [g.clone() for g in grads] if self.clock.measuring else None
        ctx = None
        if tf.needs_ctx or shards is not None:
            ctx = HookContext(first.spec.name, "pre_step", "*", self.clock.step, state=tf.state,
                              measuring=self.clock.measuring, targets=[s.name for s, _ in live], shards=shards)
        try:
            tf.batched(grads, ctx, **tf.args)  # type: ignore[misc]
        except Exception as error:
            names = sorted({s.binding.spec.name for s, _ in live})
            raise HookRuntimeError(
                f"batched transform {tf.name!r} failed at step {self.clock.step} on {len(grads)} parameters of "
                f"spec(s) {', '.join(names)}: {type(error).__name__}: {error}",
                spec=first.spec.name, field="transform") from error
        for s, _ in live:
            s.binding.calls += 1
            s.calls += 1
        if before is not None:
            with torch.no_grad():
                rows = effect_rows(before, grads, shards)  # under FSDP: of the whole tensors
            sizes = [g.numel() if part is None else part.numel for g, part in local]
            start = 0
            for i, (s, _) in enumerate(live):  # the group's rows summed per spec
                if i + 1 == len(live) or live[i + 1][0].binding is not s.binding:
                    numel = sum(sizes[start:i + 1])
                    s.binding.add_effects(rows[start:i + 1].sum(dim=0), i + 1 - start, numel)
                    start = i + 1

    # -- what the user reads ----------------------------------------------------------------------------
    @property
    def specs(self) -> list[HookSpec]:
        return [b.spec for b in self.bindings]

    @property
    def records(self) -> dict[str, list[Record]]:
        """What ``record`` transforms kept, by spec name."""
        return {b.spec.name: b.records for b in self.bindings if b.transform.name == "record"}

    def stats(self, reset: bool = True) -> dict[str, dict[str, float]]:
        """What each spec did: calls (total, last step) and, on measured steps, the effect of its transform.

        ``change_norm`` is the mean L2 norm of (output - input) per tensor, ``cosine`` the mean cosine
        between them (1 for a tensor returned unchanged), ``frac_changed`` the fraction of elements the
        transform changed, all over the tensors measured since the last ``stats(reset=True)``. One host
        sync for all specs.
        """
        values, decode = self.pending_stats(reset)
        return decode(values.tolist() if values is not None else [])

    def pending_stats(self, reset: bool = True) -> tuple[torch.Tensor | None,
                                                         Callable[[list[float]], dict[str, dict[str, float]]]]:
        """:meth:`stats` in two halves, so that a caller can read the device values together with its
        own: the values (on the device; None when nothing was measured) and what turns them, read
        back as a list, into the dict :meth:`stats` returns."""
        if self.measure == "read":
            self.measuring = True  # the rest of this step and the next (the usual read: after optimizer.step())
        taken = [b.effects(reset) for b in self.bindings]
        emitted = [(b, name, torch.stack([v.to(values[0].device) for v in values]).mean())
                   for b in self.bindings for name, values in b.emitted.items() if values]
        if reset:
            for b in self.bindings:
                b.emitted.clear()
        device_values = [s for s, _, _, _ in taken if s is not None] + [m.reshape(1) for _, _, m in emitted]
        calls = [(float(b.calls), float(b.calls_last_step)) for b in self.bindings]

        def decode(values: list[float]) -> dict[str, dict[str, float]]:
            host = iter(values)
            out: dict[str, dict[str, float]] = {}
            for b, (s, same, n, numel), (total, last) in zip(self.bindings, taken, calls, strict=True):
                row: dict[str, float] = {"calls": total, "calls_last_step": last, "targets": float(len(b.targets))}
                if n:
                    change, cos, changed = (next(host), next(host), next(host)) if s is not None else (0.0, 0.0, 0.0)
                    row.update(change_norm=change / n, cosine=(cos + same) / n, frac_changed=changed / max(numel, 1))
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
                "alias": b.alias.describe() if b.alias else None,
                "input": s.input, "index": s.index, "select": dict(s.select) if s.select else None,
                "every": s.every, "start_step": s.start_step, "end_step": s.end_step, "phase": s.phase,
            })
        return rows

    # -- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The step, each spec's counters and its transform's state (generators, running averages): what a
        checkpoint keeps so that a resumed run's hooks act exactly as an uninterrupted run's would.
        Tensors, numbers, strings and dicts only: loadable with ``torch.load(weights_only=True)``."""
        specs = {}
        for b in self.bindings:
            specs[b.spec.name] = {
                "calls": b.calls, "calls_by_target": dict(b.calls_by_target), "calls_last_step": b.calls_last_step,
                "state": _save_state(b.transform.state, b.spec.name),
            }
        return {"step": self.clock.step, "specs": specs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock.step = int(state["step"])
        if self.measure == "read":
            self.clock.measuring = True  # a resumed loop's first step is measured, as attach's is
        else:
            self._schedule()
        for b in self.bindings:
            saved = state["specs"].get(b.spec.name)
            if saved is None:
                continue
            b.set_counts(int(saved["calls"]), saved["calls_by_target"], int(saved["calls_last_step"]))
            b.transform.state.clear()
            if "state" in saved:
                b.transform.state.update(_load_state(saved["state"]))
            else:  # checkpoints written before transforms' state was saved whole
                if saved.get("seed") is not None:
                    b.transform.state["seed"] = saved["seed"]
                for key, gen_state in saved.get("generators", {}).items():
                    b.transform.state[key] = _generator(key.split(":", 1)[1], gen_state)
        self._refresh()

    # -- errors -----------------------------------------------------------------------------------------
    def explain(self, exc: BaseException) -> HookexpError | None:
        """A torch error raised around this handle's hooks, as an error naming the spec (None when it is not
        about them). Today: in-place ops on the output of a module with a full backward hook."""
        if isinstance(exc, HookexpError):
            return None
        known = getattr(exc, "hookexp_error", None)
        if isinstance(known, HookexpError):
            return known
        text = str(exc)
        if "does not require grad and does not have a grad_fn" in text:
            return self._explain_cut()
        if "BackwardHookFunction" not in text or "inplace" not in text:
            return None
        hooked = [s for b in self.bindings if b.spec.enabled and b.spec.kind in _FULL_BACKWARD for s in b.sites]
        ran = [s for s in dict.fromkeys(reversed(self._ran))]
        culprit = ran[0] if ran else (hooked[0] if len(hooked) == 1 else None)
        if culprit is None:
            names = ", ".join(sorted({s.binding.spec.name for s in hooked})) or "?"
            return HookCompatibilityError(
                f"an in-place op modified the input or output of a module with a full backward hook (spec(s) "
                f"{names}), which torch forbids. Use kind 'output_grad' or 'node' for these targets, or make the "
                "in-place op out of place (nn.ReLU(inplace=False); out = out + identity instead of out += identity).")
        others = [f"{s.name!r} ({s.binding.spec.name})" for s in ran[1:]]
        also = f"; modules with full backward hooks that ran before it: {', '.join(others)}" if others else ""
        b = culprit.binding
        what = "an input" if "its base" in text else "the output"  # torch's words for a base modified in place
        return HookCompatibilityError(
            f"an in-place op modified {what} of {culprit.name!r} (kind {b.spec.kind!r}) after its forward"
            f"{' (the last full-backward-hooked module to run before the error' + also + ')' if ran else ''}, "
            "which torch forbids around full backward hooks. Use kind 'output_grad' (or 'node') for this target, "
            "or make the in-place op out of place (nn.ReLU(inplace=False); out = out + identity instead of "
            "out += identity).", spec=b.spec.name, field="kind")

    def _explain_cut(self) -> HookexpError | None:
        """backward() found a loss without a graph: name the specs whose transforms cut their output from it."""
        cut = [(b.spec.name, site, step) for b in self.bindings for site, step in b.cut_sites.items()]
        if not cut:
            return None
        where = ", ".join(f"{site!r} ({name}{'' if step is None else f', at step {step}'})"
                          for name, site, step in cut)
        return TransformOutputError(
            f"the loss does not require grad: the transform cut the output from the autograd graph at {where} "
            "(its input required grad, its output does not: .detach(), .data, torch.no_grad() or a constant), and "
            "nothing after it has parameters to train. Return a result computed from the input, or move the hook "
            "to evaluation (phase: eval).", spec=cut[0][0] if len({n for n, _, _ in cut}) == 1 else None,
            field="transform")

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        self._ran.clear()
        self._outer_exc = sys.exc_info()[1]  # an exception the caller is handling is not this forward's

    def _forward_failed(self, module: nn.Module, args: Any, result: Any) -> None:
        """Runs (``always_call``) when the model's forward raised: a torch error about this handle's hooks
        gets a message naming the spec, the target and the kind to use (torch's own text follows)."""
        exc = sys.exc_info()[1]
        if exc is None or exc is self._outer_exc or getattr(exc, "hookexp_error", None) is not None:
            return
        explained = self.explain(exc)
        if explained is not None:
            exc.hookexp_error = explained  # type: ignore[attr-defined]
            exc.args = (f"{explained}\n(torch: {exc})",)

    # -- lifetime ---------------------------------------------------------------------------------------
    def install(self) -> None:
        """Register the torch hooks of every enabled spec (the kinds' ``attach``), the step counter on the
        optimizer and, around full backward hooks, the forward hooks that name a spec in torch's errors. On
        an error, what was registered is removed again and the error raised."""
        try:
            for binding in self.bindings:
                if binding.spec.enabled:
                    for site in binding.sites:
                        self._torch_handles.extend(binding.kind.attach(site, self))
            if self.optimizer is not None:
                self._torch_handles.append(self.optimizer.register_step_post_hook(self.advance))
            if any(b.spec.enabled and b.spec.kind in _FULL_BACKWARD for b in self.bindings):
                self._torch_handles.append(self.model.register_forward_pre_hook(self._forward_starts))
                self._torch_handles.append(self.model.register_forward_hook(self._forward_failed, always_call=True))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Remove every hook this handle attached (and only those). Safe to call more than once."""
        for b in self.bindings:
            b.alive = False  # tensor and Node hooks of a graph still in flight become no-ops
            b.refresh()
        for h in self._torch_handles:
            h.remove()
        self._torch_handles.clear()
        self._pre_step.clear()
        self._groups = None
        if self._pre_step_hook is not None:
            self._pre_step_hook.remove()
            self._pre_step_hook = None
        self.removed = True

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """Remove the hooks; a torch error the block raised about them (an in-place op next to a full backward
        hook, a transform that cut the graph) leaves the block as the :class:`HookexpError` that explains it, torch's
        error as its cause, so that ``except HookexpError`` catches it as in the trainer."""
        explained = self.explain(exc) if isinstance(exc, Exception) else None
        self.remove()
        if explained is not None:
            raise explained from exc

    def __repr__(self) -> str:
        state = "removed" if self.removed else f"{len(self._torch_handles) + len(self._pre_step)} hooks"
        return f"HookHandle({', '.join(b.spec.name for b in self.bindings)}; {state})"


def _generator(device: str, state: torch.Tensor) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.set_state(state)
    return gen


def _save_state(value: Any, spec: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, torch.Generator):
        return {"__generator__": str(value.device), "state": value.get_state()}
    if isinstance(value, dict):
        return {str(k): _save_state(v, spec) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_save_state(v, spec) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise HookRuntimeError(f"the transform's state holds a {type(value).__name__}, which a checkpoint cannot keep "
                           "(keep tensors, numbers, strings, generators and dicts of them in ctx.state).",
                           spec=spec, field="transform")


def _load_state(value: Any) -> Any:
    if isinstance(value, dict):
        if "__generator__" in value:
            return _generator(value["__generator__"], value["state"])
        return {k: _load_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_load_state(v) for v in value]
    return value


def _names(specs: SpecsLike) -> list[str]:
    if isinstance(specs, dict):
        return [str(k) for k in specs]
    if isinstance(specs, (list, tuple)):
        return [spec_name(s) for s in specs if isinstance(s, (HookSpec, dict))]
    return []


def attach(model: nn.Module, specs: SpecsLike, optimizer: torch.optim.Optimizer | None = None, *,
           measure: Measure = "read") -> HookHandle:
    """Attach hook specs to ``model``; returns the :class:`HookHandle` that owns them.

    ``specs``: a mapping ``{name: spec}``, a list of specs, or one :class:`HookSpec`; a spec's transform
    may be a registry name, ``{_target_: ...}``, or (here) any callable or :class:`Transform`.
    ``optimizer`` is needed by ``pre_step`` specs and makes the step counter advance after every
    ``optimizer.step()``. ``measure``: when hook effects are measured: ``"read"`` (default) step 0 and the
    step after each ``stats()`` read, N every N-th step, True every step, False only while
    ``handle.measuring`` is set. A spec can be switched off and on again with :meth:`HookHandle.pause`.
    Every spec is parsed, resolved and checked before anything is attached; all static errors are raised
    together.
    """
    refuse_compiled(model)
    parsed, errors = collect_specs(specs)
    handle = HookHandle(model, optimizer, measure)
    for spec in parsed:
        kind = KINDS[spec.kind]
        try:
            transform = bind_transform(spec.transform, spec.args, spec.name)
            resolution = resolve(model, spec, kind.on)
        except HookexpError as e:
            errors.append(e)
            continue
        binding = SpecBinding(spec, kind, transform, resolution.targets, handle.clock, resolution.alias)
        if kind.check is not None and spec.enabled:
            for site in binding.sites:
                try:
                    kind.check(site, handle)
                except HookexpError as e:
                    errors.append(e)
                    break  # one error per spec: a frozen glob would otherwise list every parameter
        handle.bindings.append(binding)
    order = {name: i for i, name in enumerate(_names(specs))}
    raise_all(sorted(errors, key=lambda e: order.get(e.spec or "", -1)))  # in the order the specs were written
    handle.install()
    return handle
