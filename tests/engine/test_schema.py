"""One schema: spec fields and defaults written once (no torch), every static error reported together."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from conftest import TESTS
from engine_models import GPT
from torch import nn

from hookexp import SpecError, SpecErrors, TargetError, TransformArgsError, attach, parse_specs
from hookexp.config import HookSpecConfig
from hookexp.engine import KINDS, HookSpec
from hookexp.engine.schema import KIND_DOCS, config_fields
from hookexp.workloads.models import SmallCNN


def test_the_hydra_schema_is_derived_from_hookspec():
    spec_fields = {f.name: f for f in dataclasses.fields(HookSpec) if f.name != "name"}
    config = {f.name: f for f in dataclasses.fields(HookSpecConfig)}
    assert list(config) == list(spec_fields)
    made = HookSpecConfig(target="x", kind="forward")
    defaults = HookSpec(name="n", target="x", kind="forward")
    for name in config:
        got, want = getattr(made, name), getattr(defaults, name)
        assert got == (list(want) if isinstance(want, tuple) else want), name
    assert [n for n, _, _ in config_fields(None)] == list(spec_fields)


def test_schema_and_config_import_no_torch_and_the_help_lists_the_kinds():
    code = ("import sys, hookexp, hookexp.config, hookexp.engine, hookexp.engine.schema; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    done = subprocess.run([sys.executable, "-m", "hookexp", "--help"], capture_output=True, text=True, timeout=120,
                          cwd=TESTS)
    assert done.returncode == 0, done.stderr
    assert f"Hook kinds: {' '.join(KIND_DOCS)}" in done.stdout
    assert "Target aliases (per architecture): @blocks @attn @mlp @embed @unembed @norm" in done.stdout


def test_every_documented_kind_is_implemented():
    assert list(KINDS) == list(KIND_DOCS)
    for name, info in KINDS.items():
        assert (info.on, info.stage, info.torch_api, info.sees) == (KIND_DOCS[name].on, KIND_DOCS[name].stage,
                                                                    KIND_DOCS[name].torch_api, KIND_DOCS[name].sees)


def test_every_static_error_of_a_spec_set_is_reported_together():
    model = SmallCNN()
    specs = {
        "a": {"target": "convv1", "kind": "output_grad"},                        # target typo
        "b": {"target": "conv1", "kind": "bakward", "every": 0, "phase": "x"},   # three field errors
        "c": {"target": "fc1", "kind": "forward", "transform": "clamp", "args": {"mn": 0}},  # bad argument
        "d": {"target": "fc1", "kind": "forward", "select": {"heads": [4], "num_heads": 4}},
        "ok": {"target": "fc1", "kind": "forward"},
    }
    with pytest.raises(SpecErrors) as e:
        attach(model, specs)
    errors = e.value.errors
    assert [(type(x), x.key) for x in errors] == [  # in the order the specs were written
        (TargetError, "hooks.a.target"), (SpecError, "hooks.b.kind"), (SpecError, "hooks.b.every"),
        (SpecError, "hooks.b.phase"), (TransformArgsError, "hooks.c.args.mn"), (SpecError, "hooks.d.select")]
    msg = str(e.value)
    assert msg.startswith("6 problems in the hook specs (nothing was attached):\n  - hooks.a.target: target 'convv1' "
                          "matches no module of SmallCNN")
    assert "\n  - hooks.b.kind: unknown kind 'bakward'. Did you mean 'backward'" in msg
    assert "  - hooks.d.select: heads [4] are out of range for num_heads=4 (valid: 0..3)." in msg
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(SpecError, match=r"^hooks\.b\.kind: unknown kind"):  # one error: raised as itself
        attach(model, {"b": specs["b"] | {"every": 1, "phase": "train"}})


@pytest.mark.parametrize(("raw", "pattern"), [
    ({"target": "fc1.bias", "kind": "grad", "index": 0}, r"hooks\.s\.index: kind 'grad' sees one gradient tensor"),
    ({"target": "fc1", "kind": "backward", "index": "x"}, r"hooks\.s\.index: kind 'backward' sees a tuple of "
                                                          r"gradients, picked by position"),
    ({"target": "fc1", "kind": "forward_pre", "index": "x"}, r"hooks\.s\.index: to pick a forward input by name use "
                                                             r"input: x"),
    ({"target": "fc1", "kind": "output_grad", "input": "x"}, r"hooks\.s\.input: 'input' picks a module input by name"),
    ({"target": "fc1", "kind": "forward", "index": 1.5}, r"hooks\.s\.index: expected a position \(integer\) or a key"),
    ({"target": "fc1", "kind": "forward", "select": {"dim": -1}}, r"hooks\.s\.select: has keys \['dim'\]; expected "
                                                                  r"exactly \{dim, index\} or \{heads, num_heads\}"),
    ({"target": "fc1", "kind": "forward", "select": {"dim": 0, "idx": [1]}}, r"Did you mean 'index'"),
    ({"target": "fc1", "kind": "forward", "select": {"dim": 0, "index": []}}, r"'index' must be an integer or a "
                                                                              r"non-empty list"),
    ({"target": "fc1", "kind": "forward", "transform": 3}, r"hooks\.s\.transform: expected a transform name"),
])
def test_what_a_hook_sees_is_checked_before_attaching(raw, pattern):
    with pytest.raises(SpecError, match=pattern):
        parse_specs({"s": raw})


def test_input_is_resolved_per_target_and_star_kwargs_accept_any_name():
    class Star(nn.Module):
        def forward(self, x, **kwargs):
            return x

    with attach(Star(), {"s": {"target": "", "kind": "forward_pre", "input": "anything"}}) as hooks:
        assert hooks.bindings[0].sites[0].input == ("anything", None)
    with attach(GPT(n_layer=1), {"s": {"target": "blocks.0.attn", "kind": "forward_pre",
                                       "input": "attention_mask"}}) as hooks:
        assert hooks.bindings[0].sites[0].input == ("attention_mask", 1)


def test_specs_may_be_hookspecs_and_lists():
    specs = parse_specs([{"target": "conv1", "kind": "forward"}, HookSpec(name="h", target="fc1", kind="forward",
                                                                          select={"dim": 1, "index": 0})])
    assert [s.name for s in specs] == ["forward:conv1", "h"] and specs[1].select == {"dim": 1, "index": 0}


def test_the_docs_say_what_the_registries_hold():
    from hookexp.engine import ALIASES, TRANSFORMS

    docs = TESTS.parent / "docs"
    hooks = (docs / "hooks.md").read_text()
    for name, doc in KIND_DOCS.items():  # the kinds table, row for row
        assert f"| `{name}` | {doc.on} | {doc.stage} | `{doc.torch_api}` | {doc.sees} |" in hooks, name
    section = (docs / "transforms.md").read_text()
    for name, info in TRANSFORMS.items():
        assert (f"**{name}**" in section) == (info.alias_of is not None), name  # aliases marked as aliases
        assert name in section, name
    targets = (docs / "targets.md").read_text()
    table = targets[targets.index("| alias | GPT-2"):targets.index("The Llama entry")]
    for entry in ALIASES.values():
        for rel in list(entry.aliases.values()) + list(entry.outer.values()):
            for one in (rel,) if isinstance(rel, str) else (rel if isinstance(rel, tuple) else ()):
                assert f"`{one}`" in table, (entry.name, one)


def test_a_spec_that_leaves_fields_out_gets_hookspecs_defaults():
    """check_spec fills what a spec leaves out from HookSpec's own field defaults (written nowhere else)."""
    from hookexp.engine.schema import check_specs

    (spec,), errors = check_specs({"s": {"target": "fc1", "kind": "forward"}})
    assert errors == [] and spec == HookSpec(name="s", target="fc1", kind="forward")
    (spec,), _ = check_specs({"s": {"target": "fc1", "kind": "forward", "every": 3, "phase": "eval"}})
    assert spec == HookSpec(name="s", target="fc1", kind="forward", every=3, phase="eval")
