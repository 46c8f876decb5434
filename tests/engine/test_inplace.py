"""In-place safety on a ResNet-style model (torchvision's BasicBlock by hand): bn1 -> in-place ReLU and
``out += identity``. Every backward-side spec on these modules is refused before attaching, or explained by
name at the first forward, in the library path as in the dry run; never a raw torch error."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_models import ResNetish

from hookexp import HookCompatibilityError, HookexpError, HookRuntimeError, TransformOutputError, attach, check_on_batch

BACKWARD_SIDE = ["backward", "backward_pre", "backward_legacy", "output_grad", "node", "node_pre"]
TARGETS = ["layer1.0.bn1", "layer1.0.bn2", "layer1.0.relu", "layer1.0", "layer1.0.conv1"]


def batch():
    torch.manual_seed(0)
    return torch.randn(2, 1, 6, 6)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", BACKWARD_SIDE)
def test_every_backward_side_spec_is_refused_explained_or_works(kind, target):
    torch.manual_seed(0)
    model, x = ResNetish(), batch()
    spec = {"s": {"target": target, "kind": kind, "transform": "scale", "args": {"factor": 0.5}}}
    try:
        hooks = attach(model, spec)
    except HookCompatibilityError as e:  # refused before anything is attached, naming spec, target and kind
        assert str(e).startswith(f"hooks.s.kind: kind {kind!r} cannot be used on {target!r}:")
        assert "Use kind 'output_grad'" in str(e)
        assert target == "layer1.0.relu" and kind in ("backward", "backward_pre")
        return
    try:
        model(x).sum().backward()
    except HookexpError:
        raise
    except RuntimeError as e:  # at the first forward: torch's error, named by spec, target and kind to use
        assert kind in ("backward", "backward_pre") and target in ("layer1.0.bn1", "layer1.0.bn2")
        assert str(e).startswith(f"hooks.s.kind: an in-place op modified the output of {target!r} (kind {kind!r}) "
                                 "after its forward (the last full-backward-hooked module to run before the error)")
        assert "Use kind 'output_grad' (or 'node') for this target" in str(e)
        assert "(torch: Output 0 of BackwardHookFunction is a view and is being modified inplace" in str(e)
        explained = hooks.explain(e)
        assert isinstance(explained, HookCompatibilityError) and explained.spec == "s"
        report = check_on_batch(model, spec, x)  # the dry run names it too
        assert report.errors == [str(explained)]
        return
    finally:
        hooks.remove()
    assert hooks.stats()["s"]["calls"] >= 1  # it works: the hook fired


def test_output_grad_on_the_bn_before_the_inplace_relu_matches_a_hand_written_tensor_hook():
    torch.manual_seed(0)
    model, x = ResNetish(), batch()
    ref = copy.deepcopy(model)
    spec = {"g": {"target": "layer1.0.bn1", "kind": "output_grad", "transform": "clamp", "args": {"min": -1e-3,
                                                                                               "max": 1e-3}}}
    with attach(model, spec):
        model(x).sum().backward()
    def by_hand(module, args, out):
        out.register_hook(lambda g: g.clamp(-1e-3, 1e-3))

    ref.layer1[0].bn1.register_forward_hook(by_hand)
    ref(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True))


def test_the_second_block_names_its_own_module():
    model, x = ResNetish(), batch()
    spec = {"a": {"target": "layer1.0.conv1", "kind": "backward", "transform": "identity"},
            "b": {"target": "layer1.1.bn2", "kind": "backward", "transform": "identity"}}
    with attach(model, spec) as hooks, pytest.raises(RuntimeError) as e:
        model(x)
    explained = hooks.explain(e.value)
    assert explained.spec == "b" and "'layer1.1.bn2' (kind 'backward')" in str(explained)
    assert "modules with full backward hooks that ran before it: 'layer1.0.conv1' (a)" in str(explained)


def test_torch_errors_inside_hooks_name_the_spec():
    model, x = ResNetish(), batch()
    bad = {"_target_": "user_transforms.torch_error"}
    name = r"^hooks\.t\.transform: transform 'user_transforms\.torch_error' failed on "
    for kind, target in (("forward", "stem"), ("output_grad", "fc"), ("node", "fc"), ("grad", "fc.bias"),
                         ("post_accumulate", "fc.bias")):
        with attach(model, {"t": {"target": target, "kind": kind, "transform": bad}}), \
                pytest.raises(HookRuntimeError, match=name + rf"target '{target}' \(kind '{kind}'\) at step 0: "
                                                      r"RuntimeError: .*size"):
            model(x).sum().backward()


def test_an_input_modified_in_place_after_the_module_is_explained():
    class Reuse(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

        def forward(self, x):
            h = x * 2.0
            y = self.a(h)
            h.mul_(2)  # the input of `a`, modified after `a` ran: torch raises in backward
            return self.b(y) + h.sum()

    model = Reuse()
    with attach(model, {"bw": {"target": "a", "kind": "backward"}}) as hooks, pytest.raises(RuntimeError) as e:
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert str(hooks.explain(e.value)).startswith("hooks.bw.kind: an in-place op modified an input of 'a' (kind "
                                                  "'backward') after its forward")
    report = check_on_batch(model, {"bw": {"target": "a", "kind": "backward"}}, torch.randn(2, 3, requires_grad=True))
    assert report.errors[0].startswith("hooks.bw.kind: an in-place op modified an input of 'a'")


class BnThenInplaceRelu(torch.nn.Module):
    """torchvision's BasicBlock start (``layer1.0.bn1`` -> ``ReLU(inplace=True)``) outside any Sequential, so that
    no check before attaching sees the in-place op: the first forward meets it."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.ReLU(inplace=True)
        self.fc = torch.nn.Linear(2, 3)

    def forward(self, x):
        return self.fc(self.relu(self.bn1(self.conv1(x))).mean(dim=(2, 3)))


@pytest.mark.filterwarnings("ignore::hookexp.HookWarning")
def test_errors_the_engine_explains_leave_the_with_block_as_hookexp_errors():
    """Inside ``with attach(...)`` torch's in-place error around a full backward hook leaves the block as the
    HookCompatibilityError that explains it (``except HookexpError`` catches it), torch's error its cause; the
    same for a transform that cut the graph."""
    model = BnThenInplaceRelu()
    spec = {"bw": {"target": "bn1", "kind": "backward", "transform": "scale", "args": {"factor": 0.5}}}
    with pytest.raises(HookexpError) as e, attach(model, spec) as hooks:
        model(batch()).sum().backward()
    assert type(e.value) is HookCompatibilityError and e.value.spec == "bw" and e.value.field == "kind"
    assert str(e.value).startswith("hooks.bw.kind: an in-place op modified the output of 'bn1' (kind 'backward') "
                                   "after its forward")
    assert "Use kind 'output_grad' (or 'node') for this target" in str(e.value)
    assert type(e.value.__cause__) is RuntimeError and "BackwardHookFunction" in str(e.value.__cause__)
    assert hooks.removed and not model.bn1._backward_hooks and not model._forward_hooks  # and nothing is left

    cut = {"cut": {"target": "", "kind": "forward", "transform": lambda t: t.detach()}}
    with pytest.raises(HookexpError) as e, attach(model, cut):
        model(batch()).sum().backward()
    assert type(e.value) is TransformOutputError and e.value.spec == "cut"
    assert "the transform cut the output from the autograd graph at ''" in str(e.value)
