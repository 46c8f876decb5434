"""Hook kinds: where in forward/backward a spec acts, as thin adapters over torch's hook APIs.

Each kind is registered by decorator; its facts (what it attaches to, the torch API, what its transform sees)
are written once in :data:`hookexp.engine.schema.KIND_DOCS`. Its ``attach`` registers torch hooks that call the
:class:`~hookexp.engine.binding.SpecBinding` of one target (``binding.call(site, ...)``), where schedule,
counting, checks, measuring and messages live once for all kinds; its ``check`` refuses, before anything is
attached, a target it cannot work on. An error inside a hook becomes a
:class:`~hookexp.errors.HookRuntimeError` naming the spec. The semantics are torch 2.x's own (docs/hooks.md).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from hookexp.engine import traced, values
from hookexp.engine.binding import Attach, AttachSite, Check, KindInfo, Site, SpecBinding, Stage
from hookexp.engine.schema import KIND_DOCS, KindDoc, Value
from hookexp.errors import HookCompatibilityError, RegistryError, SpecError, did_you_mean

KINDS: dict[str, KindInfo] = {}


def register_kind(name: str, *, on: Literal["module", "parameter"] | None = None, stage: Stage | None = None,
                  torch_api: str | None = None, sees: str | None = None, value: Value | None = None,
                  check: Check | None = None) -> Callable[[Attach], Attach]:
    """Decorator that registers ``attach(site, handle) -> [removable handles]`` as kind ``name`` (a name
    already taken is refused). The built-in kinds take their facts from ``schema.KIND_DOCS``; a new kind
    gives them: ``on`` (module | parameter), ``stage`` (forward | backward | step), ``torch_api``,
    ``sees`` (one line for tables) and ``value`` (inputs | output | tuple | tensor: what ``index`` picks from).
    ``check(site, handle)`` runs on every target before anything is attached."""
    doc = KIND_DOCS.get(name)
    given = {"on": on, "stage": stage, "torch_api": torch_api, "sees": sees, "value": value}
    if doc is None:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise RegistryError(f"kind {name!r} is not a built-in kind, so it needs {', '.join(missing)}.")
        doc = KindDoc(**given)  # type: ignore[arg-type]

    def deco(fn: Attach) -> Attach:
        if name in KINDS:
            raise RegistryError(f"kind {name!r} is already registered; pick another name.")
        KINDS[name] = KindInfo(name, doc.on, doc.stage, doc.torch_api, doc.sees, doc.value, fn, check)
        return fn

    return deco


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Forward-side hooks read the step and the schedule: under torch.compile, Dynamo would guard on
    those values and recompile every step. Running a hook that cannot be traced (:func:`compiled`) eagerly (a graph
    break) keeps one graph.

    ``torch.compiler.disable``'s wrapper costs more than a hand-written hook on every eager call, so it is
    taken only while Dynamo traces (where ``is_compiling()`` is true); eager calls go straight to ``fn``.
    """
    disabled = torch.compiler.disable(fn, recursive=True)
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def hook(*args: Any) -> Any:
        if is_compiling():
            return disabled(*args)
        return fn(*args)

    return hook


def compiled(fn: Callable[..., Any], trace: Callable[..., Any]) -> Callable[..., Any]:
    """A forward-side hook ``fn`` that torch.compile traces: while Dynamo traces, ``trace(disabled, *args)`` runs
    instead, reading the hook's Python state only through :mod:`hookexp.engine.traced`'s operators; it calls
    ``disabled(*args)`` (``fn`` run eagerly: a graph break) for what it cannot trace. Eager calls go straight to
    ``fn``. Without the operators (torch < 2.4), :func:`eager`."""
    if not traced.AVAILABLE:
        return eager(fn)
    disabled = torch.compiler.disable(fn, recursive=True)
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def hook(*args: Any) -> Any:
        if is_compiling():
            return trace(disabled, *args)
        return fn(*args)

    return hook


def traced_tensors(site: Site, xs: list[torch.Tensor], training: bool, tokens: tuple[Any, Any]
                   ) -> list[torch.Tensor] | None:
    """The spec's transform on ``xs``, traced: each result where the call acts, else the input
    (``torch.where`` on the flag ``hookexp::enter`` returns); the effects measured by ``hookexp::observe``. None
    (nothing traced, nothing counted) where the eager hook must run instead: a result that is not a tensor like its
    input, or that no longer requires grad (a cut graph, which the eager hook warns about). The transform sees the
    input only where the call acts, elsewhere a detached copy: its backward never runs on the live graph there
    (0 x inf would be NaN) and an in-place transform never writes the module's tensor."""
    b = site.binding
    tf = b.transform

    def call(x: torch.Tensor) -> Any:
        return tf.call(x, None) if tf.wants_ctx else tf.call(x)

    for x in xs:  # a trial on a copy decides; its ops are dead code that the compiler drops
        y = call(x.clone())
        if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
            return None
        if x.requires_grad and not y.requires_grad and torch.is_grad_enabled():
            return None
    enter, measure = tokens
    acts = traced.enter(xs[0], enter, int(training))
    outs = []
    for x in xs:
        seen = torch.where(acts, x, x.detach())
        y = call(seen)
        outs.append(x if y is seen else torch.where(acts, y, x))
    # acts goes first although measure_traced reads the flag enter_traced kept: as an input it orders observe
    # after enter in the graph, which an unchanged result (no torch.where) would not
    traced.observe([acts, *(t for pair in zip(xs, outs, strict=True) for t in pair)], measure)
    return outs


def _tokens(site: Site) -> tuple[traced.Token, traced.Token]:
    b = site.binding
    return (traced.Token(lambda mode: b.enter_traced(site, bool(mode))),
            traced.Token(lambda pairs, mode: b.measure_traced(site, pairs)))


def refuse_compiled(model: nn.Module) -> None:
    """Refuse a model already compiled with torch.compile: torch silently ignores hooks added after compiling."""
    if type(model).__name__ == "OptimizedModule":
        raise HookCompatibilityError(
            "the model is already compiled with torch.compile, and hooks added after compiling are "
            "silently ignored by torch. Attach the hooks to the eager model first, then compile it."
        )


# ----------------------------------------------------------------------------------------------------
# Checks that refuse a kind (or resolve what it needs) before anything is attached.


def _first_leaf(module: nn.Module) -> nn.Module:
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return module


def inplace_hazard(model: nn.Module, name: str, module: nn.Module) -> str | None:
    """Why a full backward hook on ``module`` would break on an in-place op, or None.

    torch wraps the inputs and outputs of a module with a full backward hook in an identity Function;
    an in-place op on those (``inplace=True`` in the module itself, in the first module it runs, or in
    the module run right after it in a Sequential) raises in torch. In-place ops in a parent's forward
    code (``out += identity``, a functional ``relu_``) cannot be seen here: the first forward names them.
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


def _no_inplace(site: Site, handle: AttachSite) -> None:
    why = inplace_hazard(handle.model, site.name, site.obj)  # type: ignore[arg-type]
    if why:
        raise HookCompatibilityError(
            f"kind {site.binding.spec.kind!r} cannot be used on {site.name!r}: {why}, and torch raises on "
            "in-place ops around full backward hooks. Use kind 'output_grad' (grad w.r.t. the module "
            "output, safe with in-place ops) or 'node'/'node_pre', or set inplace=False in the model.",
            spec=site.binding.spec.name, field="kind",
        )


def resolve_input(module: nn.Module, name: str) -> tuple[str, int | None] | str:
    """``input: NAME`` against ``module.forward``'s signature: (name, its position or None if keyword-only),
    or the reason it cannot be (listing the parameters)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return name, None
    for i, p in enumerate(params):
        if p.name == name:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                return f"{name!r} is forward()'s {'*' if p.kind is p.VAR_POSITIONAL else '**'}{name}, not one input"
            positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and all(
                q.kind is not q.VAR_POSITIONAL for q in params[:i])
            return name, i if positional else None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return name, None  # may come through **kwargs: the dry run tells whether it ever does
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return (f"{type(module).__name__}.forward() has no parameter {name!r}.{did_you_mean(name, names)} "
            f"Its parameters: {', '.join(names) or '(none)'}")


def _forward_check(site: Site, handle: AttachSite) -> None:
    spec = site.binding.spec
    if spec.input is None:
        return
    found = resolve_input(site.obj, spec.input)  # type: ignore[arg-type]
    if isinstance(found, str):
        raise SpecError(f"target {site.name!r}: {found}.", spec=spec.name, field="input")
    site.input = found


def _requires_grad(site: Site, handle: AttachSite) -> None:
    if not site.obj.requires_grad:
        raise HookCompatibilityError(
            f"parameter {site.name!r} does not require grad (it is frozen), so a {site.binding.spec.kind!r} hook "
            f"on it would never fire. Narrow the target with exclude: [{site.name!r}], or unfreeze it.",
            spec=site.binding.spec.name, field="target",
        )


def _grad_check(site: Site, handle: AttachSite) -> None:
    _requires_grad(site, handle)
    if type(site.obj).__name__ == "DTensor":
        raise HookCompatibilityError(
            f"parameter {site.name!r} is a DTensor (FSDP2), whose Tensor.register_hook never fires. "
            "Use kind 'post_accumulate' or 'pre_step' instead.",
            spec=site.binding.spec.name, field="kind",
        )


def _pre_step_check(site: Site, handle: AttachSite) -> None:
    _requires_grad(site, handle)
    spec = site.binding.spec
    if handle.optimizer is None:
        raise HookCompatibilityError(
            "kind 'pre_step' runs right before optimizer.step(), so it needs the optimizer: call "
            "attach(model, specs, optimizer=opt), or use kind 'post_accumulate'.",
            spec=spec.name, field="kind",
        )
    owned = {id(p) for group in handle.optimizer.param_groups for p in group["params"]}
    if id(site.obj) not in owned:
        raise HookCompatibilityError(
            f"parameter {site.name!r} is not in the optimizer's param_groups, so optimizer.step() never "
            "uses its gradient. Exclude it, or add it to the optimizer.",
            spec=spec.name, field="target",
        )


def _legacy_warning(site: Site, handle: AttachSite) -> None:
    warnings.warn(
        f"hooks.{site.binding.spec.name}: kind 'backward_legacy' uses the deprecated Module.register_backward_hook, "
        "which sees the grad_input of the module's last op only (it may hold parameter grads). Use kind "
        "'backward' (register_full_backward_hook) for gradients w.r.t. the module inputs.",
        FutureWarning, stacklevel=2,
    )


# ----------------------------------------------------------------------------------------------------
# Module kinds.


@register_kind("forward_pre", check=_forward_check)
def _forward_pre(site: Site, handle: AttachSite) -> list[Any]:
    b = site.binding
    tokens = _tokens(site)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not b.live_in(site, module.training):
            return None
        return b.call(site, b.apply_inputs, args, kwargs, site)

    def trace(disabled: Callable[..., Any], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not b.traceable:
            return disabled(module, args, kwargs)
        if site.input is not None:  # one input, by name
            name, pos = site.input
            keys: list[int | str] = [name] if name in kwargs else [pos] if pos is not None and pos < len(args) else []
        else:  # the tensors at the top level of the inputs
            keys = [*range(len(args)), *kwargs]
        keys = [k for k in keys if isinstance(kwargs[k] if isinstance(k, str) else args[k], torch.Tensor)]
        picked = [kwargs[k] if isinstance(k, str) else args[k] for k in keys]
        outs = traced_tensors(site, picked, module.training, tokens) if keys else None
        if outs is None:
            return disabled(module, args, kwargs)
        if all(out is x for out, x in zip(outs, picked, strict=True)):
            return None
        new_args, new_kwargs = list(args), dict(kwargs)
        for k, out in zip(keys, outs, strict=True):
            if isinstance(k, str):
                new_kwargs[k] = out
            else:
                new_args[k] = out
        return tuple(new_args), new_kwargs

    return [site.obj.register_forward_pre_hook(compiled(hook, trace), with_kwargs=True), *tokens]  # type: ignore[union-attr]


@register_kind("forward", check=_forward_check)
def _forward(site: Site, handle: AttachSite) -> list[Any]:
    b = site.binding
    tokens = _tokens(site)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not b.live_in(site, module.training):
            return None
        aux = args if site.input is None else _picked_input(site.input, args, kwargs)  # what ctx.aux shows
        if b.plain and isinstance(output, torch.Tensor):  # the common case, one call shorter
            new = b.call(site, b.apply_tensor, output, site, aux, None)
        else:
            new = b.call(site, b.apply, output, site, aux)
        return None if new is output else new

    def trace(disabled: Callable[..., Any], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              output: Any) -> Any:
        outs = (traced_tensors(site, [output], module.training, tokens)
                if b.traceable and isinstance(output, torch.Tensor) else None)
        if outs is None:
            return disabled(module, args, kwargs, output)
        return None if outs[0] is output else outs[0]

    return [site.obj.register_forward_hook(compiled(hook, trace), with_kwargs=True), *tokens]  # type: ignore[union-attr]


def _picked_input(found: tuple[str, int | None], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    name, pos = found
    if name in kwargs:
        return kwargs[name]
    return args[pos] if pos is not None and pos < len(args) else None


def _output_tensors(b: SpecBinding | type[_NoIndex], output: Any) -> list[tuple[int | str | None, torch.Tensor]]:
    """The output tensors an ``output_grad``/``node`` spec acts on: ``index`` picks one, else the top level."""
    if b.index is not None:
        key = values.locate(output, b.index)
        elem = values.get(output, key)
        return [(b.index if key is None else key, elem)] if isinstance(elem, torch.Tensor) else []
    if isinstance(output, torch.Tensor):
        return [(None, output)]
    return [(k, v) for k, v in values.elements(output) if isinstance(v, torch.Tensor)]


def _on_output(site: Site, hook_output: Callable[..., bool], missing: str, *extra: Any,
               trace: Callable[..., Any] | None = None) -> Any:
    """A forward hook that, in a pass that builds a graph, hooks the backward side of the output
    (``hook_output(site, output, *extra)``), noting ``missing`` when there was nothing to hook. ``trace``: what runs
    instead while torch.compile traces (:func:`compiled`); without it, the hook runs eagerly there."""
    b = site.binding

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not b.active or not torch.is_grad_enabled():
            return
        if not b.call(site, hook_output, site, output, *extra, counted=False):
            b.note(site.name, missing)

    return site.obj.register_forward_hook(eager(hook) if trace is None else compiled(hook, trace))  # type: ignore[union-attr]


@register_kind("output_grad")
def _output_grad(site: Site, handle: AttachSite) -> list[Any]:
    token = traced.Token(lambda grad, key: _grad_call(site, key, grad))

    def trace(disabled: Callable[..., Any], module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Each output tensor replaced by a copy whose gradient goes through ``hookexp::grad`` (a tensor hook on an
        intermediate tensor would need compiled autograd); whether the spec acts is asked when the gradient comes."""
        if not torch.is_grad_enabled():
            return None
        if isinstance(output, torch.Tensor) and site.binding.index in (None, 0, -1):
            picked: list[tuple[int | str | None, torch.Tensor]] = [(None, output)]
        elif type(output) in (tuple, list) and site.binding.index is None:
            picked = [(i, t) for i, t in enumerate(output) if isinstance(t, torch.Tensor)]
        else:
            return disabled(module, args, output)
        picked = [(k, t) for k, t in picked if t.requires_grad]
        if not picked:  # nothing to hook (the eager hook notes it for the dry run, which is never compiled)
            return None
        if isinstance(output, torch.Tensor):
            return traced.grad_site(output, token, site.binding.index)
        new = list(output)
        for k, t in picked:
            new[k] = traced.grad_site(t, token, k)  # type: ignore[index]
        return type(output)(new)

    return [_on_output(site, _hook_output_grads, "output does not require grad", trace=trace), token]


def _hook_output_grads(site: Site, output: Any) -> bool:
    """``output_grad``: a tensor hook on each output tensor that requires grad; whether there was one."""
    b = site.binding
    try:
        picked = _output_tensors(b, output)
    except LookupError as e:
        raise SpecError(f"{e} (target {site.name!r}, kind 'output_grad').", spec=b.spec.name,
                        field="index") from None
    hooked = False
    for key, t in picked:
        if t.requires_grad:
            t.register_hook(functools.partial(_grad_call, site, key))
            hooked = True
    return hooked


def _grad_call(site: Site, key: int | str | None, grad: torch.Tensor) -> torch.Tensor | None:
    b = site.binding
    if not b.active:
        return None
    new = b.call(site, b.apply_value, grad, site, None, key)
    return None if new is grad else new


def _tuple_call(site: Site, value: tuple[Any, ...], aux: Any = None) -> Any:
    """backward, backward_pre, node, node_pre: the transform on a tuple of grads; None keeps torch's."""
    b = site.binding
    if not b.active:
        return None
    new = b.call(site, b.apply, value, site, aux)
    return None if new is value else new


def _track_forward(site: Site, handle: AttachSite) -> Any:
    """A forward hook telling the handle that this full-backward-hooked module ran (to name it if an in-place
    op on its output makes torch raise later in the forward)."""
    return site.obj.register_forward_hook(lambda m, a, o: handle.ran(site))  # type: ignore[union-attr]


@register_kind("backward_pre", check=_no_inplace)
def _backward_pre(site: Site, handle: AttachSite) -> list[Any]:
    def hook(module: nn.Module, grad_output: tuple[Any, ...]) -> Any:
        return _tuple_call(site, grad_output)

    return [site.obj.register_full_backward_pre_hook(hook), _track_forward(site, handle)]  # type: ignore[union-attr]


def _backward_hook(site: Site) -> Callable[..., Any]:
    def hook(module: nn.Module, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> Any:
        return _tuple_call(site, grad_input, grad_output)

    return hook


@register_kind("backward", check=_no_inplace)
def _backward(site: Site, handle: AttachSite) -> list[Any]:
    return [site.obj.register_full_backward_hook(_backward_hook(site)), _track_forward(site, handle)]  # type: ignore[union-attr]


@register_kind("backward_legacy", check=_legacy_warning)
def _backward_legacy(site: Site, handle: AttachSite) -> list[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # we warned once, naming the spec, in the check
        return [site.obj.register_backward_hook(_backward_hook(site))]  # type: ignore[union-attr]


def _node_kind(pre: bool) -> Attach:
    def attach(site: Site, handle: AttachSite) -> list[Any]:
        return [_on_output(site, _hook_nodes, "output has no grad_fn", pre)]

    return attach


def _hook_nodes(site: Site, output: Any, pre: bool) -> bool:
    """``node``/``node_pre``: a hook on the autograd Node of each output tensor (once per Node); whether
    there was one."""
    nodes: list[Any] = []
    for _, t in _output_tensors(_NoIndex, output):
        if t.grad_fn is not None and all(t.grad_fn is not n for n in nodes):
            nodes.append(t.grad_fn)
    for node in nodes:
        if pre:
            node.register_prehook(functools.partial(_node_pre_call, site))
        else:
            node.register_hook(functools.partial(_node_call, site))
    return bool(nodes)


class _NoIndex:
    """Node kinds hook every output's grad_fn; their ``index`` picks from the Node's grad tuple instead."""

    index = None


def _node_call(site: Site, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> Any:
    return _tuple_call(site, grad_inputs, grad_outputs)


def _node_pre_call(site: Site, grad_outputs: tuple[Any, ...]) -> Any:
    return _tuple_call(site, grad_outputs)


register_kind("node")(_node_kind(pre=False))
register_kind("node_pre")(_node_kind(pre=True))


# ----------------------------------------------------------------------------------------------------
# Parameter kinds.


@register_kind("grad", check=_grad_check)
def _grad(site: Site, handle: AttachSite) -> list[Any]:
    return [site.obj.register_hook(functools.partial(_grad_call, site, None))]  # type: ignore[union-attr]


@register_kind("post_accumulate", check=_requires_grad)
def _post_accumulate(site: Site, handle: AttachSite) -> list[Any]:
    b = site.binding

    def hook(param: torch.Tensor) -> None:
        if param.grad is not None and b.active:
            b.call(site, b.apply_in_place, param.grad, site)

    return [site.obj.register_post_accumulate_grad_hook(hook)]  # type: ignore[union-attr]


@register_kind("pre_step", check=_pre_step_check)
def _pre_step(site: Site, handle: AttachSite) -> list[Any]:
    return [handle.add_pre_step(site)]
