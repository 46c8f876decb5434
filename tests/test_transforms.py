"""Every transform: its values, and the contract (dtype, device, shape kept; expanded inputs work)."""

from __future__ import annotations

import pytest
import torch

from hookexp.transforms import TRANSFORMS, HookContext, bind_transform

ARGS = {
    "add": {"value": 5.0}, "scale": {"factor": -2.0}, "clamp": {"min": -0.5, "max": 0.5}, "noise": {"std": 0.1},
    "clip_norm": {"max_norm": 0.1}, "mask": {"p": 0.5}, "quantize": {"step": 0.25}, "replace": {"value": 3.0},
    "reverse": {"lambda": 0.5},
}


def ctx(step=0, records=None):
    return HookContext(spec="s", kind="grad", target="w", step=step, records=records if records is not None else [])


def run(name, x, **extra):
    bound = bind_transform(name, {**ARGS.get(name, {}), **extra}, "s")
    return bound(x, HookContext("s", "grad", "w", 0, state=bound.state, records=[]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transform_keeps_dtype_device_shape_on_expanded_input(name, dtype, device):
    base = torch.linspace(-1, 1, 6, dtype=dtype, device=device)
    x = base.view(1, 6).expand(4, 6)  # stride 0 along dim 0
    assert x.stride(0) == 0
    version = x._version
    y = run(name, x)
    assert y.dtype == dtype and y.device == x.device and y.shape == x.shape
    assert x._version == version  # out of place


def test_value_dependent_transforms_are_flagged():
    # the trainer warns when these act on fp16-scaled gradients; sign-like transforms are scale-free
    flagged = sorted(name for name, info in TRANSFORMS.items() if info.value_dependent)
    assert flagged == ["add", "clamp", "clip_norm", "noise", "quantize", "replace"]


def test_values():
    x = torch.tensor([-2.0, -0.5, 0.0, 0.3, 4.0])
    assert torch.equal(run("identity", x), x)
    assert torch.equal(run("add", x), x + 5)
    assert torch.equal(run("scale", x), x * -2)
    assert torch.equal(run("clamp", x), torch.tensor([-0.5, -0.5, 0.0, 0.3, 0.5]))
    assert torch.equal(run("zero", x), torch.zeros(5))
    assert torch.equal(run("zero_ablate", x), torch.zeros(5))
    assert torch.equal(run("negate", x), -x)
    assert torch.equal(run("reverse", x), x * -0.5)
    assert torch.equal(run("sign", x), torch.tensor([-1.0, -1.0, 0.0, 1.0, 1.0]))
    assert torch.equal(run("quantize", x), torch.tensor([-2.0, -0.5, 0.0, 0.25, 4.0]))
    assert torch.equal(run("replace", x), torch.full((5,), 3.0))
    clipped = run("clip_norm", x)
    assert torch.allclose(clipped.norm(), torch.tensor(0.1), atol=1e-6)
    assert torch.allclose(clipped / clipped.norm(), x / x.norm())
    small = torch.tensor([0.01, 0.02])
    assert torch.equal(run("clip_norm", small), small)  # under the bound: unchanged


def test_mean_ablate_and_mask():
    x = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(run("mean_ablate", x), x.mean(0, keepdim=True).expand(3, 4))
    masked = run("mask", x, p=None, index=[1, 3])
    assert torch.equal(masked[:, [0, 2]], x[:, [0, 2]]) and masked[:, [1, 3]].abs().sum() == 0
    dropped = run("mask", torch.ones(1000), p=0.3)
    assert 0.2 < (dropped == 0).float().mean() < 0.4


def test_noise_is_seeded_per_spec_and_follows_torch_seed():
    x = torch.zeros(8)
    torch.manual_seed(3)
    a = run("noise", x)
    torch.manual_seed(3)
    b = run("noise", x)
    torch.manual_seed(4)
    c = run("noise", x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert 0.0 < a.std() < 0.5


def test_dead_units_probe_emits_the_dead_fraction_on_log_steps_only():
    from torch import nn

    from hookexp import attach

    relu = nn.ReLU()
    x = torch.randn(8, 4, 3, 3)
    x[:, 1] = -1.0  # channel 1 is dead in the whole batch
    x[:, 3] = -x[:, 3].abs()  # and channel 3
    with attach(relu, {"p": {"target": "", "kind": "forward", "transform": "dead_units"}}, measure=False) as hooks:
        assert torch.equal(relu(x), torch.relu(x))
        assert "dead_frac" not in hooks.stats()["p"]  # not a log step: nothing computed
        hooks.measuring = True
        relu(x)
        relu(x[:, :2])  # a second call: channel 1 of 2 dead
        assert hooks.stats()["p"]["dead_frac"] == pytest.approx((0.5 + 0.5) / 2)


def test_record_keeps_whole_tuples_and_aux():
    recs = []
    bound = bind_transform("record", {"aux": True}, "s")
    value = (torch.ones(2), None)
    c = HookContext("s", "backward", "m", 3, aux=(torch.zeros(1),), records=recs)
    assert bound(value, c) is value
    (r,) = recs
    assert r.step == 3 and torch.equal(r.value[0], torch.ones(2)) and r.value[1] is None
    assert torch.equal(r.aux[0], torch.zeros(1))
