"""Check hook specs on one real batch before training: ``check_on_batch()`` and ``+dry_run=true``.

Static checks (names, kinds, arguments, aliases, frozen parameters, in-place modules next to full
backward hooks) already run in ``attach``. What only a real forward/backward can show is checked here,
with every schedule bypassed so that windowed specs are checked too: torch's in-place error around full
backward hooks (named by spec and target), transforms that change shape/dtype/device or write in place,
specs whose transform saw no tensor at a target, specs that never fire (and why), and modules called
several times per forward. The model is left as found: no optimizer step, gradients reset, training
mode restored, the hooks removed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookexp.engine import values
from hookexp.engine.binding import SpecBinding
from hookexp.engine.handle import HookHandle, attach
from hookexp.engine.schema import SpecsLike
from hookexp.errors import HookexpError


@dataclass
class ValidationReport:
    """One row per spec (spec, kind, transform, targets, what an alias became, calls per step, warnings)
    and the errors."""

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
            table.add_row(r["spec"], r["kind"], r["transform"], targets_text(r),
                          str(r["calls_per_step"]), "; ".join(r["warnings"]) or "-")
        console = Console(width=140, record=True, force_terminal=False)
        with console.capture() as cap:
            console.print(table)
            for e in self.errors:
                console.print(f"error: {e}", soft_wrap=True)
            console.print("OK: every hook fired and kept its tensors' shape, dtype and device." if self.ok
                          else f"{len(self.errors)} error(s): fix them before training.")
        return cap.get()


def targets_text(row: Mapping[str, Any]) -> str:
    """A hooks-table row's targets in one short line (what an @alias became first)."""
    names = row["targets"]
    text = ", ".join(names) if len(names) <= 6 else ", ".join(names[:5]) + f", ... ({len(names)} in all)"
    return (f"{row['alias']}: {text}" if row.get("alias") else text) or "-"


def hooks_summary(rows: list[Mapping[str, Any]]) -> str:
    """The hooks table as a few lines for a run's log: spec, kind, transform, targets."""
    return "\n".join(f"  {r['spec']}: {r['kind']} {r['transform']} on {targets_text(r)}"
                     + ("" if r["enabled"] else " (disabled)") for r in rows)


def _output_for_loss(output: Any) -> torch.Tensor:
    """The tensor a default loss is taken of: the output, its loss or logits entry, or its first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        for key in ("loss", "logits"):
            if isinstance(output.get(key), torch.Tensor):
                return output[key]
    for _, v in values.elements(output):
        if isinstance(v, torch.Tensor):
            return v
    raise TypeError(f"the model returned {type(output).__name__} without a tensor; "
                    "pass check_on_batch(..., loss_fn=...)")


def _loss(output: Any, batch: Any, loss_fn: Callable[..., torch.Tensor] | None, task: bool) -> torch.Tensor:
    if task and loss_fn is not None:
        return loss_fn(output, batch)
    target = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
    if loss_fn is not None:
        return loss_fn(output, target) if target is not None else loss_fn(output)
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    out = _output_for_loss(output)
    if target is not None and not target.is_floating_point():
        return F.cross_entropy(out, target)
    if target is not None:
        return F.mse_loss(out, target)
    return out.float().sum()


def _default_forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch[0] if isinstance(batch, (tuple, list)) else batch)


def check_on_batch(model: nn.Module, specs: SpecsLike, example_batch: Any,
                   optimizer: torch.optim.Optimizer | None = None, loss_fn: Callable[..., torch.Tensor] | None = None,
                   *, forward: Callable[[nn.Module, Any], Any] | None = None) -> ValidationReport:
    """Run one forward/backward on ``example_batch`` with the specs attached.

    ``example_batch``: ``x``, ``(x, y)`` or a mapping of keyword inputs (``model(**batch)``). A task's pair,
    ``forward(model, batch) -> output`` and ``loss_fn(output, batch) -> loss``, says how to call the model
    and score it on any batch. Without ``forward``, the loss is ``loss_fn(output, y)`` (or
    ``loss_fn(output)``), else the output's ``loss``, else cross-entropy for integer labels, MSE for float
    targets, or the sum of the output (its ``logits`` or first tensor). Static mistakes raise (as in
    ``attach``); what the run finds is in the report's ``errors`` and per-spec ``warnings``. ``pre_step``
    specs run on the gradients (given an optimizer) without an optimizer step.
    """
    report = ValidationReport()
    was_training = model.training
    call = forward or _default_forward
    handle = attach(model, specs, optimizer, measure=False)
    try:
        with handle.unscheduled():
            train_pass = _train_pass(model, handle, example_batch, call, loss_fn, forward is not None, report)
            eval_calls = _eval_pass(model, handle, example_batch, call, report)
    finally:
        handle.remove()
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    for b in handle.bindings:
        row = _row(b, train_pass[b.spec.name], eval_calls.get(b.spec.name, 0), bool(report.errors))
        report.rows.append(row)
        report.errors.extend(_saw_nothing(b))
    return report


def _train_pass(model: nn.Module, handle: HookHandle, batch: Any, call: Callable[[nn.Module, Any], Any],
                loss_fn: Callable[..., torch.Tensor] | None, task: bool,
                report: ValidationReport) -> dict[str, Counter[str]]:
    """One forward/backward in train mode; returns each spec's calls per target."""
    model.train()
    try:
        loss = _loss(call(model, batch), batch, loss_fn, task)
        loss.backward()
        if handle.has_pre_step:
            handle.apply_pre_step()
    except HookexpError as e:
        report.errors.append(str(e))
    except RuntimeError as e:
        explained = handle.explain(e)
        if explained is None:
            raise
        report.errors.append(str(explained))
    return {b.spec.name: Counter(b.calls_by_target) for b in handle.bindings}


def _eval_pass(model: nn.Module, handle: HookHandle, batch: Any, call: Callable[[nn.Module, Any], Any],
               report: ValidationReport) -> dict[str, int]:
    """A no-grad forward in eval mode, for specs with phase eval or both; returns their calls."""
    if all(b.spec.phase == "train" for b in handle.bindings):
        return {}
    before = {b.spec.name: b.calls for b in handle.bindings}
    model.eval()
    try:
        with torch.no_grad():
            call(model, batch)
    except HookexpError as e:
        report.errors.append(str(e))
    return {b.spec.name: b.calls - before[b.spec.name] for b in handle.bindings}


def _saw_nothing(b: SpecBinding) -> list[str]:
    empty = [s for s in b.sites if s.calls and s.empty == s.calls]
    if not empty:
        return []
    where = ", ".join(f"{s.name!r} ({s.empty_why})" for s in empty[:4]) + (" ..." if len(empty) > 4 else "")
    fix = ("check the forward() parameter name and that the caller passes it" if b.spec.input is not None else
           "check index / the kind (grad_input of a first layer is None)")
    return [f"hooks.{b.spec.name}: the transform saw no tensor at {where}, so the hook would do nothing there; "
            f"{fix}."]


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
            "targets": [t.name for t in b.targets], "alias": b.alias.describe() if b.alias else None,
            "calls_per_step": calls, "warnings": warnings}
