"""Forward-side hooks that torch.compile traces: the Python state a hook reads (its step window, phase, counters,
whether this step measures) is read inside opaque operators that the compiled graph calls at run time, so Dynamo
guards on none of it and nothing breaks the graph. ``hookexp::enter`` counts a call and returns whether the hook
acts (a 0-d bool tensor: the traced transform is selected with ``torch.where``), ``hookexp::observe`` hands tensors
to Python (effects, activation statistics), ``hookexp::grad_site`` runs a backward-side transform on the gradient of
a forward output. They need ``torch.library.custom_op`` (torch >= 2.4): without it the hooks run eagerly under
compile (a graph break). Used only while Dynamo traces; eager calls never reach them (docs/training.md).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

AVAILABLE = hasattr(torch.library, "custom_op") and hasattr(torch.fx.node, "has_side_effect")
_ids = itertools.count()


class Token:
    """A Python callback the operators reach by a number baked into the graph; ``remove`` (a removable handle, as
    torch's) unregisters it, after which the operators do nothing for it. Registered weakly: the hook that uses it
    keeps it alive, so a model dropped without removing its hooks takes its tokens with it."""

    __slots__ = ("__weakref__", "fn", "id")

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.id = next(_ids)
        _TOKENS[self.id] = self

    def remove(self) -> None:
        _TOKENS.pop(self.id, None)


_TOKENS: weakref.WeakValueDictionary[int, Token] = weakref.WeakValueDictionary()  # id -> token, while attached


def _callback(token: int) -> Callable[..., Any] | None:
    found = _TOKENS.get(token)
    return None if found is None else found.fn


def _key(key: str) -> int | str | None:
    """The element key a ``grad_site`` call carries: '' (the whole output), '#<position>' or a field name."""
    if not key:
        return None
    return int(key[1:]) if key.startswith("#") else key


def encode_key(key: int | str | None) -> str:
    return "" if key is None else f"#{key}" if isinstance(key, int) else key


if AVAILABLE:
    @torch.library.custom_op("hookexp::enter", mutates_args=())
    def _enter(x: torch.Tensor, token: int, mode: int) -> torch.Tensor:
        fn = _callback(token)
        return torch.full((), fn is not None and bool(fn(mode)), dtype=torch.bool, device=x.device)

    @_enter.register_fake
    def _(x: torch.Tensor, token: int, mode: int) -> torch.Tensor:
        return x.new_empty((), dtype=torch.bool)

    @torch.library.custom_op("hookexp::observe", mutates_args=())
    def _observe(xs: list[torch.Tensor], token: int, mode: int) -> None:
        fn = _callback(token)
        if fn is not None:
            fn(xs, mode)

    @_observe.register_fake
    def _(xs: list[torch.Tensor], token: int, mode: int) -> None:
        return None

    @torch.library.custom_op("hookexp::grad", mutates_args=())
    def _grad(grad: torch.Tensor, token: int, key: str) -> torch.Tensor:
        fn = _callback(token)
        new = fn(grad, _key(key)) if fn is not None else None
        if new is None:
            return grad.clone()  # an operator's output never aliases its input
        if new.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
            new = new.clone()  # the gradient itself, or a view of it (grad.t()): its values, in a new tensor
        if new.stride() != grad.stride():  # the layout the fake kernel promised
            return torch.empty_like(grad).copy_(new)
        return new

    @_grad.register_fake
    def _(grad: torch.Tensor, token: int, key: str) -> torch.Tensor:
        return torch.empty_like(grad)

    @torch.library.custom_op("hookexp::grad_site", mutates_args=())
    def _grad_site(x: torch.Tensor, token: int, key: str) -> torch.Tensor:
        return x.clone()  # a new tensor, not a view: in-place ops after the module stay legal

    @_grad_site.register_fake
    def _(x: torch.Tensor, token: int, key: str) -> torch.Tensor:
        return torch.empty_like(x)

    def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.token, ctx.key = inputs[1], inputs[2]

    def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return torch.ops.hookexp.grad(grad, ctx.token, ctx.key), None, None

    _grad_site.register_autograd(_backward, setup_context=_setup)
    for _op in (torch.ops.hookexp.enter.default, torch.ops.hookexp.observe.default, torch.ops.hookexp.grad.default):
        torch.fx.node.has_side_effect(_op)  # called for what they do in Python: never dropped, merged or recomputed


def enter(x: torch.Tensor, token: Token, mode: int) -> torch.Tensor:
    """Whether the hook of ``token`` acts on this call (its callback, given ``mode``, decides and counts)."""
    return torch.ops.hookexp.enter(x.detach(), token.id, mode)


def observe(xs: list[torch.Tensor], token: Token, mode: int = 0) -> None:
    """Hand ``xs`` (detached) to the callback of ``token``, with ``mode``, when the graph runs."""
    torch.ops.hookexp.observe([x.detach() for x in xs], token.id, mode)


def grad_site(x: torch.Tensor, token: Token, key: int | str | None) -> torch.Tensor:
    """``x``, whose gradient goes through the callback of ``token`` (``fn(grad, key) -> new grad or None``)."""
    return torch.ops.hookexp.grad_site(x, token.id, encode_key(key))
