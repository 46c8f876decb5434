"""Specs in, torch hooks attached, one handle that owns and removes them: :func:`attach`, :class:`HookHandle`.

``attach`` parses, resolves and checks every spec before attaching anything and raises all the static errors
together. The handle is a context manager: leaving the ``with`` block removes exactly its hooks. Torch hooks close
over a :class:`~hookexp.engine.binding.Site`, never over a forward's tensors, and the handle holds the model by a
weak reference. Measuring what a hook did follows a schedule (``measure``); docs/library.md has the details.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from hookexp.engine.binding import Clock, Site, SpecBinding
from hookexp.engine.bound import bind_transform
from hookexp.engine.context import Record
from hookexp.engine.explain import TorchErrors
from hookexp.engine.hookstate import generator, load_state, save_state
from hookexp.engine.kinds import KINDS, refuse_compiled
from hookexp.engine.prestep import PreStep, PreStepEntry
from hookexp.engine.schema import HookSpec, SpecsLike, spec_name
from hookexp.engine.specs import collect_specs, raise_all
from hookexp.engine.targets import resolve
from hookexp.engine.traced import Token
from hookexp.errors import ConfigError, HookexpError

Measure = Literal["read"] | bool | int


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
        self.pre_step = PreStep(self.clock)
        self.errors = TorchErrors(self.bindings)
        self.removed = False

    # -- what the kinds use ---------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this hook handle no longer exists")
        return model

    def add_pre_step(self, site: Site) -> PreStepEntry:
        return self.pre_step.add(site, self.optimizer)

    def run_pre_step_by_hand(self) -> None:
        """Stop running the ``pre_step`` specs from the optimizer's step pre-hook: the caller calls
        :meth:`apply_pre_step` itself, once the gradients are final. For loops whose ``optimizer.step(closure)``
        runs the forward and backward inside the closure (Lightning's automatic optimization, LBFGS): torch runs
        step pre-hooks before the closure, on the previous step's gradients."""
        self.pre_step.run_by_hand()

    def ran(self, site: Site) -> None:
        """A module with a full backward hook finished its forward (to name it if torch raises later)."""
        self.errors.ran(site)

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
        return bool(self.pre_step.sites)

    def apply_pre_step(self) -> None:
        """Run the ``pre_step`` specs on the current ``.grad``s now: what the optimizer's pre-step hook does
        (the dry run calls it without an optimizer step)."""
        self.pre_step.apply()

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
        calls = [(int(b.calls), int(b.calls_last_step)) for b in self.bindings]

        def decode(values: list[float]) -> dict[str, dict[str, float]]:
            host = iter(values)
            out: dict[str, dict[str, float]] = {}
            for b, (s, same, n, numel), (total, last) in zip(self.bindings, taken, calls, strict=True):
                row: dict[str, float] = {"calls": total, "calls_last_step": last, "targets": len(b.targets)}  # counts
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
                "state": save_state(b.transform.state, b.spec.name),
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
                b.transform.state.update(load_state(saved["state"]))
            else:  # checkpoints written before transforms' state was saved whole
                if saved.get("seed") is not None:
                    b.transform.state["seed"] = saved["seed"]
                for key, gen_state in saved.get("generators", {}).items():
                    b.transform.state[key] = generator(key.split(":", 1)[1], gen_state)
        self._refresh()

    # -- errors -----------------------------------------------------------------------------------------
    def explain(self, exc: BaseException) -> HookexpError | None:
        """A torch error raised around this handle's hooks, as an error naming the spec (None when it is not
        about them): in-place ops next to full backward hooks, a transform that cut the loss's graph."""
        return self.errors.explain(exc)

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
            if self.errors.hooks_full_backward():
                self._torch_handles.append(self.model.register_forward_pre_hook(self.errors.forward_starts))
                self._torch_handles.append(self.model.register_forward_hook(self.errors.forward_failed,
                                                                            always_call=True))
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
        self.pre_step.clear()
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
        hooks = sum(not isinstance(h, Token) for h in self._torch_handles) + len(self.pre_step.sites)
        state = "removed" if self.removed else f"{hooks} hooks"
        return f"HookHandle({', '.join(b.spec.name for b in self.bindings)}; {state})"



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
