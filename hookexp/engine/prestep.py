"""A handle's ``pre_step`` specs, run on the final ``.grad`` s before ``optimizer.step()`` (:class:`PreStep`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from hookexp.engine.binding import Clock, Site, effect_rows
from hookexp.engine.context import HookContext
from hookexp.engine.shards import local_shard
from hookexp.errors import HookRuntimeError


class PreStepEntry:
    """One parameter of one ``pre_step`` spec; ``remove()`` takes it out of the runner."""

    def __init__(self, runner: PreStep, site: Site):
        self._runner = weakref.ref(runner)
        self.site = site

    def remove(self) -> None:
        runner = self._runner()
        if runner is not None:
            runner.drop(self.site)


class PreStep:
    """The ``pre_step`` sites in declaration order. Consecutive specs with the same batched transform and
    arguments run as one ``torch._foreach_*`` call, the others per tensor; by default from the optimizer's step
    pre-hook, or (:meth:`run_by_hand`) when the owner calls :meth:`apply`."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.sites: list[Site] = []
        self._groups: list[tuple[tuple[Any, ...] | None, list[Site]]] | None = None
        self._hook: Any = None
        self._by_hand = False

    def add(self, site: Site, optimizer: torch.optim.Optimizer | None) -> PreStepEntry:
        self.sites.append(site)
        self._groups = None
        if self._hook is None and not self._by_hand:
            assert optimizer is not None  # the kind's check refused this before
            self._hook = optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.apply())
        return PreStepEntry(self, site)

    def run_by_hand(self) -> None:
        """Stop running from the optimizer's step pre-hook: the owner calls :meth:`apply` once the gradients are
        final (``optimizer.step(closure)`` runs the backward inside the closure, after torch's pre-hooks)."""
        self._by_hand = True
        self._unhook()

    def drop(self, site: Site) -> None:
        if site in self.sites:
            self.sites.remove(site)
            self._groups = None

    def clear(self) -> None:
        self.sites.clear()
        self._groups = None
        self._unhook()

    def _unhook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _build_groups(self) -> list[tuple[tuple[Any, ...] | None, list[Site]]]:
        """Consecutive specs with the same batched transform and arguments form one group, run as one
        ``torch._foreach_*`` call; the others run per tensor. Declaration order is kept for every parameter."""
        groups: list[tuple[tuple[Any, ...] | None, list[Site]]] = []
        for site in self.sites:
            b = site.binding
            key = b.transform.batch_key() if b.select is None else None
            last = groups[-1] if groups else None
            if last is not None and ((key is not None and last[0] == key) or (key is None and last[0] is None
                                                                                and last[1][0].binding is b)):
                last[1].append(site)
            else:
                groups.append((key, [site]))
        return groups

    def apply(self) -> None:
        """Run the ``pre_step`` specs on the current ``.grad`` s now."""
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
            tf.batched(grads, ctx, **tf.batched_args)  # type: ignore[misc]
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
