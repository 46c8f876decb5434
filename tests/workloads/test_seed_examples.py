"""The seeds' four examples, written as hook specs, against hand-written hooks and hand-computed values."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hookexp import attach
from hookexp.workloads.models import SeedNet


def test_a_seed_net_clamp_relu_grad_and_zero_fc_bias_match_hand_written_hooks():
    torch.manual_seed(0)
    net = SeedNet()
    ref = copy.deepcopy(net)
    x = torch.randn(16, 3, 8, 8)
    y = torch.randint(0, 5, (16,))

    specs = {
        "clamp_relu": {"target": "relu", "kind": "output_grad", "transform": "clamp", "args": {"min": 0.0}},
        "zero_fc_bias": {"target": "fc*.bias", "kind": "grad", "transform": "zero"},
        # registered after the clamp on the same tensor, so it sees the clamped gradient
        "seen": {"target": "relu", "kind": "output_grad", "transform": "record"},
    }
    with attach(net, specs) as hooks:
        nn.functional.cross_entropy(net(x), y).backward()
    seen = hooks.records["seen"]

    # The same hooks, by hand.
    def clamp_output_grad(module, args, out):
        out.register_hook(lambda g: g.clamp(min=0.0))

    handles = [
        ref.relu.register_forward_hook(clamp_output_grad),
        ref.fc1.bias.register_hook(lambda g: torch.zeros_like(g)),
    ]
    nn.functional.cross_entropy(ref(x), y).backward()
    for h in handles:
        h.remove()

    assert torch.equal(net.fc1.bias.grad, torch.zeros(5))
    assert len(seen) == 1 and seen[0].target == "relu"
    assert seen[0].value.min() >= 0 and (seen[0].value > 0).any()
    for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    # and the hooks changed something: without them the conv gradient differs
    plain = copy.deepcopy(ref)
    plain.zero_grad()
    nn.functional.cross_entropy(plain(x), y).backward()
    assert not torch.equal(plain.conv.weight.grad, net.conv.weight.grad)


class Add(nn.Module):
    def forward(self, x1, x2):
        return x1 + x2


def test_b_forward_adds_five_and_forward_pre_records_inputs():
    add = Add()
    x1, x2 = torch.randn(4, 3), torch.randn(4, 3)
    specs = {
        "plus5": {"target": "", "kind": "forward", "transform": "add", "args": {"value": 5}},
        "inputs": {"target": "", "kind": "forward_pre", "transform": "record"},
    }
    with attach(add, specs) as hooks:
        out = add(x1, x2)
    assert torch.equal(out, x1 + x2 + 5)
    (rec,) = hooks.records["inputs"]
    assert isinstance(rec.value, tuple) and len(rec.value) == 2
    assert torch.equal(rec.value[0], x1) and torch.equal(rec.value[1], x2)
    assert rec.value[0] is not x1  # a detached copy, not the caller's tensor
    assert torch.equal(add(x1, x2), x1 + x2)  # removed on leaving the block


class Mul(nn.Module):
    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.tensor(5.0))

    def forward(self, x1, x2):
        return x1 * x2 * self.W


def test_c_backward_record_sees_grad_input_and_grad_output():
    mul = Mul()
    x1 = torch.tensor(2.0, requires_grad=True)
    x2 = torch.tensor(3.0, requires_grad=True)
    spec = {"grads": {"target": "", "kind": "backward", "transform": "record", "args": {"aux": True}}}
    with attach(mul, spec) as hooks:
        output = mul(x1, x2)
        output.backward()
    (rec,) = hooks.records["grads"]
    grad_input, grad_output = rec.value, rec.aux
    assert torch.equal(grad_input[0], 5 * x2.detach()) and torch.equal(grad_input[1], 5 * x1.detach())
    assert len(grad_output) == 1 and torch.equal(grad_output[0], torch.tensor(1.0))
    assert x1.grad.item() == 15.0 and x2.grad.item() == 10.0


def _linear_grads(spec=None, seed_noise=None):
    lin = nn.Linear(3, 1)
    x = torch.ones(8, 3) * 10
    specs = {} if spec is None else {"noisy": spec}
    with attach(lin, specs):
        lin(x).backward(torch.full((8, 1), 1.5))
    return lin


def test_d_linear_upstream_grad_and_seeded_noise():
    lin = _linear_grads()
    assert torch.equal(lin.bias.grad, torch.tensor([12.0]))
    assert torch.equal(lin.weight.grad, torch.full((1, 3), 120.0))

    spec = {"target": "bias", "kind": "grad", "transform": "noise", "args": {"std": 0.5, "seed": 1234}}
    noisy = _linear_grads(spec)
    expected = torch.randn((1,), generator=torch.Generator().manual_seed(1234)) * 0.5
    assert torch.equal(noisy.bias.grad, torch.tensor([12.0]) + expected)
    assert not torch.equal(noisy.bias.grad, torch.tensor([12.0]))
    assert torch.equal(noisy.weight.grad, torch.full((1, 3), 120.0))  # only the bias is hooked
    again = _linear_grads(spec)
    assert torch.equal(again.bias.grad, noisy.bias.grad)  # reproducible by seed
    other = _linear_grads({**spec, "args": {"std": 0.5, "seed": 99}})
    assert not torch.equal(other.bias.grad, noisy.bias.grad)


@pytest.mark.parametrize("gamma", [0.0, 0.55])
def test_noise_anneals_with_the_step(gamma):
    lin = nn.Linear(3, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    spec = {"n": {"target": "bias", "kind": "grad", "transform": "noise",
                  "args": {"std": 1.0, "gamma": gamma, "seed": 7}}}
    gen = torch.Generator().manual_seed(7)
    with attach(lin, spec, opt):
        for step in range(3):
            opt.zero_grad()
            lin(torch.zeros(1, 3)).sum().backward()
            sigma = 1.0 / (1 + step) ** gamma
            expected = torch.tensor([1.0]) + (torch.randn((1,), generator=gen) * sigma)
            assert torch.equal(lin.bias.grad, expected)
            opt.step()
