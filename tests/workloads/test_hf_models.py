"""Real models nobody here wrote: transformers' GPT-2 and Llama built from tiny configs (no download).

One alias-based hook set runs through ``attach`` on both, against the same hooks written by hand with each
architecture's module names, bit for bit, and through the dry run. Skipped when transformers is missing.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hookexp import attach, check_on_batch  # noqa: E402

HOOK_SET = {
    "blocks": {"target": "@blocks", "kind": "forward_pre", "input": "hidden_states", "transform": "scale",
               "args": {"factor": 0.9}},
    "attn": {"target": "@attn", "kind": "forward", "index": 0, "transform": "scale", "args": {"factor": 0.5}},
    "mlp": {"target": "@mlp", "kind": "output_grad", "transform": "clamp", "args": {"min": -1e-3, "max": 1e-3}},
    "norm": {"target": "@norm", "kind": "forward", "transform": "scale", "args": {"factor": 2.0}},
    "embed": {"target": "@embed", "kind": "grad", "transform": "clamp", "args": {"min": -1e-4, "max": 1e-4}},
    "unembed": {"target": "@unembed", "kind": "pre_step", "transform": "clip_norm", "args": {"max_norm": 0.05}},
}


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    names = {"blocks": ["transformer.h.0", "transformer.h.1"], "attn": ["transformer.h.0.attn", "transformer.h.1.attn"],
             "mlp": ["transformer.h.0.mlp", "transformer.h.1.mlp"], "norm": "transformer.ln_f",
             "embed": "transformer.wte", "unembed": "lm_head"}
    return model, names


def llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=50, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(cfg)
    names = {"blocks": ["model.layers.0", "model.layers.1"], "attn": ["model.layers.0.self_attn",
                                                                      "model.layers.1.self_attn"],
             "mlp": ["model.layers.0.mlp", "model.layers.1.mlp"], "norm": "model.norm", "embed": "model.embed_tokens",
             "unembed": "lm_head"}
    return model, names


def by_hand(model, opt, names):
    """HOOK_SET with plain torch, against the architecture's own module names."""
    handles = []

    def scale_hidden(module, args, kwargs):
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 0.9}
        return (args[0] * 0.9, *args[1:]), kwargs

    def clamp_out(module, args, out):
        out.register_hook(lambda g: g.clamp(-1e-3, 1e-3))

    for name in names["blocks"]:
        handles.append(model.get_submodule(name).register_forward_pre_hook(scale_hidden, with_kwargs=True))
    for name in names["attn"]:
        handles.append(model.get_submodule(name).register_forward_hook(lambda m, a, o: (o[0] * 0.5, *o[1:])))
    for name in names["mlp"]:
        handles.append(model.get_submodule(name).register_forward_hook(clamp_out))
    handles.append(model.get_submodule(names["norm"]).register_forward_hook(lambda m, a, o: o * 2.0))
    for p in model.get_submodule(names["embed"]).parameters():
        handles.append(p.register_hook(lambda g: g.clamp(-1e-4, 1e-4)))
    params = list(model.get_submodule(names["unembed"]).parameters())

    def clip(optimizer, args, kwargs):
        for p in params:
            p.grad.mul_((0.05 / (torch.linalg.vector_norm(p.grad) + 1e-6)).clamp(max=1.0))

    handles.append(opt.register_step_pre_hook(clip))
    return handles


def train(model, opt, ids, steps=2):
    for _ in range(steps):
        opt.zero_grad()
        out = model(ids)
        out.logits.square().mean().backward()
        opt.step()
    return out.logits.detach()


@pytest.mark.parametrize("make", [gpt2, llama])
def test_one_alias_hook_set_matches_hand_written_hooks_on_gpt2_and_llama(make):
    torch.manual_seed(0)
    model, names = make()
    ids = torch.randint(0, 50, (2, 8))
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref, plain)]
    with attach(model, HOOK_SET, opts[0]) as hooks:
        out = train(model, opts[0], ids)
        stats = hooks.stats()
        table = {r["spec"]: r for r in hooks.table()}
    handles = by_hand(ref, opts[1], names)
    ref_out = train(ref, opts[1], ids)
    for h in handles:
        h.remove()
    assert torch.equal(out, ref_out)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    assert not torch.equal(out, train(plain, opts[2], ids))
    assert all(stats[name]["calls"] > 0 for name in HOOK_SET), stats
    assert table["attn"]["targets"] == names["attn"]


@pytest.mark.parametrize(("make", "arch"), [(gpt2, "gpt2"), (llama, "llama")])
def test_the_dry_run_shows_the_aliases_on_gpt2_and_llama(make, arch):
    model, names = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = check_on_batch(model, HOOK_SET, torch.randint(0, 50, (2, 8)), opt)
    assert report.ok, report.errors
    rows = {r["spec"]: r for r in report.rows}
    assert rows["attn"]["alias"] == f"@attn = {names['attn'][0].replace('.0.', '.N.')} ({arch})"
    assert rows["blocks"]["calls_per_step"] == 2 and rows["unembed"]["calls_per_step"] >= 1


def test_a_forward_hook_on_a_module_returning_a_model_output_keeps_it():
    torch.manual_seed(0)
    model, _ = gpt2()
    ids = torch.randint(0, 50, (2, 8))
    base = model(ids).logits
    spec = {"root": {"target": "transformer", "kind": "forward", "index": "last_hidden_state", "transform": "scale",
                     "args": {"factor": 0.5}}}
    with attach(model, spec):
        inner = model.transformer(ids)
        out = model(ids).logits
    assert type(inner).__name__ == "BaseModelOutputWithPastAndCrossAttentions"
    assert torch.equal(out, model.lm_head(model.transformer(ids).last_hidden_state * 0.5))
    assert not torch.equal(out, base)


def test_forward_pre_on_a_model_called_with_inputs_embeds():
    torch.manual_seed(0)
    model, _ = gpt2()
    embeds = torch.randn(2, 8, 32)
    base = model(inputs_embeds=embeds).logits
    spec = {"e": {"target": "transformer", "kind": "forward_pre", "input": "inputs_embeds", "transform": "zero"}}
    with attach(model, spec) as hooks:
        out = model(inputs_embeds=embeds).logits
        assert hooks.stats()["e"]["calls"] == 1
    assert torch.equal(out, model(inputs_embeds=torch.zeros_like(embeds)).logits) and not torch.equal(out, base)


def test_bert_resolves_the_same_hook_set_and_its_missing_norm_is_optional():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  vocab_size=50, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(cfg)
    specs = {**HOOK_SET, "norm": {**HOOK_SET["norm"], "optional": True}}
    report = check_on_batch(model, specs, torch.randint(0, 50, (2, 8)), torch.optim.SGD(model.parameters(), lr=0.1))
    assert report.ok, report.errors
    rows = {r["spec"]: r for r in report.rows}
    assert rows["attn"]["targets"] == ["bert.encoder.layer.0.attention.self", "bert.encoder.layer.1.attention.self"]
    assert rows["mlp"]["alias"] == "@mlp = bert.encoder.layer.N.intermediate (bert)"
    # the decoder's parameters are tied: the weight to the input embedding, the bias to cls.predictions.bias
    assert rows["unembed"]["targets"] == ["bert.embeddings.word_embeddings.weight", "cls.predictions.bias"]
    assert rows["norm"]["targets"] == [] and rows["norm"]["alias"] == "@norm = (none) (bert)"
    assert all(rows[k]["calls_per_step"] > 0 for k in HOOK_SET if k != "norm"), rows


def test_the_gpt_models_attention_name_on_gpt2_names_the_alias_and_the_shipped_set_uses_it():
    """`blocks.0.attn` on GPT2LMHeadModel names the alias to write; `model=hf hooks=ablate_attn_eval` (whose
    set is written with the alias) attaches."""
    from importlib import resources

    import yaml

    from hookexp import TargetError

    model, names = gpt2()
    with pytest.raises(TargetError) as e:
        attach(model, {"ablate_attn_eval": {"target": "blocks.0.attn", "kind": "forward", "phase": "eval"}})
    assert str(e.value).startswith(
        "hooks.ablate_attn_eval.target: target 'blocks.0.attn' matches no module of GPT2LMHeadModel (kind 'forward' "
        "attaches to modules). 'blocks.0.attn' is what @attn names in hookexp.gpt models; in GPT2LMHeadModel @attn = "
        "transformer.h.N.attn (gpt2): use target '@attn' (every block, on every architecture), or "
        "'transformer.h.0.attn' for this one. Its modules are: ")
    shipped = yaml.safe_load(resources.files("hookexp.conf").joinpath("hooks/ablate_attn_eval.yaml").read_text())
    with attach(model, {"ablate_attn_eval": shipped["ablate_attn_eval"]}) as hooks:
        assert hooks.table()[0]["targets"] == names["attn"]
