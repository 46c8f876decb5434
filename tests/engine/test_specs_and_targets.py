"""Spec parsing and target resolution: the grammar, and every mistake as a typed error with the fix."""

from __future__ import annotations

import pytest
from torch import nn

from hookexp import SpecError, TargetError, TransformArgsError, attach, parse_specs
from hookexp.engine import HookSpec
from hookexp.engine.targets import resolve
from hookexp.workloads.models import SeedNet, SmallCNN


def names(model, target, kind="forward", **extra):
    spec = parse_specs({"s": {"target": target, "kind": kind, **extra}})[0]
    on = "parameter" if kind in ("grad", "post_accumulate", "pre_step") else "module"
    return [t.name for t in resolve(model, spec, on).targets]


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential() for _ in range(3))
        for b in self.blocks:
            b.add_module("attn", nn.Linear(4, 4))
            b.add_module("mlp", nn.Linear(4, 4))
        self.shared = self.blocks[0].mlp  # the same module under two names
        self.out = nn.Linear(4, 2)
        self.out2 = nn.Linear(2, 4)


def test_exact_glob_regex_root():
    m = SmallCNN()
    assert names(m, "conv1") == ["conv1"]
    assert names(m, "conv?") == ["conv1", "conv2"]
    assert names(m, "relu*") == ["relu1", "relu2", "relu3"]
    assert names(m, "") == [""]
    assert names(m, "*.bias", kind="grad") == ["conv1.bias", "conv2.bias", "fc1.bias", "fc2.bias"]
    assert names(m, r"re:^fc\d\.weight$", kind="grad") == ["fc1.weight", "fc2.weight"]
    assert names(Blocks(), r"re:^blocks\.\d+\.attn$") == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]


def test_types_exclude_and_optional():
    m = SmallCNN()
    assert names(m, "*", types=["Conv2d"]) == ["conv1", "conv2"]
    assert names(m, "*", types=["Linear", "Conv2d"], exclude=["conv1"]) == ["conv2", "fc1", "fc2"]
    assert names(m, "*.weight", kind="grad", types=["Linear"]) == ["fc1.weight", "fc2.weight"]
    assert names(m, "*", types=["_ConvNd"]) == ["conv1", "conv2"]  # a base class
    assert names(m, "attn*", optional=True) == []


def test_user_class_types_and_shared_module_resolve_once():
    b = Blocks()
    assert names(b, "", types=["Blocks"]) == [""]
    spec = parse_specs({"s": {"target": "shared", "kind": "forward"}})[0]
    (target,) = resolve(b, spec, "module").targets
    assert target.name == "blocks.0.mlp" and target.aliases == ("shared",)


def test_tied_parameter_resolves_once_with_alias():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    m[1].weight = m[0].weight
    spec = parse_specs({"s": {"target": "*.weight", "kind": "grad"}})[0]
    (t,) = resolve(m, spec, "parameter").targets
    assert t.name == "0.weight" and t.aliases == ("1.weight",)


def test_target_typo_names_spec_key_and_close_names():
    with pytest.raises(TargetError) as e:
        attach(SmallCNN(), {"clamp": {"target": "convv1", "kind": "output_grad", "transform": "clamp",
                                      "args": {"min": 0}}})
    msg = str(e.value)
    assert msg.startswith("hooks.clamp.target: target 'convv1' matches no module of SmallCNN")
    assert "Did you mean 'conv1'" in msg and "optional: true" in msg
    assert e.value.spec == "clamp" and e.value.key == "hooks.clamp.target"


def test_module_kind_on_parameter_name_and_back():
    with pytest.raises(TargetError, match=r"'fc1\.bias' names parameters .* Use a parameter kind"):
        attach(SeedNet(), {"s": {"target": "fc1.bias", "kind": "forward"}})
    with pytest.raises(TargetError, match=r"'fc1' names modules .* e\.g\. 'fc1\.\*' or 'fc1\.weight'"):
        attach(SeedNet(), {"s": {"target": "fc1", "kind": "grad", "transform": "zero"}})


def test_unknown_type_lists_classes():
    """The classes a user would write: the models' and torch's public ones (a base class counts: Module), not
    `object` nor private bases such as _ConvNd."""
    with pytest.raises(TargetError) as e:
        attach(SmallCNN(), {"s": {"target": "*", "kind": "forward", "types": ["Conv3d"]}})
    assert str(e.value) == ("hooks.s.types: type 'Conv3d' is not the class of any module in SmallCNN. Did you mean "
                            "'Conv2d'? Classes present: Conv2d, Flatten, Linear, MaxPool2d, Module, ReLU, Sequential, "
                            "SmallCNN.")


@pytest.mark.parametrize(
    ("raw", "error", "pattern"),
    [
        ({"target": "conv1", "kind": "bakward"}, SpecError,
         r"hooks\.s\.kind: unknown kind 'bakward'\. Did you mean 'backward'"),
        ({"target": "conv1", "kind": "forward", "transform": "clampp"}, SpecError,
         r"hooks\.s\.transform: unknown transform 'clampp'\. Did you mean 'clamp'"),
        ({"target": "conv1", "kind": "forward", "trasform": "clamp"}, SpecError,
         r"hooks\.s\.trasform: unknown field 'trasform'\. Did you mean 'transform'"),
        ({"kind": "forward"}, SpecError, r"hooks\.s\.target: missing required field 'target'"),
        ({"target": "conv1", "kind": "forward", "every": 0}, SpecError, r"hooks\.s\.every: must be at least 1"),
        ({"target": "conv1", "kind": "forward", "every": True}, SpecError, r"hooks\.s\.every: expected a positive"),
        ({"target": "conv1", "kind": "forward", "phase": "training"}, SpecError,
         r"hooks\.s\.phase: unknown phase 'training'\. Did you mean 'train'"),
        ({"target": "conv1", "kind": "forward", "start_step": 5, "end_step": 5}, SpecError,
         r"hooks\.s\.end_step: end_step \(5\) must be greater than start_step"),
        ({"target": "re:conv(", "kind": "forward"}, SpecError, r"hooks\.s\.target: invalid regular expression"),
        ({"target": "conv1", "kind": "forward", "transform": {"fn": "x"}}, SpecError,
         r"hooks\.s\.transform: a user transform must be a mapping with '_target_'"),
        ({"target": "conv1", "kind": "forward", "transform": {"_target_": "no_such_pkg.fn"}}, SpecError,
         r"hooks\.s\.transform: cannot import the user transform 'no_such_pkg\.fn': no module named 'no_such_pkg'\. "),
        ({"target": "conv1", "kind": "forward", "transform": {"_target_": "torch.nn.functional.reluu"}}, SpecError,
         r"hooks\.s\.transform: cannot import the user transform 'torch\.nn\.functional\.reluu': module "
         r"'torch\.nn\.functional' has no attribute 'reluu'\. Did you mean 'relu'"),
        ({"target": "conv1", "kind": "forward", "transform": "clamp"}, TransformArgsError,
         r"hooks\.s\.args: transform 'clamp' needs at least one of 'min' and 'max'"),
        ({"target": "conv1", "kind": "forward", "transform": "clamp", "args": {"mn": 0}}, TransformArgsError,
         r"hooks\.s\.args\.mn: transform 'clamp' has no argument 'mn'\. Did you mean 'min'\?.*Its arguments: min, max"),
        ({"target": "conv1", "kind": "forward", "transform": "scale"}, TransformArgsError,
         r"hooks\.s\.args: transform 'scale' needs the argument\(s\) factor"),
        ({"target": "conv1", "kind": "forward", "transform": "noise", "args": {"std": -1}}, TransformArgsError,
         r"hooks\.s\.args: transform 'noise' needs std >= 0, got -1\."),
        ({"target": "conv1", "kind": "forward", "transform": "clamp", "args": {"min": 1, "max": 0}},
         TransformArgsError, r"has min \(1\) greater than max \(0\)"),
        ({"target": "conv1", "kind": "forward", "transform": "mask", "args": {}}, TransformArgsError,
         r"needs exactly one of 'p'"),
        ({"target": "conv1", "kind": "forward", "transform": "quantize", "args": {"step": 0}},
         TransformArgsError, r"needs step > 0"),
        # a flag given as text is not taken as true; None where the signature takes no None; an int-only argument
        ({"target": "conv1", "kind": "forward", "transform": "quantize",
          "args": {"step": 0.1, "straight_through": "no"}}, TransformArgsError,
         r"hooks\.s\.args\.straight_through: transform 'quantize' takes true or false for 'straight_through', "
         r"got 'no'\.$"),
        ({"target": "conv1", "kind": "forward", "transform": "scale", "args": {"factor": None}}, TransformArgsError,
         r"hooks\.s\.args\.factor: transform 'scale' takes a number for 'factor', got None\.$"),
        ({"target": "conv1", "kind": "forward", "transform": "record", "args": {"max_records": 2.5}},
         TransformArgsError, r"hooks\.s\.args\.max_records: transform 'record' takes a whole number for "
                             r"'max_records', got 2\.5\.$"),
        # an alias's arguments are named as the user spells them (reverse's lambda, not the Python name lambd)
        ({"target": "conv1", "kind": "output_grad", "transform": "reverse", "args": {"lambda": None}},
         TransformArgsError, r"hooks\.s\.args\.lambda: transform 'reverse' takes a number for 'lambda', got None\.$"),
        ({"target": "conv1", "kind": "output_grad", "transform": "reverse", "args": {"lamda": 1}}, TransformArgsError,
         r"hooks\.s\.args\.lamda: transform 'reverse' has no argument 'lamda'\. Did you mean 'lambda'\? Its "
         r"arguments: lambda\.$"),
    ],
)
def test_bad_specs_fail_before_attaching(raw, error, pattern):
    model = SmallCNN()
    with pytest.raises(error, match=pattern):
        attach(model, {"s": raw})
    assert all(not m._forward_hooks for m in model.modules())


def test_list_specs_get_default_names_and_reject_duplicates():
    specs = parse_specs([{"target": "conv1", "kind": "forward"}, {"name": "b", "target": "fc1", "kind": "forward"}])
    assert [s.name for s in specs] == ["forward:conv1", "b"]
    with pytest.raises(SpecError, match="two specs have the name 'forward:conv1'"):
        parse_specs([{"target": "conv1", "kind": "forward"}, {"target": "conv1", "kind": "forward"}])
    with pytest.raises(SpecError, match="got a single spec where a mapping of named specs"):
        parse_specs({"target": "conv1", "kind": "forward"})
    assert parse_specs(HookSpec(name="x", target="conv1", kind="forward"))[0].name == "x"


def test_a_user_transforms_hints_are_checked_and_a_none_default_allows_none():
    """``scale: float = None`` (a hint without Optional) takes None, as its default says; ``on: bool`` takes no
    text. Both checked when the spec is bound, before any hook is attached."""
    def user(x, ctx, scale: float = None, on: bool = True):  # noqa: RUF013 - the loose hint users write
        return x * (scale or 1.0)

    model = SmallCNN()
    with attach(model, {"s": {"target": "fc1", "kind": "forward", "transform": user, "args": {"scale": None}}}):
        pass
    with pytest.raises(TransformArgsError, match=r"^hooks\.s\.args\.on: transform '.*user' takes true or false "
                                                 r"for 'on', got 'false'\.$"):
        attach(model, {"s": {"target": "fc1", "kind": "forward", "transform": user, "args": {"on": "false"}}})
    assert all(not m._forward_hooks for m in model.modules())
