"""What a hook sees: keyword inputs (`input:`), structured values kept as they are (`index:` by position or key),
and slices (`select:`), each against the same hook written by hand with plain torch, bit for bit."""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict

import pytest
import torch
from engine_models import GPT, DataOut, KwModel, Output, Pair
from torch import nn

from hookexp import HookWarning, SpecError, attach, check_on_batch


def run(model, x):
    """Forward and backward; returns the output and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    logits = out["logits"] if isinstance(out, dict) else out
    logits.square().sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def same_as_hand(model, x, specs, install, optimizer=None):
    """Outputs and grads with the specs attached equal those with ``install(ref)``'s hand-written hooks; the hooks
    changed something (else the comparison proves nothing). Returns the handle's stats."""
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    with attach(model, specs, optimizer) as hooks:
        out, grads = run(model, x)
        stats = hooks.stats()
    handles = install(ref)
    ref_out, ref_grads = run(ref, x)
    for h in handles:
        h.remove()
    plain_out, plain_grads = run(plain, x)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    changed = not torch.equal(out, plain_out) or any(not torch.equal(a, b) for a, b in zip(grads, plain_grads,
                                                                                          strict=True))
    assert changed, "the hook had no effect, so the comparison proves nothing"
    return stats


@pytest.fixture
def kw():
    torch.manual_seed(0)
    return KwModel(), torch.randn(2, 5, 6)


# -- keyword inputs ---------------------------------------------------------------------------------------


def test_forward_pre_input_by_name_on_a_keyword_call(kw):
    model, x = kw
    spec = {"h": {"target": "inner", "kind": "forward_pre", "input": "hidden_states", "transform": "scale",
                  "args": {"factor": 0.5}}}

    def install(ref):
        def hook(mod, args, kwargs):
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 0.5}

        return [ref.inner.register_forward_pre_hook(hook, with_kwargs=True)]

    assert same_as_hand(model, x, spec, install)["h"]["calls"] == 1


def test_forward_pre_without_input_sees_positional_and_keyword_tensors(kw):
    model, x = kw
    spec = {"h": {"target": "inner", "kind": "forward_pre", "transform": "scale", "args": {"factor": 0.5}}}

    def install(ref):
        def hook(mod, args, kwargs):  # every tensor input; the float `scale` is not a tensor
            return args, {k: v * 0.5 if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

        return [ref.inner.register_forward_pre_hook(hook, with_kwargs=True)]

    same_as_hand(model, x, spec, install)


def test_input_by_name_on_a_positional_call():
    torch.manual_seed(0)
    model, ids = GPT(), torch.randint(0, 17, (2, 8))
    spec = {"a": {"target": "blocks.1.attn", "kind": "forward_pre", "input": "x", "transform": "scale",
                  "args": {"factor": 0.5}}}

    def install(ref):
        return [ref.blocks[1].attn.register_forward_pre_hook(lambda m, a: (a[0] * 0.5, *a[1:]))]

    same_as_hand(model, ids, spec, install)


def test_forward_input_is_the_aux_of_a_record():
    model, x = KwModel(), torch.randn(2, 5, 6)
    spec = {"r": {"target": "inner", "kind": "forward", "input": "gate", "index": "pooled", "transform": "record",
                  "args": {"aux": True}}}
    with attach(model, spec) as hooks:
        model(x)
    (rec,) = hooks.records["r"]
    assert torch.equal(rec.aux, torch.sigmoid(x))
    assert torch.equal(rec.value, model.inner(hidden_states=x, scale=2.0, gate=torch.sigmoid(x)).pooled)


def test_unknown_input_name_lists_the_parameters():
    with pytest.raises(SpecError) as e:
        attach(KwModel(), {"h": {"target": "inner", "kind": "forward_pre", "input": "hidden_state"}})
    assert str(e.value) == ("hooks.h.input: target 'inner': Inner.forward() has no parameter 'hidden_state'. Did you "
                            "mean 'hidden_states'? Its parameters: hidden_states, scale, gate.")


def test_a_spec_that_sees_no_tensor_is_a_dry_run_error_and_a_one_time_warning():
    class NoGate(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = KwModel().inner

        def forward(self, x):
            return self.inner(hidden_states=x).last_hidden_state  # `gate` is never passed

    model, x = NoGate(), torch.randn(2, 5, 6)
    spec = {"g": {"target": "inner", "kind": "forward_pre", "input": "gate", "transform": "zero"}}
    report = check_on_batch(model, spec, x)
    assert report.errors == ["hooks.g: the transform saw no tensor at 'inner' (input 'gate' was not passed), so the "
                             "hook would do nothing there; check the forward() parameter name and that the caller "
                             "passes it."]
    with warnings.catch_warnings(record=True) as seen, attach(model, spec):
        warnings.simplefilter("always")
        model(x)
        model(x)
    (warned,) = [str(w.message) for w in seen if issubclass(w.category, HookWarning)]  # once per target
    assert warned.startswith("hooks.g: the transform saw no tensor at target 'inner' (kind 'forward_pre': input "
                             "'gate' was not passed), so the hook does nothing there.")


# -- structured values, kept as they are ------------------------------------------------------------------


def test_model_output_like_values_keep_their_type_and_attributes(kw):
    model, x = kw
    spec = {"f": {"target": "inner", "kind": "forward", "transform": "scale", "args": {"factor": 0.5}}}

    def install(ref):
        def hook(mod, args, out):
            return Output(last_hidden_state=out.last_hidden_state * 0.5, pooled=out.pooled * 0.5)

        return [ref.inner.register_forward_hook(hook)]

    same_as_hand(model, x, spec, install)
    with attach(model, spec):
        out = model.inner(hidden_states=x)
    assert type(out) is Output and list(out) == ["last_hidden_state", "pooled"]


@pytest.mark.parametrize("index", ["last_hidden_state", 0])
def test_index_by_key_or_position_of_a_mapping(kw, index):
    model, x = kw
    spec = {"f": {"target": "inner", "kind": "forward", "index": index, "transform": "scale", "args": {"factor": 0.5}}}

    def install(ref):
        def hook(mod, args, out):
            return Output(last_hidden_state=out.last_hidden_state * 0.5, pooled=out.pooled)

        return [ref.inner.register_forward_hook(hook)]

    same_as_hand(model, x, spec, install)


def test_output_grad_by_key(kw):
    model, x = kw
    spec = {"g": {"target": "inner", "kind": "output_grad", "index": "last_hidden_state", "transform": "clamp",
                  "args": {"min": -0.01, "max": 0.01}}}

    def install(ref):
        def hook(mod, args, out):
            out.last_hidden_state.register_hook(lambda g: g.clamp(-0.01, 0.01))

        return [ref.inner.register_forward_hook(hook)]

    assert same_as_hand(model, x, spec, install)["g"]["calls"] == 1


@pytest.mark.parametrize(("make", "index", "check"), [
    (lambda h, g: DataOut(hidden=h, extra=g), "extra", lambda o: isinstance(o, DataOut)),
    (lambda h, g: Pair(h, g), "gate", lambda o: type(o) is Pair and o._fields == ("hidden", "gate")),
    (lambda h, g: Pair(h, g), 1, lambda o: type(o) is Pair),
    (lambda h, g: OrderedDict(hidden=h, gate=g), "gate", lambda o: type(o) is OrderedDict),
    (lambda h, g: [h, g], 1, lambda o: type(o) is list),
])
def test_dataclasses_namedtuples_and_lists_come_back_as_themselves(make, index, check):
    class Emit(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return make(h, torch.tanh(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emit = Emit()

        def forward(self, x):
            out = self.emit(x)
            second = out.extra if isinstance(out, DataOut) else (out["gate"] if isinstance(out, dict) else out[1])
            first = out.hidden if isinstance(out, DataOut) else (out["hidden"] if isinstance(out, dict) else out[0])
            return first + 3 * second

    torch.manual_seed(0)
    model, x = Model(), torch.randn(3, 4)
    spec = {"s": {"target": "emit", "kind": "forward", "index": index, "transform": "scale", "args": {"factor": 0.5}}}

    def install(ref):
        def hook(mod, args, out):
            h = out.hidden if isinstance(out, DataOut) else (out["hidden"] if isinstance(out, dict) else out[0])
            return make(h, torch.tanh(h) * 0.5)

        return [ref.emit.register_forward_hook(hook)]

    same_as_hand(model, x, spec, install)
    with attach(model, spec):
        assert check(model.emit(x))


def test_index_errors_name_the_spec_and_what_the_value_holds(kw):
    model, x = kw
    with attach(model, {"f": {"target": "inner", "kind": "forward", "index": "hidden"}}), \
            pytest.raises(SpecError, match=r"hooks\.f\.index: the Output has no element 'hidden'\. Did you mean "
                                           r"'last_hidden_state'.*\(target 'inner', kind 'forward'\)"):
        model(x)


# -- select -----------------------------------------------------------------------------------------------


def test_select_neurons_matches_hand_written_slicing():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(3, 4)
    spec = {"n": {"target": "0", "kind": "forward", "select": {"dim": -1, "index": [1, 3, 6]}, "transform": "zero"}}

    def install(ref):
        def hook(mod, args, out):
            out = out.clone()
            out[:, [1, 3, 6]] = 0.0
            return out

        return [ref[0].register_forward_hook(hook)]

    with attach(model, spec) as hooks:
        model(x).sum().backward()
        stats = hooks.stats()["n"]
    assert stats["frac_changed"] == 1.0  # measured on the slice the transform saw
    same_as_hand(model, x, spec, install)


def test_select_heads_on_the_input_of_the_attention_projection():
    torch.manual_seed(0)
    model, ids = GPT(), torch.randint(0, 17, (2, 8))
    spec = {"heads": {"target": "blocks.0.attn.proj", "kind": "forward_pre", "transform": "scale",
                      "args": {"factor": 0.25}, "select": {"heads": [0, 2], "num_heads": 4}}}

    def install(ref):
        def hook(mod, args):
            x = args[0].clone()
            b, t, c = x.shape
            heads = x.view(b, t, 4, c // 4)
            heads[:, :, [0, 2]] = heads[:, :, [0, 2]] * 0.25
            return (x,)

        return [ref.blocks[0].attn.proj.register_forward_pre_hook(hook)]

    same_as_hand(model, ids, spec, install)


def test_select_heads_on_an_attention_output():
    """The attention module's output (after its projection) split into heads: ablate heads 1 and 3 of it."""
    torch.manual_seed(0)
    model, ids = GPT(), torch.randint(0, 17, (2, 8))
    spec = {"heads": {"target": "blocks.1.attn", "kind": "forward", "transform": "zero",
                      "select": {"heads": [1, 3], "num_heads": 4}}}

    def install(ref):
        def hook(mod, args, out):
            y = out.clone()
            b, t, c = y.shape
            y.view(b, t, 4, c // 4)[:, :, [1, 3]] = 0.0
            return y

        return [ref.blocks[1].attn.register_forward_hook(hook)]

    with warnings.catch_warnings():  # zeroing a slice cuts nothing: the other heads keep their gradients
        warnings.simplefilter("error", HookWarning)
        same_as_hand(model, ids, spec, install)


def test_select_rows_of_a_gradient_before_the_step():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)), torch.randn(3, 4)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    spec = {"rows": {"target": "0.weight", "kind": "pre_step", "transform": "clamp", "args": {"max": 0.0},
                     "select": {"dim": 0, "index": [0, 2]}}}

    def by_hand(optimizer, args, kwargs):
        g = ref[0].weight.grad
        g[[0, 2]] = g[[0, 2]].clamp(max=0.0)

    ref_opt.register_step_pre_hook(by_hand)
    with attach(model, spec, opt):
        for m, o in ((model, opt), (ref, ref_opt)):
            for _ in range(2):
                o.zero_grad()
                m(x).square().sum().backward()
                o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))


def test_select_that_does_not_fit_the_tensor_names_the_spec():
    model, ids = GPT(), torch.randint(0, 17, (2, 8))
    with attach(model, {"h": {"target": "blocks.0.attn.proj", "kind": "forward_pre", "transform": "zero",
                              "select": {"heads": [0], "num_heads": 5}}}), \
            pytest.raises(SpecError, match=r"hooks\.h\.select: select heads needs the last dimension to split into "
                                           r"num_heads=5 equal parts; the tensor has shape \(2, 8, 32\)"):
        model(ids)
    with attach(model, {"n": {"target": "head", "kind": "forward", "transform": "zero",
                              "select": {"dim": 1, "index": [9]}}}), \
            pytest.raises(SpecError, match=r"hooks\.n\.select: select index \[9\] is out of range for dim 1 of size 8"):
        model(ids)
