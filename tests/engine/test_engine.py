"""The hook handle: scoping and removal, failures inside hooks, output checks, schedules, records."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

from hookexp import HookCompatibilityError, HookRuntimeError, HookWarning, TransformOutputError, attach
from hookexp.engine import SpecBinding, output_hooks
from hookexp.errors import ConfigError
from hookexp.workloads.models import SmallCNN


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
    row = b.stats()["b"]
    counts = {k: row[k] for k in ("calls", "calls_last_step", "targets")}
    assert counts == {"calls": 1, "calls_last_step": 0, "targets": 1} and all(type(v) is int for v in counts.values())
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
        ("reshape", r"changed the tensor on target 'fc1' at step 0 \(kind 'forward'\): expected shape \(4, 64\), "
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


@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_a_train_spec_on_a_model_in_eval_mode_says_once_that_it_is_skipped(kind):
    """attach() on a model in eval mode (the usual state for analysis) with the default phase leaves the output
    as the unhooked model's and says so once: one HookWarning names the spec, the phase and the fix; with
    phase: eval the same spec acts, and warns nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    x = torch.randn(3, 4)
    spec = {"zero": {"target": "0", "kind": kind, "transform": "scale", "args": {"factor": 0.0}}}
    with pytest.warns(HookWarning) as caught, attach(model, spec) as hooks:
        out = model(x)
        model(x)
    assert torch.equal(out, model(x)) and hooks.stats()["zero"]["calls"] == 0  # skipped, as before
    assert [str(w.message) for w in caught if isinstance(w.message, HookWarning)] == [
        f"hooks.zero: skipped at target '0': the module is in eval mode and the spec's phase is 'train' (the "
        f"default), so the {kind!r} hook does nothing here. Set phase: eval (evaluation only) or phase: both to act "
        "in eval mode, or call model.train()."]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with attach(model, {"zero": spec["zero"] | {"phase": "eval"}}):
            assert not torch.equal(model(x), out)  # it acts
        model.train()
        with attach(model, spec):  # a train spec that acted first (the trainer's order) is not warned in eval
            model(x)
            model.eval()
            model(x)


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


def test_a_model_dropped_with_its_hooks_attached_takes_their_compile_tokens_along():
    """The operators that traced hooks call under torch.compile find their Python side by a number, in a registry
    that holds it weakly: a model and handle dropped without remove() leave nothing behind in it."""
    from hookexp.engine import traced

    before = set(traced._TOKENS)
    model = SmallCNN()
    hooks = attach(model, {"f": {"target": "conv1", "kind": "forward", "transform": "identity"},
                           "g": {"target": "fc1", "kind": "output_grad", "transform": "identity"}})
    probe = output_hooks(model, "relu1", lambda name, out: None, key="k")
    assert len(set(traced._TOKENS) - before) == 4  # forward: enter and measure; output_grad: grad; output_hooks
    del model, hooks, probe
    gc.collect()
    assert set(traced._TOKENS) - before == set()


def test_compiled_model_is_refused():
    compiled = torch.compile(SmallCNN())
    with pytest.raises(HookCompatibilityError,
                       match=r"already compiled with torch\.compile.*Attach the hooks to the eager model"):
        attach(compiled, {"f": {"target": "conv1", "kind": "forward"}})


# -- the measuring schedule -------------------------------------------------------------------------------


def count_measures(monkeypatch):
    """The step of every tensor measured (one by one, or as a batched group)."""
    calls = []
    measure_many, add_effects = SpecBinding.measure_many, SpecBinding.add_effects

    def one_by_one(self, before, after):
        calls.extend([self.clock.step] * len(before))
        return measure_many(self, before, after)

    def batched(self, row, tensors=0, numel=0):
        calls.extend([self.clock.step] * tensors)
        return add_effects(self, row, tensors, numel)

    monkeypatch.setattr(SpecBinding, "measure_many", one_by_one)
    monkeypatch.setattr(SpecBinding, "add_effects", batched)
    return calls


def train_steps(model, opt, steps, x):
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()


def test_by_default_effects_are_measured_on_step_0_and_after_each_stats_read(monkeypatch):
    measured = count_measures(monkeypatch)
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)), torch.randn(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    spec = {"c": {"target": "0", "kind": "forward", "transform": "clamp", "args": {"min": 0.0}},
            "p": {"target": "*", "kind": "pre_step", "transform": "clamp", "args": {"max": 0.01}}}
    with attach(model, spec, opt) as hooks:
        assert hooks.measuring
        train_steps(model, opt, 1, x)
        assert not hooks.measuring and hooks.step == 1
        train_steps(model, opt, 4, x)
        first = hooks.stats()  # at step 5: step 0's effects; and step 5 will be measured
        assert hooks.measuring
        train_steps(model, opt, 3, x)
        second = hooks.stats()
        third = hooks.stats()  # nothing ran since the last read: calls only
    assert measured == [0] * 5 + [5] * 5  # one forward output and four parameters, on steps 0 and 5
    assert first["c"]["calls"] == 5 and first["p"]["calls"] == 20 and "change_norm" in first["c"]
    assert "change_norm" in second["p"] and "change_norm" not in third["p"]


@pytest.mark.parametrize(("measure", "steps"), [(True, list(range(6))), (False, []), (3, [0, 3]), ("read", [0])])
def test_measure_true_false_or_every_n(monkeypatch, measure, steps):
    measured = count_measures(monkeypatch)
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with attach(model, {"z": {"target": "", "kind": "forward", "transform": "scale", "args": {"factor": 2.0}}}, opt,
                measure=measure) as hooks:
        train_steps(model, opt, 6, x)
        assert measured == steps
        hooks.measuring = True  # overrides the schedule until the step changes
        model(x)
    assert measured[-1] == 6


def test_measured_steps_give_the_numbers_of_always_measuring():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(5, 3)
    spec = {"c": {"target": "1", "kind": "forward", "transform": "clamp", "args": {"min": -0.2, "max": 0.3}}}
    results = []
    for measure in (True, "read", 10):
        with attach(model, spec, measure=measure) as hooks:
            model(x).sum().backward()
            results.append(hooks.stats())
    assert results[0] == results[1] == results[2] and results[0]["c"]["frac_changed"] > 0


def test_unchanged_tensors_are_measured_without_tensor_ops():
    model = nn.Linear(3, 2)
    with attach(model, {"i": {"target": "", "kind": "forward"}}, measure=True) as hooks:
        model(torch.randn(4, 3))
        assert hooks.bindings[0].effects(reset=False)[0] is None  # no device tensor: nothing was computed
        assert hooks.stats()["i"] | {"calls": 0} == {"calls": 0, "calls_last_step": 0.0, "targets": 1.0,
                                                      "change_norm": 0.0, "cosine": 1.0, "frac_changed": 0.0}


def test_a_context_is_built_only_for_transforms_that_read_it():
    model = nn.Linear(3, 2)
    with attach(model, {"c": {"target": "", "kind": "forward", "transform": "clamp", "args": {"min": 0.0}},
                        "r": {"target": "", "kind": "forward", "transform": "record"}}) as hooks:
        model(torch.randn(4, 3))
        ctx = hooks.bindings[1].sites[0].ctx
        model(torch.randn(4, 3))
        assert hooks.bindings[0].sites[0].ctx is None
        assert ctx is not None and hooks.bindings[1].sites[0].ctx is ctx  # one context per target, reused


# -- probes, callables, explain, state ----------------------------------------------------------------------


def test_output_hooks_act_only_while_on_and_stay_out_of_stats_and_tables(monkeypatch):
    """What telemetry's probes use instead of a spec: plain forward hooks, switched on and off by their owner,
    in the spec's phase (train), that a handle on the same model neither counts, measures nor lists."""
    measured = count_measures(monkeypatch)
    seen = []
    model, x = nn.Sequential(nn.Linear(3, 2), nn.ReLU()), torch.randn(4, 3)
    spec = {"c": {"target": "0", "kind": "forward", "transform": "clamp", "args": {"min": 0.0}}}
    with attach(model, spec, measure=False) as hooks:
        probe = output_hooks(model, "0", lambda name, out: seen.append((name, out.shape)), key="stats.activations",
                             on=False)
        model(x)
        assert seen == []
        probe.on = True
        model(x)
        model.eval()
        model(x)  # eval mode: not the train phase
        model.train()
        probe.on = False
        model(x)
        assert seen == [("0", torch.Size([4, 2]))] and probe.names == ["0"]
        assert [r["spec"] for r in hooks.table()] == ["c"] and measured == []
        assert list(hooks.stats()) == ["c"] and hooks.stats()["c"]["calls"] == 3
        probe.on = True
        probe.remove()
        model(x)
        assert len(seen) == 1
    with pytest.raises(ConfigError, match=r"stats\.activations.*blocks"):
        output_hooks(model, "blocks", lambda name, out: None, key="stats.activations")
    with pytest.raises(HookCompatibilityError, match="already compiled"):
        output_hooks(torch.compile(model), "0", lambda name, out: None, key="stats.activations")


def test_output_hooks_switch_under_torch_compile_without_recompiling():
    """Attached before compiling, the hooks are traced into torch.compile's one graph (no graph break): they see
    each call made while on, and switching them costs no new graph."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs, seen = [], []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    model, x = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(5, 3)
    probe = output_hooks(model, "1", lambda name, out: seen.append(out.detach().clone()), key="k")
    compiled = torch.compile(model, backend=backend)
    compiled(x)
    first = len(graphs)
    for on in (False, True, False, True):
        probe.on = on
        out = compiled(x)
    assert len(graphs) == first == 1 and len(seen) == 3
    assert torch.equal(seen[-1], torch.tanh(model[0](x))) and torch.equal(out, model(x))
    probe.remove()


def test_plain_callables_and_transform_objects():
    from hookexp import Transform

    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    base = model(x)
    with attach(model, {"f": {"target": "", "kind": "forward", "transform": lambda t: t * 3}}) as hooks:
        assert torch.equal(model(x), base * 3)
        assert hooks.table()[0]["transform"] == "test_plain_callables_and_transform_objects.<locals>.<lambda>"
    with attach(model, {"f": {"target": "", "kind": "forward", "transform": lambda t, ctx, k: t + k * ctx.step,
                              "args": {"k": 2.0}}}) as hooks:
        hooks.set_step(3)
        assert torch.equal(model(x), base + 6.0)

    batched_calls = []

    def halve(t):
        return t * 0.5

    def halve_(ts, ctx):
        batched_calls.append(len(ts))
        torch._foreach_mul_(ts, 0.5)

    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=1.0), torch.optim.SGD(ref.parameters(), lr=1.0)
    with attach(model, {"h": {"target": "*", "kind": "pre_step", "transform": Transform(halve, batched=halve_)}}, opt):
        train_steps(model, opt, 2, x)
    with attach(ref, {"h": {"target": "*", "kind": "post_accumulate", "transform": halve}}):
        train_steps(ref, ref_opt, 2, x)
    assert batched_calls == [2, 2]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))


def test_explain_knows_only_its_own_errors():
    model = nn.Linear(2, 2)
    with attach(model, {"b": {"target": "", "kind": "backward"}}) as hooks:
        assert hooks.explain(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
        assert hooks.explain(HookRuntimeError("x", spec="b")) is None  # already names its spec


def test_state_dict_is_plain_tensors_and_a_resumed_handle_draws_the_same_noise(tmp_path):
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    spec = {"n": {"target": "", "kind": "forward", "transform": "noise", "args": {"std": 1.0, "seed": 7}}}
    with attach(model, spec) as hooks:
        model(x)
        torch.save(hooks.state_dict(), tmp_path / "h.pt")
        expected = model(x)
    state = torch.load(tmp_path / "h.pt", weights_only=True)
    assert set(state["specs"]["n"]["state"]) == {"generator:cpu", "seed"}
    with attach(model, spec) as again:
        again.load_state_dict(state)
        assert torch.equal(model(x), expected) and again.stats()["n"]["calls"] == 2


def test_unscheduled_acts_outside_the_window():
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    base = model(x)
    with attach(model, {"z": {"target": "", "kind": "forward", "transform": "zero", "start_step": 5}}) as hooks:
        assert torch.equal(model(x), base)
        with hooks.unscheduled():
            assert torch.equal(model(x), torch.zeros_like(base))
        assert torch.equal(model(x), base)


def test_measured_effects_against_a_hand_computation():
    torch.manual_seed(0)
    xs = [torch.randn(5, 3), torch.randn(7), torch.zeros(4)]
    ys = [xs[0].clamp(-0.5, 0.5), -0.1 * xs[1], torch.ones(4)]
    from hookexp.engine.binding import effect_rows

    rows = effect_rows(xs, ys)
    for (change, cos, changed), x, y in zip(rows.tolist(), xs, ys, strict=True):
        assert change == pytest.approx(torch.linalg.vector_norm(y - x).item(), rel=1e-6)
        assert cos == pytest.approx(torch.nn.functional.cosine_similarity(x.reshape(-1), y.reshape(-1), dim=0,
                                                                          eps=1e-12).item(), abs=1e-6)
        assert changed == (x != y).sum().item()
    assert rows[2, 1] == 0.0  # a zero tensor has cosine 0 with anything


def test_the_engine_modules_import_one_another_without_a_circle():
    """Every import between hookexp/engine modules (top level, TYPE_CHECKING and inside functions) forms no
    circle: binding <- kinds <- handle, patterns below targets and aliases."""
    import ast
    from pathlib import Path

    import hookexp.engine

    root = Path(hookexp.engine.__file__).parent
    mods = {p.stem for p in root.glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {}
    for name in mods:
        deps = set()
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "hookexp.engine":
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hookexp.engine."):
                deps.add(node.module.split(".")[2])
        graph[name] = deps - {name}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(d == goal or (d not in seen and reaches(d, goal, seen | {d})) for d in graph[start])

    assert [m for m in sorted(mods) if reaches(m, m, set())] == []
    assert "kinds" not in graph["binding"] and "targets" not in graph["aliases"]
