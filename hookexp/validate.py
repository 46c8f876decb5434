"""Check hook specs on one real batch before training: ``validate()`` and ``+dry_run=true``.

Static checks (names, kinds, arguments, frozen parameters, in-place modules next to full backward
hooks) already run in ``attach``. What only a real forward/backward can show is checked here, with
every schedule bypassed so that windowed specs are checked too: torch's in-place error around full
backward hooks (named by spec), transforms that change shape/dtype/device or write in place, specs
that never fire (and why), and modules called several times per forward. The model is left as found:
no optimizer step, gradients reset, training mode restored, the hooks removed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookexp.engine import HookHandle, SpecBinding, attach, explain_torch_error
from hookexp.errors import HookexpError
from hookexp.specs import SpecsLike


@dataclass
class ValidationReport:
    """One row per spec (spec, kind, transform, targets, calls per step, warnings) and the errors."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def render(self) -> str:
        """The table as text (rich), then errors; what ``+dry_run=true`` prints."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title="hookexp dry run: hooks on one batch", show_lines=False)
        for col in ("spec", "kind", "transform", "targets", "calls/step", "warnings"):
            table.add_column(col, overflow="fold")
        for r in self.rows:
            targets = ", ".join(r["targets"]) if len(r["targets"]) <= 6 else (
                ", ".join(r["targets"][:5]) + f", ... ({len(r['targets'])} in all)")
            table.add_row(r["spec"], r["kind"], r["transform"], targets or "-",
                          str(r["calls_per_step"]), "; ".join(r["warnings"]) or "-")
        console = Console(width=140, record=True, force_terminal=False)
        with console.capture() as cap:
            console.print(table)
            for e in self.errors:
                console.print(f"error: {e}", soft_wrap=True)
            console.print("OK: every hook fired and kept its tensors' shape, dtype and device." if self.ok
                          else f"{len(self.errors)} error(s): fix them before training.")
        return cap.get()


def _loss(output: Any, batch: Any, loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    target = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
    if loss_fn is not None:
        return loss_fn(output, target) if target is not None else loss_fn(output)
    if target is not None and not target.is_floating_point():
        return F.cross_entropy(output, target)
    if target is not None:
        return F.mse_loss(output, target)
    return output.float().sum()


def _inputs(batch: Any) -> Any:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def validate(model: nn.Module, specs: SpecsLike, example_batch: Any, optimizer: torch.optim.Optimizer | None = None,
             loss_fn: Callable[..., torch.Tensor] | None = None) -> ValidationReport:
    """Run one forward/backward on ``example_batch`` (``x`` or ``(x, y)``) with the specs attached.

    Static mistakes raise (as in ``attach``); what the run finds is in the report's ``errors`` and
    per-spec ``warnings``. The loss is ``loss_fn(output, y)``, else cross-entropy for integer labels,
    MSE for float targets, or ``output.sum()``. ``pre_step`` specs run on the gradients (given an
    optimizer) without an optimizer step.
    """
    report = ValidationReport()
    was_training = model.training
    handle = attach(model, specs, optimizer, measure=False)
    handle.clock.ignore_schedule = True
    try:
        train_pass = _train_pass(model, handle, example_batch, optimizer, loss_fn, report)
        eval_calls = _eval_pass(model, handle, example_batch, report)
    finally:
        handle.remove()
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    for b in handle.bindings:
        report.rows.append(_row(b, train_pass[b.spec.name], eval_calls.get(b.spec.name, 0), bool(report.errors)))
    return report


def _train_pass(model: nn.Module, handle: HookHandle, batch: Any, optimizer: torch.optim.Optimizer | None,
                loss_fn: Callable[..., torch.Tensor] | None, report: ValidationReport) -> dict[str, Counter[str]]:
    """One forward/backward in train mode; returns each spec's calls per target."""
    model.train()
    try:
        loss = _loss(model(_inputs(batch)), batch, loss_fn)
        loss.backward()
        if optimizer is not None and handle._pre_step:
            handle._run_pre_step(optimizer, (), {})
    except HookexpError as e:
        report.errors.append(str(e))
    except RuntimeError as e:
        explained = explain_torch_error(e, handle)
        if explained is None:
            raise
        report.errors.append(str(explained))
    return {b.spec.name: Counter(b.calls_by_target) for b in handle.bindings}


def _eval_pass(model: nn.Module, handle: HookHandle, batch: Any, report: ValidationReport) -> dict[str, int]:
    """A no-grad forward in eval mode, for specs with phase eval or both; returns their calls."""
    if all(b.spec.phase == "train" for b in handle.bindings):
        return {}
    before = {b.spec.name: b.calls for b in handle.bindings}
    model.eval()
    try:
        with torch.no_grad():
            model(_inputs(batch))
    except HookexpError as e:
        report.errors.append(str(e))
    return {b.spec.name: b.calls - before[b.spec.name] for b in handle.bindings}


def _row(b: SpecBinding, train_calls: Counter[str], eval_calls: int, stopped: bool) -> dict[str, Any]:
    spec = b.spec
    warnings: list[str] = []
    calls = eval_calls if spec.phase == "eval" else sum(train_calls.values())
    if not spec.enabled:
        warnings.append("disabled (enabled: false): resolved, not attached")
    elif calls == 0 and stopped:
        warnings.append("not reached: the batch stopped at an error below")
    elif calls == 0:
        why = "; ".join(sorted({e for events in b.notes.values() for e in events}))
        warnings.append(f"never fired on this batch{': ' + why if why else ''}")
    if b.kind.on == "module":
        several = ", ".join(f"{t} x{n}" for t, n in train_calls.items() if n > 1)
        if several:
            warnings.append(f"fires several times per step ({several})")
    aliases = [f"{t.name} = {', '.join(t.aliases)}" for t in b.targets if t.aliases]
    if aliases:
        warnings.append("shared/tied, hooked once: " + "; ".join(aliases))
    if spec.start_step or spec.end_step is not None or spec.every != 1:
        end = spec.end_step if spec.end_step is not None else "end"
        warnings.append(f"acts on steps [{spec.start_step}, {end}) every {spec.every}; checked here regardless")
    return {"spec": spec.name, "kind": spec.kind, "transform": b.transform.name,
            "targets": [t.name for t in b.targets], "calls_per_step": calls, "warnings": warnings}
