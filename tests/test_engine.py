"""The hook handle: scoping and removal, failures inside hooks, output checks, schedules, records."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from hookexp import HookCompatibilityError, HookRuntimeError, TransformOutputError, attach
from hookexp.models import SmallCNN


def batch():
    torch.manual_seed(0)
    return torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def test_remove_takes_only_its_own_hooks_also_after_an_exception():
    model = SmallCNN()
    mine = model.conv1.register_forward_hook(lambda m, a, o: None)
    x, y = batch()
    spec = {"rec": {"target": "conv*", "kind": "forward", "transform": "record"},
            "g": {"target": "*.bias", "kind": "grad", "transform": "zero"}}
    with pytest.raises(KeyError), attach(model, spec) as hooks:
        loss_of(model, x, y).backward()
        raise KeyError("user code failed")
    assert hooks.removed
    assert list(model.conv1._forward_hooks) == [mine.id]  # the user's hook survives
    assert all(not m._forward_hooks for name, m in model.named_modules() if name != "conv1")
    assert all(not p._backward_hooks for p in model.parameters())
    model.zero_grad()
    loss_of(model, x, y).backward()
    assert model.fc1.bias.grad.abs().sum() > 0  # the zeroing hook is gone
    hooks.remove()  # idempotent


def test_two_handles_are_independent():
    model = SmallCNN()
    x, y = batch()
    a = attach(model, {"a": {"target": "fc2.bias", "kind": "grad", "transform": "zero"}})
    b = attach(model, {"b": {"target": "fc2.bias", "kind": "grad", "transform": "identity"}})
    a.remove()
    loss_of(model, x, y).backward()
    assert model.fc2.bias.grad.abs().sum() > 0
    assert b.stats()["b"]["calls"] == 1 and a.stats()["a"]["calls"] == 0
    b.remove()


def test_graph_in_flight_after_remove_is_not_transformed():
    model = SmallCNN()
    x, y = batch()
    hooks = attach(model, {"z": {"target": "fc2", "kind": "output_grad", "transform": "zero"}})
    loss = loss_of(model, x, y)  # tensor hook registered on this graph
    hooks.remove()
    loss.backward()
    assert model.fc2.bias.grad.abs().sum() > 0


def test_exception_in_transform_names_spec_target_and_step():
    model = SmallCNN()
    x, y = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = {"bad": {"target": "fc1", "kind": "output_grad", "transform": {"_target_": "user_transforms.explode"},
                    "start_step": 1}}
    with attach(model, spec, opt) as hooks:
        loss_of(model, x, y).backward()  # step 0: outside the window
        opt.step()
        with pytest.raises(HookRuntimeError) as e:
            loss_of(model, x, y).backward()
    assert str(e.value) == ("hooks.bad.transform: transform 'user_transforms.explode' failed on target 'fc1' "
                            "(kind 'output_grad') at step 1: ValueError: boom")
    assert isinstance(e.value.__cause__, ValueError)
    assert hooks.removed


@pytest.mark.parametrize(
    ("fn", "pattern"),
    [
        ("in_place", r"hooks\.t\.transform: transform 'user_transforms\.in_place' modified its input in place "
                     r"on target 'fc1'"),
        ("reshape", r"changed the tensor on target 'fc1' \(kind 'forward'\): expected shape \(4, 64\), "
                    r"torch\.float32, cpu; got shape \(256,\)"),
        ("to_double", r"expected shape \(4, 64\), torch\.float32, cpu; got shape \(4, 64\), torch\.float64"),
    ],
)
def test_transform_output_contract(fn, pattern):
    model = SmallCNN()
    x, _ = batch()
    spec = {"t": {"target": "fc1", "kind": "forward", "transform": {"_target_": f"user_transforms.{fn}"}}}
    with attach(model, spec), \
            pytest.raises(TransformOutputError, match=pattern):
        model(x)


def test_user_transforms_with_and_without_ctx_and_args():
    lin = nn.Linear(2, 2)
    x = torch.ones(1, 2)
    base = lin(x)
    double = {"_target_": "user_transforms.double", "times": 3}
    with attach(lin, {"d": {"target": "", "kind": "forward", "transform": double}}):
        assert torch.equal(lin(x), base * 3)
    with attach(lin, {"n": {"target": "", "kind": "forward", "transform": {"_target_": "user_transforms.no_ctx"},
                            "args": {"offset": 2.0}}}):
        assert torch.equal(lin(x), base + 2.0)


def test_schedule_every_window_and_enabled():
    lin = nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    specs = {"every2": {"target": "", "kind": "forward", "transform": "identity", "every": 2},
             "window": {"target": "", "kind": "forward", "transform": "identity", "start_step": 1, "end_step": 3},
             "off": {"target": "", "kind": "forward", "transform": "zero", "enabled": False}}
    with attach(lin, specs, opt) as hooks:
        for _ in range(6):
            out = lin(torch.ones(1, 2))
            assert out.abs().sum() > 0  # the disabled zeroing spec never acts
            opt.step()
        stats = hooks.stats()
        table = {row["spec"]: row for row in hooks.table()}
    assert stats["every2"]["calls"] == 3  # steps 0, 2, 4
    assert stats["window"]["calls"] == 2  # steps 1, 2
    assert stats["off"]["calls"] == 0 and table["off"]["enabled"] is False and table["off"]["targets"] == [""]


@pytest.mark.parametrize(("phase", "train_calls", "eval_calls"), [("train", 1, 0), ("eval", 0, 1), ("both", 1, 1)])
def test_phase(phase, train_calls, eval_calls):
    lin = nn.Linear(2, 1)
    with attach(lin, {"p": {"target": "", "kind": "forward", "transform": "identity", "phase": phase}}) as hooks:
        lin(torch.ones(1, 2))
        after_train = hooks.stats()["p"]["calls"]
        lin.eval()
        with torch.no_grad():
            lin(torch.ones(1, 2))
        after_eval = hooks.stats()["p"]["calls"] - after_train
    assert (after_train, after_eval) == (train_calls, eval_calls)


def test_index_picks_one_tensor_of_a_tuple_and_none_passes_through():
    class Two(nn.Module):
        def forward(self, a, b):
            return a * b

    m = Two()
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    b = torch.tensor([3.0, 4.0])  # no grad: its grad_input entry is None
    with attach(m, {"z": {"target": "", "kind": "backward", "transform": "zero", "index": 0}}):
        m(a, b).sum().backward()
    assert torch.equal(a.grad, torch.zeros(2))
    a.grad = None
    with attach(m, {"s": {"target": "", "kind": "backward", "transform": "scale", "args": {"factor": 2.0}}}) as h:
        m(a, b).sum().backward()
    assert torch.equal(a.grad, 2 * b) and h.stats()["s"]["calls"] == 1


def test_records_are_detached_and_bounded():
    model = SmallCNN()
    x, _ = batch()
    spec = {"r": {"target": "fc1", "kind": "forward", "transform": "record", "args": {"max_records": 2}}}
    with attach(model, spec) as hooks:
        for _ in range(3):
            out = model(x)
    recs = hooks.records["r"]
    assert len(recs) == 2 and recs[0].target == "fc1" and recs[0].step == 0
    assert not recs[0].value.requires_grad and recs[0].value.grad_fn is None
    assert out.requires_grad


def test_measuring_off_keeps_counting_but_reports_no_effect():
    model = SmallCNN()
    x, _ = batch()
    with attach(model, {"c": {"target": "fc1", "kind": "forward", "transform": "zero"}}, measure=False) as hooks:
        model(x)
        stats = hooks.stats()["c"]
        assert stats["calls"] == 1 and "change_norm" not in stats
        hooks.measuring = True
        model(x)
        stats = hooks.stats()["c"]
    assert stats["frac_changed"] == 1.0 and stats["cosine"] == 0.0 and stats["change_norm"] > 0


def test_handle_does_not_keep_the_model_alive():
    model = SmallCNN()
    ref = weakref.ref(model)
    hooks = attach(model, {"r": {"target": "*", "kind": "grad", "transform": "identity"},
                           "f": {"target": "conv1", "kind": "forward", "transform": "identity"}})
    del model
    gc.collect()
    assert ref() is None
    hooks.remove()


def test_compiled_model_is_refused():
    compiled = torch.compile(SmallCNN())
    with pytest.raises(HookCompatibilityError,
                       match=r"already compiled with torch\.compile.*Attach the hooks to the eager model"):
        attach(compiled, {"f": {"target": "conv1", "kind": "forward"}})
