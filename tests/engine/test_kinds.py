"""Every hook kind against the same hook written by hand with the torch API, bit for bit.

The model has the three things that break naive hook code: an in-place ReLU, a module called twice
per forward, and tied weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hookexp import HookCompatibilityError, attach


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.act = nn.ReLU(inplace=True)  # modifies embed's output in place
        self.block = nn.Linear(8, 8)  # called twice per forward
        self.tied_a = nn.Linear(8, 8)
        self.tied_b = nn.Linear(8, 8)
        self.tied_b.weight = self.tied_a.weight  # tied
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.act(self.embed(x))
        h = self.block(torch.tanh(self.block(h)))
        h = self.tied_b(torch.tanh(self.tied_a(h)))
        return self.head(h)


def half(t):
    return None if t is None else t * 0.5


def clamp(t):
    return t.clamp(min=-0.01, max=0.01)


def _by_hand_output_grad(model):
    def fwd(m, a, out):
        out.register_hook(clamp)

    return [model.block.register_forward_hook(fwd)]


def _by_hand_node(pre):
    def install(model):
        def fwd(m, a, out):
            if pre:
                out.grad_fn.register_prehook(lambda go: tuple(half(g) for g in go))
            else:
                out.grad_fn.register_hook(lambda gi, go: tuple(half(g) for g in gi))

        return [model.block.register_forward_hook(fwd)]

    return install


def _by_hand_post_accumulate(model):
    def hook(p):
        p.grad.copy_(clamp(p.grad))

    return [model.block.weight.register_post_accumulate_grad_hook(hook)]


# kind -> (spec, by-hand installer, calls per forward/backward)
CASES = {
    "forward_pre": (
        {"target": "block", "kind": "forward_pre", "transform": "scale", "args": {"factor": 0.5}},
        lambda m: [m.block.register_forward_pre_hook(lambda mod, a: (half(a[0]),))], 2),
    "forward": (
        {"target": "block", "kind": "forward", "transform": "scale", "args": {"factor": 0.5}},
        lambda m: [m.block.register_forward_hook(lambda mod, a, o: half(o))], 2),
    "output_grad": (
        {"target": "block", "kind": "output_grad", "transform": "clamp", "args": {"min": -0.01, "max": 0.01}},
        _by_hand_output_grad, 2),
    "backward_pre": (
        {"target": "block", "kind": "backward_pre", "transform": "scale", "args": {"factor": 0.5}},
        lambda m: [m.block.register_full_backward_pre_hook(lambda mod, go: (half(go[0]),))], 2),
    "backward": (
        {"target": "block", "kind": "backward", "transform": "scale", "args": {"factor": 0.5}},
        lambda m: [m.block.register_full_backward_hook(lambda mod, gi, go: (half(gi[0]),))], 2),
    "node": ({"target": "block", "kind": "node", "transform": "scale", "args": {"factor": 0.5}},
             _by_hand_node(pre=False), 2),
    "node_pre": ({"target": "block", "kind": "node_pre", "transform": "scale", "args": {"factor": 0.5}},
                 _by_hand_node(pre=True), 2),
    "grad": (  # the tied weight, named by its second name: one hook, fired once on the summed grad
        {"target": "tied_b.weight", "kind": "grad", "transform": "clamp", "args": {"min": -0.01, "max": 0.01}},
        lambda m: [m.tied_a.weight.register_hook(clamp)], 1),
    "post_accumulate": (
        {"target": "block.weight", "kind": "post_accumulate", "transform": "clamp",
         "args": {"min": -0.01, "max": 0.01}},
        _by_hand_post_accumulate, 1),
}


def _forward_backward(model, x):
    out = model(x)
    out.square().sum().backward()
    return out


@pytest.mark.parametrize("kind", sorted(CASES))
def test_kind_matches_hand_written_hook(kind, device):
    spec, install, calls = CASES[kind]
    torch.manual_seed(0)
    model = Probe().to(device)
    ref = copy.deepcopy(model)
    ref.tied_b.weight = ref.tied_a.weight
    x = torch.randn(5, 6, device=device)

    with attach(model, {"h": spec}) as hooks:
        out = _forward_backward(model, x)
        stats = hooks.stats()["h"]
    handles = install(ref)
    ref_out = _forward_backward(ref, x)
    for h in handles:
        h.remove()

    assert torch.equal(out, ref_out)
    plain = copy.deepcopy(ref)
    plain.zero_grad()
    plain_out = _forward_backward(plain, x)
    changed = not torch.equal(plain_out, out)
    for (name, p), (_, q), (_, r) in zip(model.named_parameters(), ref.named_parameters(),
                                         plain.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), f"{kind}: {name}"
        changed = changed or not torch.equal(p.grad, r.grad)
    assert changed, f"{kind}: the hook had no effect, so the comparison proves nothing"
    assert stats["calls"] == calls
    assert stats["frac_changed"] > 0


def test_backward_legacy_warns_and_matches_register_backward_hook():
    torch.manual_seed(0)
    model = Probe()
    ref = copy.deepcopy(model)
    ref.tied_b.weight = ref.tied_a.weight
    x = torch.randn(5, 6)
    spec = {"target": "head", "kind": "backward_legacy", "transform": "scale", "args": {"factor": 0.5}}
    with pytest.warns(FutureWarning, match=r"hooks\.legacy: kind 'backward_legacy'.*Use kind 'backward'"), \
            attach(model, {"legacy": spec}):
        _forward_backward(model, x)
    h = ref.head.register_backward_hook(lambda mod, gi, go: tuple(half(g) for g in gi))
    with pytest.warns(FutureWarning, match="non-full backward hook"):  # torch's own, at forward time
        _forward_backward(ref, x)
    h.remove()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("spec_args", [{"min": -0.01, "max": 0.01}, {"max": 0.0}])
def test_pre_step_matches_hand_written_optimizer_hook(spec_args, device):
    torch.manual_seed(0)
    model = Probe().to(device)
    ref = copy.deepcopy(model)
    ref.tied_b.weight = ref.tied_a.weight
    x = torch.randn(5, 6, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def by_hand(optimizer, args, kwargs):
        for p in ref.parameters():
            if p.grad is not None:
                p.grad.copy_(p.grad.clamp(min=spec_args.get("min"), max=spec_args.get("max")))

    ref_opt.register_step_pre_hook(by_hand)
    spec = {"c": {"target": "*", "kind": "pre_step", "transform": "clamp", "args": spec_args}}
    with attach(model, spec, opt) as hooks:
        for _ in range(3):
            opt.zero_grad()
            _forward_backward(model, x)
            opt.step()
            ref_opt.zero_grad()
            _forward_backward(ref, x)
            ref_opt.step()
        assert hooks.step == 3
        n_params = len(list(model.parameters()))  # tied weight counted once
        assert hooks.stats()["c"]["calls"] == 3 * n_params
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_pre_step_needs_the_optimizer():
    with pytest.raises(HookCompatibilityError, match=r"hooks\.c\.kind: kind 'pre_step' .* needs the optimizer"):
        attach(Probe(), {"c": {"target": "*", "kind": "pre_step", "transform": "zero"}})


def test_full_backward_hook_next_to_inplace_relu_is_refused_before_attaching():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    with pytest.raises(HookCompatibilityError, match=r"hooks\.b\.kind: .*'1' \(ReLU, inplace=True\).*'output_grad'"):
        attach(seq, {"b": {"target": "0", "kind": "backward", "transform": "identity"}})
    with pytest.raises(HookCompatibilityError, match=r"module '1' \(ReLU\) runs an op with inplace=True"):
        attach(seq, {"b": {"target": "1", "kind": "backward_pre", "transform": "identity"}})
    assert not seq[0]._backward_hooks and not seq[1]._backward_pre_hooks  # nothing attached
    attach(seq, {"b": {"target": "0", "kind": "output_grad", "transform": "identity"}}).remove()


def test_frozen_parameter_is_refused():
    model = Probe()
    model.head.bias.requires_grad_(False)
    with pytest.raises(HookCompatibilityError, match=r"'head\.bias' does not require grad .* exclude"):
        attach(model, {"g": {"target": "head.*", "kind": "grad", "transform": "zero"}})
    with attach(model, {"g": {"target": "head.*", "kind": "grad", "transform": "zero", "exclude": ["*.bias"]}}) as h:
        assert [t.name for t in h.bindings[0].targets] == ["head.weight"]


# the kinds torch.compile traces whole (docs/training.md); the others run eagerly there, a graph break at the target
TRACED = {"forward_pre", "forward", "output_grad", "grad", "post_accumulate"}


def _eager_and_compiled(spec, backend, steps=1):
    """Outputs, gradients and the hook's stats (measured every step) of ``steps`` steps on copies of one model,
    eager then compiled with ``backend``; and the graph breaks Dynamo counted."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = Probe()
    x = torch.randn(5, 6)
    results = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        model.tied_b.weight = model.tied_a.weight
        counters.clear()
        with attach(model, {"h": spec}, measure=True) as hooks:
            forward = torch.compile(model, backend=backend) if compiled else model
            for step in range(steps):
                hooks.set_step(step)
                model.zero_grad()
                out = forward(x)
                out.square().sum().backward()
            results.append((out.detach(), [p.grad for p in model.parameters()], hooks.stats()["h"]))
    return results, sum(counters["graph_break"].values())


@pytest.mark.parametrize("kind", sorted(CASES))
def test_kind_works_under_torch_compile(kind):
    """Hooks attached, then the model compiled (aot_eager: Dynamo and AOTAutograd without a C++
    compiler): outputs, gradients and what the hook measured equal eager's exactly, the hook fires as often, and
    the kinds that trace break no graph."""
    spec, _, calls = CASES[kind]
    ((out_e, grads_e, stats_e), (out_c, grads_c, stats_c)), breaks = _eager_and_compiled(spec, "aot_eager")
    assert torch.equal(out_e, out_c)
    assert all(torch.equal(a, b) for a, b in zip(grads_e, grads_c, strict=True))
    assert stats_e["calls"] == stats_c["calls"] == calls
    assert stats_e == stats_c
    assert (breaks == 0) is (kind in TRACED), breaks


@pytest.mark.slow  # inductor builds C++ kernels: a minute on a CPU; ./scripts/test.sh -m slow
@pytest.mark.parametrize("kind", ["forward_pre", "forward", "output_grad"])
def test_traced_kind_under_inductor_matches_eager_within_float_reordering(kind):
    """The default backend: inductor fuses and reorders float arithmetic, so outputs, gradients and the measured
    effects agree with eager to 1e-5 (relative), not bit for bit; the calls exactly, and no graph breaks."""
    spec = {**CASES[kind][0], "every": 2}  # acts on steps 0 and 2, not 1: the schedule read when the graph runs
    ((out_e, grads_e, stats_e), (out_c, grads_c, stats_c)), breaks = _eager_and_compiled(spec, "inductor", steps=3)
    assert breaks == 0
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert stats_c["calls"] == stats_e["calls"] == 4
    assert stats_c == pytest.approx(stats_e, rel=1e-5)


@pytest.mark.filterwarnings("ignore:hooks.h. transform 'zero' returned a tensor cut from the autograd graph")
@pytest.mark.parametrize(("transform", "traces"), [("identity", True), ("mean_ablate", True), ("zero", False)])
@pytest.mark.parametrize("kind", ["forward_pre", "forward"])
def test_forward_side_transforms_trace_under_compile_unless_they_cut_the_graph(kind, transform, traces):
    """An unchanged result is measured as unchanged, compiled as eager; ``zero`` returns a tensor cut from the
    graph (eager gives the parameters before it no gradient, not a zero one), so it runs eagerly: a graph break."""
    spec = {"target": "block", "kind": kind, "transform": transform}
    ((out_e, grads_e, stats_e), (out_c, grads_c, stats_c)), breaks = _eager_and_compiled(spec, "aot_eager", steps=2)
    assert torch.equal(out_e, out_c) and stats_e == stats_c and stats_c["calls"] == 4
    assert [g is None for g in grads_e] == [g is None for g in grads_c]
    assert all(torch.equal(a, b) for a, b in zip(grads_e, grads_c, strict=True) if a is not None)
    assert (breaks == 0) is traces


@pytest.mark.parametrize(("transform", "args"), [("noise", {"std": 0.1}), ("record", {})])
def test_output_grad_runs_any_transform_under_compile_without_a_graph_break(transform, args):
    """``output_grad``'s transform runs when the gradient comes, in Python inside the graph's backward: transforms
    that read the context (the step, their seeded generator, the records) act as eagerly, bit for bit."""
    spec = {"target": "block", "kind": "output_grad", "transform": transform, "args": args}
    ((out_e, grads_e, stats_e), (out_c, grads_c, stats_c)), breaks = _eager_and_compiled(spec, "aot_eager", steps=2)
    assert breaks == 0 and stats_e == stats_c and stats_c["calls"] == 4 and torch.equal(out_e, out_c)
    assert all(torch.equal(a, b) for a, b in zip(grads_e, grads_c, strict=True))
    assert (stats_c["change_norm"] > 0) is (transform == "noise")


@pytest.mark.parametrize("kind", ["forward_pre", "forward"])
def test_a_traced_transform_outside_its_window_touches_neither_values_nor_gradients(kind):
    """Compiled, the transform is in the graph on every call: where the spec does not act it sees a detached copy,
    so a transform whose backward is infinite there (sqrt at 0) gives no NaN gradient and an in-place one writes
    nothing of the module's (eager: the hook does not run at all)."""
    from hookexp.engine.registry import TRANSFORMS, register_transform

    mine = {"root_of_relu": lambda x, ctx=None: x.relu().sqrt(), "halve_in_place": lambda x, ctx=None: x.mul_(0.5)}
    try:
        for name, fn in mine.items():
            register_transform(name, needs_ctx=False)(fn)
        for transform in mine:
            spec = {"target": "block", "kind": kind, "transform": transform, "start_step": 5}  # not in 2 steps
            ((out_e, grads_e, _), (out_c, grads_c, _)), breaks = _eager_and_compiled(spec, "aot_eager", 2)
            assert breaks == 0 and torch.equal(out_e, out_c), transform
            assert all(torch.equal(a, b) for a, b in zip(grads_e, grads_c, strict=True)), transform
            assert all(torch.isfinite(g).all() for g in grads_c if g is not None), transform
    finally:
        for name in mine:
            TRANSFORMS.pop(name, None)


def test_without_the_operators_forward_kinds_run_eagerly_under_compile(monkeypatch):
    """torch < 2.4 has no ``torch.library.custom_op``: the forward-side hooks then run eagerly under compile (a
    graph break at the target), with the same results."""
    from hookexp.engine import traced

    monkeypatch.setattr(traced, "AVAILABLE", False)
    ((out_e, grads_e, stats_e), (out_c, grads_c, stats_c)), breaks = _eager_and_compiled(CASES["forward"][0],
                                                                                         "aot_eager")
    assert breaks > 0 and torch.equal(out_e, out_c) and stats_e == stats_c
    assert all(torch.equal(a, b) for a, b in zip(grads_e, grads_c, strict=True))
