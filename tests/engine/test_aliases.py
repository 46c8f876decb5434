"""Portable targets: @blocks @attn @mlp @embed @unembed @norm per architecture, one hook set on several."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_models import GPT
from torch import nn

from hookexp import ConfigError, RegistryError, TargetError, attach, check_on_batch, match, register_aliases
from hookexp.engine import ALIASES
from hookexp.workloads.models import MLP, PatchTransformer, SeedNet, SmallCNN


def names(model, pattern, on="module"):
    return [n for n, _ in match(model, pattern, on=on, key="test")]


def test_aliases_of_the_gpt_layout():
    gpt = GPT(n_layer=2)
    assert names(gpt, "@blocks") == ["blocks.0", "blocks.1"]
    assert names(gpt, "@attn") == ["blocks.0.attn", "blocks.1.attn"]
    assert names(gpt, "@mlp") == ["blocks.0.mlp", "blocks.1.mlp"]
    assert names(gpt, "@embed") == ["embed"] and names(gpt, "@norm") == ["norm"] and names(gpt, "@unembed") == ["head"]
    assert names(gpt, "@attn", on="parameter") == ["blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias",
                                                   "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias",
                                                   "blocks.1.attn.qkv.weight", "blocks.1.attn.qkv.bias",
                                                   "blocks.1.attn.proj.weight", "blocks.1.attn.proj.bias"]
    assert names(gpt, "@embed", on="parameter") == ["embed.weight"]


def test_aliases_of_the_packages_models():
    pt = PatchTransformer(depth=2, d_model=16, heads=2, ff=32)
    assert names(pt, "@attn") == ["layers.0.self_attn", "layers.1.self_attn"]
    assert names(pt, "@blocks") == ["layers.0", "layers.1"] and names(pt, "@unembed") == ["head"]
    assert names(SmallCNN(), "@unembed") == ["fc2"]
    assert names(MLP(depth=4), "@unembed") == ["fc4"]
    assert names(SeedNet(), "@unembed") == ["fc1"]


def test_an_alias_an_architecture_lacks_says_why():
    with pytest.raises(TargetError) as e:
        attach(PatchTransformer(depth=1, d_model=16, heads=2, ff=32), {"m": {"target": "@mlp", "kind": "forward"}})
    assert str(e.value).startswith("hooks.m.target: target '@mlp': '@mlp' has no meaning for PatchTransformer (alias "
                                   "table entry 'hookexp.transformer'): nn.TransformerEncoderLayer runs its "
                                   "feed-forward inline")
    with pytest.raises(TargetError, match=r"'@blocks' has no meaning for SmallCNN .* a classifier without blocks"):
        attach(SmallCNN(), {"b": {"target": "@blocks", "kind": "forward"}})
    with attach(SmallCNN(), {"b": {"target": "@blocks", "kind": "forward", "optional": True}}) as hooks:
        assert hooks.table()[0]["targets"] == [] and hooks.table()[0]["alias"] == "@blocks = (none) (hookexp.smallcnn)"


def test_an_unknown_model_is_an_error_that_says_how_to_add_an_entry():
    class Mine(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(2))
            self.out = nn.Linear(4, 2)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.out(x)

    with pytest.raises(TargetError) as e:
        attach(Mine(), {"b": {"target": "@blocks", "kind": "forward"}})
    msg = str(e.value)
    assert msg.startswith("hooks.b.target: target '@blocks': Mine is not in the alias table, so '@blocks' means "
                          "nothing for it (entries: gpt2 (GPT2Model); llama (by structure); ")
    assert "hookexp.engine.register_aliases('my_model', classes=['Mine'], aliases={'blocks': 'layers.N'" in msg
    try:
        register_aliases("test.mine", classes=["Mine"], aliases={"blocks": "layers.N", "unembed": "out"})
        with pytest.raises(RegistryError, match=r"'test\.mine' is already registered"):
            register_aliases("test.mine", classes=["Mine"], aliases={"blocks": "layers.N"})
        with pytest.raises(RegistryError, match="needs 'classes' or 'detect'"):
            register_aliases("test.none", aliases={"blocks": "x"})
        assert names(Mine(), "@blocks") == ["layers.0", "layers.1"] and names(Mine(), "@unembed") == ["out"]
    finally:
        ALIASES.pop("test.mine", None)


def test_unknown_alias_and_other_settings_errors():
    with pytest.raises(TargetError, match=r"unknown alias '@atn'\. Did you mean '@attn'"):
        attach(GPT(), {"a": {"target": "@atn", "kind": "forward"}})
    with pytest.raises(ConfigError, match=r"^stats\.activations: target '@atn': unknown alias"):
        match(GPT(), "@atn", key="stats.activations")
    with pytest.raises(ConfigError, match=r"^stats\.grads: target 'nope' matches no parameter of GPT\."):
        match(GPT(), "nope", on="parameter", key="stats.grads")


def test_exclude_with_an_alias():
    with attach(GPT(n_layer=1), {"l": {"target": "*", "types": ["Linear"], "exclude": ["@unembed"],
                                       "kind": "forward"}}) as hooks:
        assert "head" not in [t.name for t in hooks.bindings[0].targets]


HOOK_SET = {
    "attn": {"target": "@attn", "kind": "forward", "index": 0, "transform": "scale", "args": {"factor": 0.5}},
    "blocks": {"target": "@blocks", "kind": "output_grad", "index": 0, "transform": "clamp",
               "args": {"min": -0.02, "max": 0.02}},
    "norm": {"target": "@norm", "kind": "forward_pre", "transform": "scale", "args": {"factor": 2.0}},
    "embed": {"target": "@embed", "kind": "grad", "transform": "clamp", "args": {"min": -1e-3, "max": 1e-3}},
    "unembed": {"target": "@unembed", "kind": "pre_step", "transform": "clip_norm", "args": {"max_norm": 0.01}},
}


def install_by_hand(model, opt, attn, blocks, norm, embed, unembed):
    """The same hook set, written with plain torch against the architecture's module names."""
    handles = []
    for name in attn:
        def scale_first(m, a, out):
            return (out[0] * 0.5, *out[1:]) if isinstance(out, tuple) else out * 0.5
        handles.append(model.get_submodule(name).register_forward_hook(scale_first))
    for name in blocks:
        def clamp_grad(m, a, out):
            (out[0] if isinstance(out, tuple) else out).register_hook(lambda g: g.clamp(-0.02, 0.02))
        handles.append(model.get_submodule(name).register_forward_hook(clamp_grad))
    handles.append(model.get_submodule(norm).register_forward_pre_hook(lambda m, a: (a[0] * 2.0,)))
    for p in model.get_submodule(embed).parameters():  # an alias on a parameter kind: every parameter of the module
        handles.append(p.register_hook(lambda g: g.clamp(-1e-3, 1e-3)))
    params = [p for n, p in model.named_parameters() if n.startswith(unembed + ".")]

    def clip(optimizer, args, kwargs):
        for p in params:
            coef = (0.01 / (torch.linalg.vector_norm(p.grad) + 1e-6)).clamp(max=1.0)
            p.grad.mul_(coef)

    handles.append(opt.register_step_pre_hook(clip))
    return handles


@pytest.mark.parametrize("arch", ["gpt", "patch_transformer"])
def test_one_alias_hook_set_on_two_architectures_matches_hand_written_hooks(arch):
    torch.manual_seed(0)
    if arch == "gpt":
        model, x = GPT(n_layer=2), torch.randint(0, 17, (2, 8))
        layout = (["blocks.0.attn", "blocks.1.attn"], ["blocks.0", "blocks.1"], "norm", "embed", "head")
    else:
        model, x = PatchTransformer(depth=2, d_model=16, heads=2, ff=32), torch.randn(2, 1, 8, 8)
        layout = (["layers.0.self_attn", "layers.1.self_attn"], ["layers.0", "layers.1"], "norm", "embed", "head")
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref, plain)}
    hooks = attach(model, HOOK_SET, opts[id(model)])
    handles = install_by_hand(ref, opts[id(ref)], *layout)
    outs = {}
    for m in (model, ref, plain):
        for _ in range(2):
            opts[id(m)].zero_grad()
            out = m(x)
            out.square().sum().backward()
            opts[id(m)].step()
        outs[id(m)] = out.detach()
    stats = hooks.stats()
    hooks.remove()
    for h in handles:
        h.remove()
    assert torch.equal(outs[id(model)], outs[id(ref)])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    assert not torch.equal(outs[id(model)], outs[id(plain)])
    head_params = len(list(model.get_submodule("head").parameters()))
    embed_params = len(list(model.get_submodule("embed").parameters()))
    assert {k: v["calls"] for k, v in stats.items()} == {"attn": 4, "blocks": 4, "norm": 2, "embed": 2 * embed_params,
                                                         "unembed": 2 * head_params}


def test_the_dry_run_and_the_table_show_what_each_alias_became():
    model, x = GPT(n_layer=2), torch.randint(0, 17, (2, 8))
    specs = {k: v for k, v in HOOK_SET.items() if k != "unembed"}
    report = check_on_batch(model, specs, x)
    assert report.ok, report.errors
    rows = {r["spec"]: r for r in report.rows}
    assert rows["attn"]["alias"] == "@attn = blocks.N.attn (hookexp.gpt)"
    assert rows["attn"]["targets"] == ["blocks.0.attn", "blocks.1.attn"]
    assert rows["embed"]["alias"] == "@embed = embed (hookexp.gpt)"
    assert "@attn = blocks.N.attn (hookexp.gpt): blocks.0.attn, blocks.1.attn" in report.render().replace("\n", "")
    with attach(model, specs) as hooks:
        assert {r["spec"]: r["alias"] for r in hooks.table()}["norm"] == "@norm = norm (hookexp.gpt)"


def test_a_name_of_another_architecture_names_the_alias_that_means_it_here():
    """`blocks.0.attn` (the gpt model's) on another architecture names the alias that means it there."""
    pt = PatchTransformer(depth=2, d_model=16, heads=2, ff=32)
    with pytest.raises(TargetError) as e:
        attach(pt, {"a": {"target": "blocks.1.attn", "kind": "forward"}})
    assert str(e.value).startswith(
        "hooks.a.target: target 'blocks.1.attn' matches no module of PatchTransformer (kind 'forward' attaches to "
        "modules). 'blocks.1.attn' is what @attn names in hookexp.gpt models; in PatchTransformer @attn = "
        "layers.N.self_attn (hookexp.transformer): use target '@attn' (every block, on every architecture), or "
        "'layers.1.self_attn' for this one. Its modules are: ")
    with pytest.raises(TargetError, match=r"'blocks\.\*\.attn' is what @attn names in hookexp\.gpt models; in "
                                          r"PatchTransformer @attn = layers\.N\.self_attn \(hookexp\.transformer\): "
                                          r"use target '@attn' \(every block, on every architecture\)\. Its"):
        attach(pt, {"a": {"target": "blocks.*.attn", "kind": "forward"}})  # a glob: the alias, no single module
    # the model's own layout: a wrong index is a did-you-mean, not an alias
    with pytest.raises(TargetError, match=r"matches no module of GPT \(kind 'forward' attaches to modules\)\. "
                                          r"Did you mean 'blocks\.1\.attn'"):
        attach(GPT(n_layer=2), {"a": {"target": "blocks.2.attn", "kind": "forward"}})


def test_the_shipped_hook_sets_use_aliases_for_parts_of_several_architectures():
    """A target in conf/hooks/ that another architecture spells differently is written as its alias;
    ablate_attn_eval then runs on the gpt model and the transformer alike."""
    from importlib import resources

    import yaml

    from hookexp.engine.aliases import alias_hint

    models = (GPT(n_layer=2), PatchTransformer(depth=2, d_model=16, heads=2, ff=32))
    for path in resources.files("hookexp.conf").joinpath("hooks").iterdir():
        if path.name.endswith(".yaml"):
            specs = {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k != "defaults"}
            for name, spec in specs.items():
                for m in models:
                    try:
                        found = names(m, spec["target"])
                    except ConfigError:
                        found = []
                    assert found or alias_hint(m, spec["target"], "module") == "", (path.name, name, spec)
    spec = yaml.safe_load(resources.files("hookexp.conf").joinpath("hooks/ablate_attn_eval.yaml").read_text())
    for model, attn in zip(models, (["blocks.0.attn", "blocks.1.attn"], ["layers.0.self_attn", "layers.1.self_attn"]),
                           strict=True):
        with attach(model, {"ablate_attn_eval": spec["ablate_attn_eval"]}) as hooks:
            assert hooks.table()[0]["targets"] == attn
