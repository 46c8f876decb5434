"""User transforms for the tests, importable as `user_transforms` (tests/conftest.py puts tests/helpers on sys.path)."""

import torch


def double(x, ctx, times: int = 2):
    return x * times


def no_ctx(x, offset: float = 1.0):
    return x + offset


def explode(x, ctx, **args):
    raise ValueError("boom")


def in_place(x, ctx):
    return x.mul_(2)


def reshape(x, ctx, **args):
    return x.reshape(-1)


def to_double(x, ctx):
    return x.to(torch.float64)


def make_nan(x, ctx):
    return x * float("nan")


def slow(x, ctx, seconds: float = 0.003):
    """Changes nothing; makes a run slow enough to interrupt at a chosen point."""
    import time

    time.sleep(seconds)
    return x


def signal_at(x, ctx, step: int, signum: int = 15):
    """Changes nothing; sends this process `signum` once, during training step `step`: a stop at a known point."""
    import os

    if ctx.step == step and not ctx.state.get("sent"):
        ctx.state["sent"] = True
        os.kill(os.getpid(), signum)
    return x


def nan_at(x, ctx, step: int):
    """NaN gradients at training step `step` only."""
    return x * float("nan") if ctx.step == step else x


def huge(x, ctx, factor: float = 1e30):
    """Finite gradients whose float32 norm overflows (a sum of squares beyond 3.4e38)."""
    return x * factor


def torch_error(x, ctx):
    """Raises torch's own RuntimeError (a shape mismatch) inside the hook."""
    return x + torch.ones(x.numel() + 1)


def detached(x, ctx):
    """Returns the tensor cut from the autograd graph (a common mistake: .detach() or .data in a transform)."""
    return x.detach()


def nan_on_rank(x, ctx, step: int, rank: int = 1):
    """NaN at training step `step` on one rank only (its own shard or batch part)."""
    import torch.distributed as dist

    here = dist.get_rank() if dist.is_initialized() else 0
    return x * float("nan") if ctx.step == step and here == rank else x


def spike_at(x, ctx, step: int, size: float = 30.0):
    """Logits plus noise of scale `size` at training step `step` only: a loss spike at a known step whose gradient
    stays bounded (softmax minus one-hot), so that training goes on as before."""
    return x + size * torch.randn_like(x) if ctx.step == step else x
