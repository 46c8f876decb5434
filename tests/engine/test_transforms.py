"""Every transform: its values, and the contract (dtype, device, shape kept; expanded inputs work)."""

from __future__ import annotations

import copy

import pytest
import torch

from hookexp import TransformArgsError, attach
from hookexp.engine import TRANSFORMS, HookContext
from hookexp.engine.bound import bind_transform

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
    assert flagged == ["add", "clamp", "clip_norm", "ema_amplify", "ma_amplify", "noise", "quantize", "replace"]


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


@pytest.mark.parametrize("straight_through", [False, True])
def test_a_quantized_layer_passes_no_gradient_below_it_unless_straight_through(straight_through):
    """quantize on a forward kind, against the same written by hand: rounding's gradient is zero, so fc1 learns
    nothing; straight_through passes the gradient unchanged (q = y + (round(y) - y).detach())."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    hand = copy.deepcopy(model)
    x = torch.randn(16, 4)
    spec = {"q": {"target": "0", "kind": "forward", "transform": "quantize",
                  "args": {"step": 0.25, "straight_through": straight_through}}}
    with attach(model, spec):
        model(x).square().sum().backward()
    y = hand[0](x)
    q = torch.round(y / 0.25) * 0.25
    hand[1](y + (q - y).detach() if straight_through else q).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), hand.parameters(), strict=True))
    assert bool(model[0].weight.grad.any()) is straight_through  # zero below the rounding without it


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


# -- batched pre_step transforms give the per-tensor bits -------------------------------------------------

BATCHED_ARGS = {
    "add": {"value": 0.3}, "scale": {"factor": -1.7}, "clamp": {"min": -0.2, "max": 0.5},
    "clip_norm": {"max_norm": 0.7},
    "ema_amplify": {"alpha": 0.9, "lamb": 2.0}, "ma_amplify": {"window": 3, "lamb": 5.0}, "reverse": {"lambda": 0.3},
}
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


def random_tensors(dtype, n=200):
    """Tensors of many shapes and magnitudes (norms on both sides of clip_norm's bound), some exact zeros."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (4, 5), (2, 3, 4), (17,), (1,)]
    out = []
    for i in range(n):
        x = torch.randn(shapes[i % len(shapes)], generator=g) * 10 ** (torch.rand(1, generator=g).item() * 4 - 3)
        x[torch.rand(x.shape, generator=g) < 0.1] = 0.0
        out.append(x.to(dtype))
    return out


def bits(x):
    return x.view(BITS[x.dtype])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", sorted(n for n, i in TRANSFORMS.items() if i.batched))
def test_batched_transform_equals_the_per_tensor_transform_bit_for_bit(name, dtype):
    args = BATCHED_ARGS.get(name, {})
    one, many = bind_transform(name, args, "s"), bind_transform(name, args, "s")
    names = [f"p{i}" for i in range(200)]
    for step in range(4):  # stateful transforms: several steps (the MA window fills at the third)
        xs = [x * (step + 1) for x in random_tensors(dtype)]
        expected = [one(x, HookContext("s", "pre_step", n, step, state=one.state)) for x, n in zip(xs, names,
                                                                                                   strict=True)]
        got = [x.clone() for x in xs]
        many.batched(got, HookContext("s", "pre_step", "*", step, state=many.state, targets=names),
                     **many.batched_args)
        differ = [i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if not torch.equal(bits(a), bits(b))]
        assert not differ, f"{name} {dtype} step {step}: {len(differ)} of 200 tensors differ, e.g. #{differ[0]}"


def test_clip_norm_is_torchs_clip_grad_norm_formula():
    for x in random_tensors(torch.float32, 50):
        coef = torch.clamp(0.7 / (torch.linalg.vector_norm(x) + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_
        assert torch.equal(run("clip_norm", x, max_norm=0.7), x * coef)


def test_aliases_are_aliases_not_copies():
    assert TRANSFORMS["zero_ablate"].alias_of == "zero" and TRANSFORMS["zero_ablate"].fn is TRANSFORMS["zero"].fn
    assert TRANSFORMS["negate"].alias_of == TRANSFORMS["reverse"].alias_of == "scale"
    assert bind_transform("negate", {}, "s").args == {"factor": -1.0}
    assert bind_transform("reverse", {"lambda": 0.5}, "s").args == {"factor": -0.5}
    assert bind_transform("reverse", {}, "s").args == {"factor": -1.0}
    with pytest.raises(TransformArgsError, match=r"hooks\.s\.args\.factor: transform 'negate' has no argument"):
        bind_transform("negate", {"factor": 2.0}, "s")


def test_registries_take_keywords_and_refuse_duplicates():
    from hookexp import RegistryError, register_kind, register_transform, register_transform_alias

    with pytest.raises(RegistryError, match="transform 'clamp' is already registered"):
        register_transform("clamp")(lambda x, ctx: x)
    with pytest.raises(RegistryError, match="transform 'negate' is already registered"):
        register_transform_alias("negate", of="scale")
    with pytest.raises(RegistryError, match="'nope' is not a registered transform"):
        register_transform_alias("x_test", of="nope")
    with pytest.raises(RegistryError, match="kind 'grad' is already registered"):
        register_kind("grad")(lambda site, handle: [])
    with pytest.raises(RegistryError, match=r"kind 'mine' is not a built-in kind, so it needs on, stage"):
        register_kind("mine")
    with pytest.raises(TypeError):
        register_transform("x_test", None)  # keyword arguments only


# -- Grokfast (Lee et al. 2024) against the paper's update rule, written by hand ------------------------


def grokfast_by_hand(model, steps, x, y, rule, **kw):
    """The paper's loop: after backward, before optimizer.step(), filter every gradient (its update rule)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.01)
    state: dict[str, object] = {}
    trace = []
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for name, p in model.named_parameters():
            g = p.grad
            if rule == "ema":
                avg = state.get(name, g)  # the average starts at the first gradient
                avg = avg * kw["alpha"] + g * (1 - kw["alpha"])
                state[name] = avg
                p.grad = g + avg * kw["lamb"]
            else:
                window = state.setdefault(name, [])
                window.append(g.clone())
                del window[:-kw["window"]]
                if len(window) == kw["window"]:  # the reference waits for a full window
                    total = 0
                    for old in window:  # summed from the oldest, as Python's sum() does
                        total = total + old
                    p.grad = g + (total / len(window)) * kw["lamb"]
        opt.step()
        trace.append([p.detach().clone() for p in model.parameters()])
    return trace


def grokfast_hooked(model, steps, x, y, rule, start=None, stop=None, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.01)
    spec = {"gf": {"target": "*", "kind": "pre_step", "transform": f"{rule}_amplify", "args": kw}}
    hooks = attach(model, spec, opt)
    if start is not None:
        opt.load_state_dict(start["optimizer"])
        hooks.load_state_dict(start["hooks"])
    trace = []
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        trace.append([p.detach().clone() for p in model.parameters()])
    saved = {"optimizer": opt.state_dict(), "hooks": hooks.state_dict(), "model": model.state_dict()}
    hooks.remove()
    return trace, saved


def grokfast_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, torch.randn(12, 5), torch.randint(0, 3, (12,))


@pytest.mark.parametrize(("rule", "kw"), [("ema", {"alpha": 0.98, "lamb": 2.0}),
                                          ("ma", {"window": 3, "lamb": 5.0})])
def test_grokfast_filters_match_the_papers_update_rule_bit_for_bit(rule, kw):
    model, x, y = grokfast_model()
    ref = copy.deepcopy(model)
    hooked, _ = grokfast_hooked(model, 6, x, y, rule, **kw)
    by_hand = grokfast_by_hand(ref, 6, x, y, rule, **kw)
    for step, (a, b) in enumerate(zip(hooked, by_hand, strict=True)):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), f"{rule}: step {step}"
    plain = copy.deepcopy(grokfast_model()[0])
    assert not torch.equal(hooked[-1][0], grokfast_hooked(plain, 6, x, y, rule, lamb=0.0)[0][-1][0])


@pytest.mark.parametrize(("rule", "kw"), [("ema", {"alpha": 0.9, "lamb": 2.0}), ("ma", {"window": 4, "lamb": 5.0})])
def test_grokfast_state_survives_a_checkpoint(rule, kw, tmp_path):
    model, x, y = grokfast_model()
    resumed = copy.deepcopy(model)
    straight, _ = grokfast_hooked(model, 6, x, y, rule, **kw)
    _, saved = grokfast_hooked(resumed, 3, x, y, rule, **kw)
    torch.save(saved, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    key = "ema" if rule == "ema" else "ma"
    assert set(loaded["hooks"]["specs"]["gf"]["state"][key]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    again, _, _ = grokfast_model()
    again.load_state_dict(loaded["model"])
    rest, _ = grokfast_hooked(again, 3, x, y, rule, start=loaded, **kw)
    for step, (a, b) in enumerate(zip(straight[3:], rest, strict=True)):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), f"{rule}: step {3 + step}"


@pytest.mark.parametrize("name", sorted(n for n, i in TRANSFORMS.items() if i.alias_of is None))
def test_a_transforms_defaults_are_written_once_in_its_signature(name):
    """Its check and its batched version re-state no default: bind_transform passes them the function's."""
    import inspect

    info = TRANSFORMS[name]
    for fn in (info.check, info.batched):
        if fn is not None:
            assert [p.name for p in inspect.signature(fn).parameters.values() if p.default is not p.empty] == []


def test_the_check_and_the_batched_version_get_the_signatures_defaults():
    assert bind_transform("ma_amplify", {"lamb": 1.0}, "s").batched_args == {"window": 100, "lamb": 1.0,
                                                                               "warmup": True}
    assert bind_transform("ema_amplify", {}, "s").batched_args == {"alpha": 0.98, "lamb": 2.0}
    assert bind_transform("ema_amplify", {}, "s").args == {}  # the hook table shows the args as written
    with pytest.raises(TransformArgsError, match=r"needs an integer window >= 1, got 0"):
        bind_transform("ma_amplify", {"window": 0}, "s")
