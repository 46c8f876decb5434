"""Torch errors raised around a handle's hooks, as errors naming the spec (:class:`TorchErrors`): in-place ops
next to full backward hooks, and a loss whose graph a transform cut."""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

from torch import nn

from hookexp.engine.binding import Site, SpecBinding
from hookexp.errors import HookCompatibilityError, HookexpError, TransformOutputError

FULL_BACKWARD = ("backward", "backward_pre")


class TorchErrors:
    """Explains torch's errors about the hooks of ``bindings`` (a handle's list, read when an error comes)."""

    def __init__(self, bindings: list[SpecBinding]):
        self.bindings = bindings
        # full-backward-hooked modules run in the current forward, in order (bounded: a submodule called on its
        # own never passes the root's pre-hook that clears it)
        self._ran: deque[Site] = deque(maxlen=64)
        self._outer_exc: BaseException | None = None

    def ran(self, site: Site) -> None:
        """A module with a full backward hook finished its forward (to name it if torch raises later)."""
        self._ran.append(site)

    def hooks_full_backward(self) -> bool:
        return any(b.spec.enabled and b.spec.kind in FULL_BACKWARD for b in self.bindings)

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
        hooked = [s for b in self.bindings if b.spec.enabled and b.spec.kind in FULL_BACKWARD for s in b.sites]
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


    def forward_starts(self, module: nn.Module, args: Any) -> None:
        self._ran.clear()
        self._outer_exc = sys.exc_info()[1]  # an exception the caller is handling is not this forward's


    def forward_failed(self, module: nn.Module, args: Any, result: Any) -> None:
        """Runs (``always_call``) when the model's forward raised: a torch error about this handle's hooks
        gets a message naming the spec, the target and the kind to use (torch's own text follows)."""
        exc = sys.exc_info()[1]
        if exc is None or exc is self._outer_exc or getattr(exc, "hookexp_error", None) is not None:
            return
        explained = self.explain(exc)
        if explained is not None:
            exc.hookexp_error = explained  # type: ignore[attr-defined]
            exc.args = (f"{explained}\n(torch: {exc})",)

