"""Hook kinds: where in forward/backward a spec acts, as thin adapters over torch's hook APIs.

Each kind is registered by decorator with what it attaches to (modules or parameters), the torch API
it uses and what its transform sees. Its ``attach`` function registers torch hooks that call
``binding.apply(value, target, aux=...)`` and return what torch expects; everything else (schedule,
counting, checks, measuring, error messages) lives in :mod:`hookexp.engine`, once for all kinds.
``check`` functions refuse, before anything is attached, a kind that cannot work on a target.

The semantics are torch 2.x's own (see DESIGN.md, "Hook kinds"); the tests compare every kind with
the same hook written by hand.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import nn

from hookexp.errors import HookCompatibilityError

if TYPE_CHECKING:
    from hookexp.targets import Target


class Binding(Protocol):
    """What a kind needs from the engine's per-spec binding."""

    spec: Any

    def live(self, training: bool | None) -> bool: ...

    def apply(self, value: Any, target: str, aux: Any = None, index: int | None = None) -> Any: ...

    def apply_in_place(self, grad: torch.Tensor, target: str) -> None: ...

    def note(self, target: str, event: str) -> None: ...


class AttachSite(Protocol):
    """What a kind needs from the handle it attaches into."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None

    def add_pre_step(self, binding: Binding, target: Target) -> Any: ...


Attach = Callable[[Binding, "Target", AttachSite], list[Any]]
Check = Callable[[Binding, "Target", AttachSite], None]


Stage = Literal["forward", "backward", "step"]


@dataclass(frozen=True)
class KindInfo:
    name: str
    on: Literal["module", "parameter"]
    stage: Stage  # when it fires: in forward, in backward (sees fp16-scaled grads), before optimizer.step
    torch_api: str
    sees: str
    attach: Attach
    check: Check | None = None


KINDS: dict[str, KindInfo] = {}


def register_kind(name: str, on: Literal["module", "parameter"], stage: Stage, torch_api: str, sees: str,
                  check: Check | None = None) -> Callable[[Attach], Attach]:
    def deco(fn: Attach) -> Attach:
        KINDS[name] = KindInfo(name, on, stage, torch_api, sees, fn, check)
        return fn

    return deco


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Forward-side hooks read the step and the schedule: under torch.compile, Dynamo would guard on
    those values and recompile every step. Running the hooks eagerly (a graph break) keeps one graph."""
    return torch.compiler.disable(fn, recursive=True)


def transformed(binding: Binding, name: str, value: Any, aux: Any = None, training: bool | None = None) -> Any:
    """The body every replacing hook shares: ``None`` (torch keeps its value) when the spec does not act
    or the transform returned the value unchanged, else the new value."""
    if not binding.live(training):
        return None
    out = binding.apply(value, name, aux=aux)
    return None if out is value else out


def output_tensors(value: Any) -> Iterator[tuple[int | None, torch.Tensor]]:
    """(position, tensor) for a bare tensor (position None) or the tensors of a tuple/list."""
    if isinstance(value, torch.Tensor):
        yield None, value
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            if isinstance(v, torch.Tensor):
                yield i, v


# ----------------------------------------------------------------------------------------------------
# Checks that refuse a kind before anything is attached.


def _first_leaf(module: nn.Module) -> nn.Module:
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return module


def inplace_hazard(model: nn.Module, name: str, module: nn.Module) -> str | None:
    """Why a full backward hook on ``module`` would break on an in-place op, or None.

    torch wraps the inputs and outputs of a module with a full backward hook in an identity Function;
    an in-place op on those (``inplace=True`` in the module itself, in the first module it runs, or in
    the module run right after it in a Sequential) raises in torch at backward time.
    """
    if getattr(_first_leaf(module), "inplace", False) is True:
        return f"module {name!r} ({type(module).__name__}) runs an op with inplace=True on its input"
    parent_name, _, child = name.rpartition(".")
    if not name:
        return None
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, nn.Sequential):
        keys = list(parent._modules.keys())
        pos = keys.index(child)
        if pos + 1 < len(keys):
            nxt = parent._modules[keys[pos + 1]]
            if nxt is not None and getattr(_first_leaf(nxt), "inplace", False) is True:
                nxt_name = f"{parent_name}.{keys[pos + 1]}" if parent_name else keys[pos + 1]
                return f"the next module {nxt_name!r} ({type(nxt).__name__}, inplace=True) modifies its output in place"
    return None


def _no_inplace(binding: Binding, target: Target, site: AttachSite) -> None:
    why = inplace_hazard(site.model, target.name, target.obj)  # type: ignore[arg-type]
    if why:
        raise HookCompatibilityError(
            f"kind {binding.spec.kind!r} cannot be used on {target.name!r}: {why}, and torch raises on "
            "in-place ops around full backward hooks. Use kind 'output_grad' (grad w.r.t. the module "
            "output, safe with in-place ops) or 'node'/'node_pre', or set inplace=False in the model.",
            spec=binding.spec.name, field="kind",
        )


def _requires_grad(binding: Binding, target: Target, site: AttachSite) -> None:
    p = target.obj
    if not p.requires_grad:
        raise HookCompatibilityError(
            f"parameter {target.name!r} does not require grad (it is frozen), so a {binding.spec.kind!r} hook "
            f"on it would never fire. Narrow the target with exclude: [{target.name!r}], or unfreeze it.",
            spec=binding.spec.name, field="target",
        )


def _grad_check(binding: Binding, target: Target, site: AttachSite) -> None:
    _requires_grad(binding, target, site)
    if type(target.obj).__name__ == "DTensor":
        raise HookCompatibilityError(
            f"parameter {target.name!r} is a DTensor (FSDP2), whose Tensor.register_hook never fires. "
            "Use kind 'post_accumulate' or 'pre_step' instead.",
            spec=binding.spec.name, field="kind",
        )


def _pre_step_check(binding: Binding, target: Target, site: AttachSite) -> None:
    _requires_grad(binding, target, site)
    if site.optimizer is None:
        raise HookCompatibilityError(
            "kind 'pre_step' runs right before optimizer.step(), so it needs the optimizer: call "
            "attach(model, specs, optimizer=opt), or use kind 'post_accumulate'.",
            spec=binding.spec.name, field="kind",
        )
    owned = {id(p) for group in site.optimizer.param_groups for p in group["params"]}
    if id(target.obj) not in owned:
        raise HookCompatibilityError(
            f"parameter {target.name!r} is not in the optimizer's param_groups, so optimizer.step() never "
            "uses its gradient. Exclude it, or add it to the optimizer.",
            spec=binding.spec.name, field="target",
        )


def _legacy_warning(binding: Binding, target: Target, site: AttachSite) -> None:
    warnings.warn(
        f"hooks.{binding.spec.name}: kind 'backward_legacy' uses the deprecated Module.register_backward_hook, "
        "which sees the grad_input of the module's last op only (it may hold parameter grads). Use kind "
        "'backward' (register_full_backward_hook) for gradients w.r.t. the module inputs.",
        FutureWarning, stacklevel=2,
    )


# ----------------------------------------------------------------------------------------------------
# Module kinds.


@register_kind("forward_pre", "module", "forward", "register_forward_pre_hook", "positional inputs (tuple)")
def _forward_pre(binding: Binding, target: Target, site: AttachSite) -> list[Any]:
    name = target.name

    @eager
    def hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
        return transformed(binding, name, args, training=module.training)

    return [target.obj.register_forward_pre_hook(hook)]  # type: ignore[union-attr]


@register_kind("forward", "module", "forward", "register_forward_hook", "the output")
def _forward(binding: Binding, target: Target, site: AttachSite) -> list[Any]:
    name = target.name

    @eager
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return transformed(binding, name, output, aux=args, training=module.training)

    return [target.obj.register_forward_hook(hook)]  # type: ignore[union-attr]


@register_kind("output_grad", "module", "backward", "forward hook, then Tensor.register_hook on each output",
               "grad w.r.t. each output tensor")
def _output_grad(binding: Binding, target: Target, site: AttachSite) -> list[Any]:
    name = target.name
    only = binding.spec.index

    @eager
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not torch.is_grad_enabled() or not binding.live(None):
            return
        hooked = False
        for i, t in output_tensors(output):
            if t.requires_grad and (only is None or i == only or (i is None and only == 0)):
                t.register_hook(functools.partial(_grad_call, binding, name, i))
                hooked = True
        if not hooked:
            binding.note(name, "output does not require grad")

    return [target.obj.register_forward_hook(hook)]  # type: ignore[union-attr]


def _grad_call(binding: Binding, name: str, index: int | None, grad: torch.Tensor) -> torch.Tensor | None:
    if not binding.live(None):
        return None
    return binding.apply(grad, name, index=index)


@register_kind("backward_pre", "module", "backward", "register_full_backward_pre_hook", "grad_output (tuple)",
               check=_no_inplace)
def _backward_pre(binding: Binding, target: Target, site: AttachSite) -> list[Any]:
    name = target.name

    def hook(module: nn.Module, grad_output: tuple[Any, ...]) -> Any:
        return transformed(binding, name, grad_output)

    return [target.obj.register_full_backward_pre_hook(hook)]  # type: ignore[union-attr]


def _backward_hook(binding: Binding, name: str) -> Callable[..., Any]:
    def hook(module: nn.Module, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> Any:
        return transformed(binding, name, grad_input, aux=grad_output)

    return hook


@register_kind("backward", "module", "backward", "register_full_backward_hook",
               "grad_input (tuple; grads w.r.t. the module inputs)", check=_no_inplace)
def _backward(binding: Binding, target: Target, site: AttachSite) -> list[Any]:
    return [target.obj.register_full_backward_hook(_backward_hook(binding, target.name))]  # type: ignore[union-attr]


@register_kind("backward_legacy", "module", "backward", "register_backward_hook (deprecated)",
               "grad_input of the module's last op", check=_legacy_warning)
def _backward_legacy(binding: Binding, target: Target, site: AttachSite) -> list[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # we warned once, naming the spec, in the check
        return [target.obj.register_backward_hook(_backward_hook(binding, target.name))]  # type: ignore[union-attr]


def _node_kind(pre: bool) -> Attach:
    def attach(binding: Binding, target: Target, site: AttachSite) -> list[Any]:
        name = target.name

        @eager
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not torch.is_grad_enabled() or not binding.live(None):
                return
            nodes = []
            for _, t in output_tensors(output):
                if t.grad_fn is not None and all(t.grad_fn is not n for n in nodes):
                    nodes.append(t.grad_fn)
            if not nodes:
                binding.note(name, "output has no grad_fn")
            for node in nodes:
                if pre:
                    node.register_prehook(functools.partial(_node_pre_call, binding, name))
                else:
                    node.register_hook(functools.partial(_node_call, binding, name))

        return [target.obj.register_forward_hook(hook)]  # type: ignore[union-attr]

    return attach


def _node_call(binding: Binding, name: str, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> Any:
    return transformed(binding, name, grad_inputs, aux=grad_outputs)


def _node_pre_call(binding: Binding, name: str, grad_outputs: tuple[Any, ...]) -> Any:
    return transformed(binding, name, grad_outputs)


register_kind("node", "module", "backward", "grad_fn.register_hook on the module output",
              "grad_inputs of the output's autograd Node")(_node_kind(pre=False))
register_kind("node_pre", "module", "backward", "grad_fn.register_prehook on the module output",
              "grad_outputs of the output's autograd Node")(_node_kind(pre=True))


# ----------------------------------------------------------------------------------------------------
# Parameter kinds.


@register_kind("grad", "parameter", "backward", "Tensor.register_hook", "the gradient before accumulation",
               check=_grad_check)
def _grad(binding: Binding, target: Target, site: AttachSite) -> list[Any]:
    return [target.obj.register_hook(functools.partial(_grad_call, binding, target.name, None))]  # type: ignore[union-attr]


@register_kind("post_accumulate", "parameter", "backward", "register_post_accumulate_grad_hook",
               ".grad after accumulation (written back with copy_)", check=_requires_grad)
def _post_accumulate(binding: Binding, target: Target, site: AttachSite) -> list[Any]:
    name = target.name

    def hook(param: torch.Tensor) -> None:
        if param.grad is not None and binding.live(None):
            binding.apply_in_place(param.grad, name)

    return [target.obj.register_post_accumulate_grad_hook(hook)]  # type: ignore[union-attr]


@register_kind("pre_step", "parameter", "step", "Optimizer.register_step_pre_hook",
               "the final .grad right before optimizer.step()", check=_pre_step_check)
def _pre_step(binding: Binding, target: Target, site: AttachSite) -> list[Any]:
    return [site.add_pre_step(binding, target)]
