"""hookexp.workloads.models: GPT against a forward pass written by hand on the same weights, its names, causality and
padding; hf models from a config and their errors; every model's argument errors; every conf/model option
built on data it fits."""

from __future__ import annotations

import inspect
import math
import re
import sys
from importlib import resources

import pytest
import torch
from conftest import has_module, options
from hydra import compose
from hydra.utils import get_method, instantiate
from omegaconf import OmegaConf

from hookexp.errors import ConfigError
from hookexp.workloads.data import as_splits
from hookexp.workloads.models import GPT, MLP, PatchTransformer, SeedNet, SmallCNN, hf

needs_transformers = pytest.mark.skipif(not has_module("transformers"), reason="extra .[hf] not installed")

# -- GPT ----------------------------------------------------------------------------------------------------


def layer_norm(x, sd, name):
    if f"{name}.weight" not in sd:  # norm="none"
        return x
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    out = (x - mean) / torch.sqrt(var + 1e-5) * sd[f"{name}.weight"]
    return out + sd[f"{name}.bias"] if f"{name}.bias" in sd else out


def linear(x, sd, name):
    out = x @ sd[f"{name}.weight"].T
    return out + sd[f"{name}.bias"] if f"{name}.bias" in sd else out


def reference_gpt(model: GPT, ids: torch.Tensor, mask: torch.Tensor | None, n_head: int, act: str) -> torch.Tensor:
    """GPT's forward pass in plain tensor algebra: explicit softmax attention, erf GELU, hand layer norm."""
    sd = model.state_dict()
    b, t = ids.shape
    x = sd["embed.weight"][ids] + sd["pos_embed.weight"][:t]
    d = x.shape[-1]
    hd = d // n_head
    allowed = torch.ones(t, t).tril().bool()
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :] | torch.eye(t).bool()
    layers = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    for i in range(layers):
        p = f"blocks.{i}"
        qkv = linear(layer_norm(x, sd, f"{p}.ln1"), sd, f"{p}.attn.qkv")
        q, k, v = (qkv[..., j * d:(j + 1) * d].reshape(b, t, n_head, hd).transpose(1, 2) for j in range(3))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~allowed, float("-inf"))
        heads = torch.softmax(scores, dim=-1) @ v
        x = x + linear(heads.transpose(1, 2).reshape(b, t, d), sd, f"{p}.attn.proj")
        hidden = linear(layer_norm(x, sd, f"{p}.ln2"), sd, f"{p}.mlp.fc")
        hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2))) if act == "gelu" else hidden.clamp(min=0)
        x = x + linear(hidden, sd, f"{p}.mlp.proj")
    x = layer_norm(x, sd, "norm")
    return x @ sd["head.weight"].T


VARIANTS = [
    {},
    {"norm": "none", "act": "relu", "bias": False},
    {"tie_weights": True, "d_mlp": 24, "n_layer": 3},
]


@pytest.mark.parametrize("kwargs", VARIANTS)
def test_gpt_equals_a_hand_written_forward_on_the_same_weights(kwargs):
    torch.manual_seed(0)
    args = {"vocab_size": 11, "block_size": 8, "n_layer": 2, "n_head": 4, "d_model": 16, **kwargs}
    model = GPT(**args).double()
    with torch.no_grad():  # GPT-2's init leaves biases and norms trivial: make them count
        for name, p in model.named_parameters():
            if name.endswith(("bias", "ln1.weight", "ln2.weight", "norm.weight")):
                p.copy_(torch.randn_like(p) * 0.5 + (1 if "weight" in name else 0))
    ids = torch.randint(0, 11, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 5:] = 0
    mask[1, 2] = 0
    act = kwargs.get("act", "gelu")
    torch.testing.assert_close(model(ids), reference_gpt(model, ids, None, 4, act))
    torch.testing.assert_close(model(ids, mask), reference_gpt(model, ids, mask, 4, act))
    torch.testing.assert_close(model(ids, torch.ones(3, 7)), model(ids))


def test_gpt_modules_are_named_for_hook_targets():
    model = GPT(vocab_size=10, block_size=4, n_layer=2, n_head=2, d_model=8)
    block = ["", ".ln1", ".attn", ".attn.qkv", ".attn.proj", ".ln2", ".mlp", ".mlp.fc", ".mlp.act", ".mlp.proj"]
    assert [n for n, _ in model.named_modules()] == ["", "embed", "pos_embed", "blocks",
                                                    *[f"blocks.0{s}" for s in block], *[f"blocks.1{s}" for s in block],
                                                    "norm", "head"]
    kinds = {n: type(m) for n, m in model.named_modules()}
    assert kinds["embed"] is kinds["pos_embed"] is torch.nn.Embedding and kinds["blocks"] is torch.nn.ModuleList
    assert kinds["blocks.0.ln1"] is kinds["norm"] is torch.nn.LayerNorm and kinds["blocks.1.mlp.act"] is torch.nn.GELU
    assert kinds["head"] is torch.nn.Linear and model.head.bias is None
    assert model.blocks[0].attn.qkv.weight.shape == (24, 8) and model.blocks[0].mlp.fc.weight.shape == (32, 8)
    bare = GPT(vocab_size=10, block_size=4, n_layer=1, n_head=2, d_model=8, norm="none", act="relu")
    assert isinstance(bare.norm, torch.nn.Identity) and isinstance(bare.blocks[0].ln1, torch.nn.Identity)
    assert isinstance(bare.blocks[0].mlp.act, torch.nn.ReLU)


def test_gpt_proj_input_holds_the_heads_side_by_side():
    model = GPT(vocab_size=10, block_size=6, n_layer=1, n_head=2, d_model=8).double()
    seen = {}
    model.blocks[0].attn.proj.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    ids = torch.randint(0, 10, (1, 6))
    model(ids)
    sd = model.state_dict()
    h = layer_norm(sd["embed.weight"][ids] + sd["pos_embed.weight"][:6], sd, "blocks.0.ln1")
    q, k, v = linear(h, sd, "blocks.0.attn.qkv").split(8, dim=-1)
    head1 = torch.softmax((q[..., 4:] @ k[..., 4:].transpose(-1, -2) / 2).masked_fill(
        ~torch.ones(6, 6).tril().bool(), float("-inf")), -1) @ v[..., 4:]
    torch.testing.assert_close(seen["x"][..., 4:], head1)  # head 1 = features 4..7


def test_gpt_is_causal_and_hides_padded_keys():
    torch.manual_seed(1)
    model = GPT(vocab_size=20, block_size=8, n_layer=2, n_head=2, d_model=16)
    ids = torch.randint(0, 20, (2, 8))
    changed = ids.clone()
    changed[:, 5] = (ids[:, 5] + 1) % 20
    before, after = model(ids), model(changed)
    assert torch.equal(before[:, :5], after[:, :5]) and not torch.allclose(before[:, 5:], after[:, 5:])
    mask = torch.ones(2, 8)
    mask[:, 5] = 0  # position 5 is padding: no other position may see it
    before, after = model(ids, mask), model(changed, mask)
    others = [i for i in range(8) if i != 5]
    torch.testing.assert_close(before[:, others], after[:, others], rtol=0, atol=1e-6)
    short = ids[1:, :5]  # right padding: the real tokens' logits equal the unpadded sequence's
    padded = torch.cat([short, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded, torch.tensor([[1] * 5 + [0] * 3]))[:, :5], model(short))
    left = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)  # a row of pads only sees itself: no NaN
    assert torch.isfinite(model(left, torch.tensor([[0] * 3 + [1] * 5]))).all()


def test_gpt_initialises_like_gpt2_and_ties_on_request():
    torch.manual_seed(0)
    model = GPT(vocab_size=300, block_size=64, n_layer=4, n_head=4, d_model=256)
    for name, p in model.named_parameters():
        if name.endswith("proj.weight"):
            assert abs(p.std().item() / (0.02 / math.sqrt(8)) - 1) < 0.03, name
        elif name.endswith("weight") and p.dim() == 2:
            assert abs(p.std().item() / 0.02 - 1) < 0.03, name
        elif name.endswith("bias"):
            assert not p.any(), name
        else:
            assert (p == 1).all(), name  # LayerNorm weights
    tied = GPT(vocab_size=30, block_size=4, n_layer=1, n_head=1, d_model=8, tie_weights=True)
    assert tied.head.weight is tied.embed.weight
    assert "head.weight" not in dict(tied.named_parameters()) and "embed.weight" in dict(tied.named_parameters())


def test_gpt_refuses_sequences_longer_than_its_block():
    with pytest.raises(ValueError, match=r"^input_ids has 5 positions, more than block_size=4"):
        GPT(vocab_size=5, block_size=4, n_layer=1, n_head=1, d_model=4)(torch.zeros(1, 5, dtype=torch.long))


# -- argument errors: a ValueError starting with the parameter's name ---------------------------------------


@pytest.mark.parametrize(("build", "message"), [
    (lambda: SmallCNN(width=0), "width must be at least 1, got 0"),
    (lambda: SmallCNN(image_size=1), "image_size must be at least 2, got 1"),
    (lambda: SmallCNN(in_channels="auto"), "in_channels must be an integer, got 'auto' (auto is filled from the data"),
    (lambda: SmallCNN(hidden=2.5), "hidden must be an integer, got 2.5"),
    (lambda: MLP(depth=0), "depth must be at least 1, got 0"),
    (lambda: MLP(norm="batch"), "norm must be one of None, layer, got 'batch'"),
    (lambda: MLP(init_std=-1.0), "init_std must be a positive number or null, got -1.0"),
    (lambda: MLP(input_dim=0), "input_dim must be at least 1, got 0"),
    (lambda: SeedNet(num_classes=0), "num_classes must be at least 1, got 0"),
    (lambda: PatchTransformer(d_model=10, heads=4), "d_model must be divisible by heads, got d_model=10, heads=4"),
    (lambda: GPT(vocab_size="auto"), "vocab_size must be an integer, got 'auto'"),
    (lambda: GPT(10, n_layer=0), "n_layer must be at least 1, got 0"),
    (lambda: GPT(10, d_model=30, n_head=4), "d_model must be divisible by n_head, got d_model=30, n_head=4"),
    (lambda: GPT(10, act="gleu"), "act must be one of gelu, relu, got 'gleu'. Did you mean 'gelu'"),
    (lambda: GPT(10, norm="rms"), "norm must be one of layer, none, got 'rms'"),
    (lambda: GPT(10, dropout=1.5), "dropout must be a number in [0, 1), got 1.5"),
    (lambda: GPT(10, d_mlp=0), "d_mlp must be at least 1, got 0"),
    (lambda: GPT(10, block_size=True), "block_size must be an integer, got True"),
])
def test_bad_model_arguments_start_with_the_parameter_name(build, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        build()


def test_image_models_keep_their_names_and_the_mlp_takes_tabular_sizes():
    assert [n for n, _ in SmallCNN().named_children()] == ["conv1", "relu1", "conv2", "relu2", "pool", "flatten",
                                                           "fc1", "relu3", "fc2"]
    assert [n for n, _ in SeedNet().named_children()] == ["conv", "relu", "flatten", "fc1"]
    assert [n for n, _ in MLP(depth=2, norm="layer").named_children()] == ["flatten", "fc1", "norm1", "relu1", "fc2"]
    assert [n for n, _ in PatchTransformer(depth=1).named_children()] == ["embed", "layers", "norm", "head"]
    tabular = MLP(input_dim=5, output_dim=2, depth=2, width=7)
    assert tabular(torch.randn(3, 5)).shape == (3, 2) and tabular.fc1.in_features == 5
    assert MLP(in_channels=3, image_size=4, num_classes=6).fc1.in_features == 48
    deep = MLP(depth=3, init_std=0.5)
    assert not deep.fc2.bias.any() and abs(deep.fc1.weight.std().item() - 0.5) < 0.05


# -- hf -----------------------------------------------------------------------------------------------------

TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 50, "n_positions": 16,
        "bos_token_id": None, "eos_token_id": None}


@needs_transformers
def test_hf_builds_from_a_config_without_download():
    torch.manual_seed(0)
    model = hf(TINY)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.config.n_layer == 2 and model.config.n_embd == 32 and model.config.vocab_size == 50
    names = dict(model.named_modules())
    assert {"transformer.h.0.attn", "transformer.h.1.mlp", "lm_head"} <= set(names)
    out = model(input_ids=torch.randint(0, 50, (2, 6)), attention_mask=torch.ones(2, 6))
    assert out.logits.shape == (2, 6, 50)
    classifier = hf({**TINY, "num_labels": 3, "pad_token_id": 0}, kind="sequence_classification")
    assert classifier(input_ids=torch.randint(1, 50, (2, 6))).logits.shape == (2, 3)
    assert type(hf(TINY, kind="base")).__name__ == "GPT2Model"
    bert = hf({"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2,
               "intermediate_size": 32, "vocab_size": 40}, kind="masked_lm")
    assert type(bert).__name__ == "BertForMaskedLM"


@needs_transformers
def test_hf_loads_a_local_folder(tmp_path):
    model = hf(TINY)
    model.save_pretrained(tmp_path / "m")
    loaded = hf(pretrained=str(tmp_path / "m"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values(),
                                                   strict=True))


@needs_transformers
@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"config": {**TINY, "model_type": "gtp2"}},
     r"^model\.config\.model_type: unknown model_type 'gtp2'\. Did you mean 'gpt2'"),
    ({"config": {"n_layer": 2}}, r"^model\.config\.model_type: is missing"),
    ({"config": {**TINY, "n_layers": 3}},
     r"^model\.config\.n_layers: GPT2Config has no field 'n_layers'\. Did you mean 'n_layer'"),
    ({"config": {**TINY, "vocab_size": "auto"}}, r"^model\.config\.vocab_size: is auto, which a hookexp run fills"),
    ({"config": TINY, "kind": "causal"}, r"^model\.kind: unknown value 'causal'\. Did you mean 'causal_lm'"),
    ({}, r"^model: give exactly one of model\.config .* and model\.pretrained"),
    ({"config": TINY, "pretrained": "x"}, r"^model: give exactly one of"),
    ({"pretrained": "no/such/folder"}, r"^model\.pretrained: 'no/such/folder' is not a folder \(looked in .*no/such\)"),
    ({"config": {"model_type": "vit", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "intermediate_size": 16}}, r"^model\.kind: vit has no causal_lm model"),
    ({"config": [1, 2]}, r"^model\.config: must be a mapping"),
    # a value of the wrong type names its field (not "hf refused its arguments: ... field 'n_layer':.")
    ({"config": {**TINY, "n_layer": "abc"}}, r"^model\.config\.n_layer: GPT2Config takes a whole number for n_layer, "
                                             r"got 'abc'\.$"),
    ({"config": {**TINY, "resid_pdrop": "x"}}, r"^model\.config\.resid_pdrop: GPT2Config takes a number for "
                                               r"resid_pdrop, got 'x'\.$"),
    ({"config": {**TINY, "use_cache": "no"}}, r"^model\.config\.use_cache: GPT2Config takes true or false for "
                                              r"use_cache, got 'no'\.$"),
    ({"config": {**TINY, "model_type": "llama"}},  # model.config.model_type=llama over hf.yaml's GPT-2 fields
     r"^model\.config\.n_layer: LlamaConfig has no field 'n_layer'\. Did you mean 'num_labels' or "
     r"'num_hidden_layers'\? It is one of model=hf's GPT-2 defaults \(conf/model/hf\.yaml\): for a llama model, "
     r"replace the whole mapping, e\.g\. '~model\.config' '\+model\.config=\{model_type:llama,vocab_size:auto,"),
])
def test_hf_errors_name_the_key(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        hf(**kwargs)


def test_hf_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r"^model: model=hf needs transformers, which is not installed .*"
                                          r"pip install 'hookexp\[hf\]'"):
        hf(TINY)


# -- conf/model: every option on data it fits --------------------------------------------------------------


def fill(node: dict, info: dict) -> dict:
    """The config with every ``auto`` replaced by the data's value (what the run's build does)."""
    return {k: fill(v, info) if isinstance(v, dict) else info[k] if v == "auto" else v for k, v in node.items()}




@pytest.mark.parametrize("option", options("model"))
def test_every_model_key_is_a_parameter_and_commented(option):
    text = (resources.files("hookexp.conf") / "model" / f"{option}.yaml").read_text()
    cfg = OmegaConf.to_container(OmegaConf.create(text))
    params = inspect.signature(get_method(cfg["_target_"])).parameters
    assert set(cfg) - {"_target_"} <= set(params), set(cfg) - set(params)
    keys = [line for line in text.splitlines() if re.match(r"^\s*[a-z][a-z_]*: \S", line)]
    assert all("#" in line for line in keys), keys


CASES = [
    ("small_cnn", "digits", [], (10,)),
    ("mlp", "digits", [], (10,)),
    ("mlp", "synthetic_regression", ["data.output_dim=3"], (3,)),
    ("seed_net", "synthetic", [], (5,)),
    ("transformer", "digits", [], (10,)),
    ("gpt", "modular_addition", ["data.p=7"], (4, 9)),
    ("gpt", "text_file", ["data.path=PATH", "data.block_size=8"], (8, None)),
    pytest.param("hf", "text_file", ["data.path=PATH", "data.block_size=8"], (8, None), marks=needs_transformers),
]


@pytest.mark.parametrize(("model", "data", "overrides", "shape"), CASES)
def test_every_model_option_builds_and_steps_on_data_it_fits(model, data, overrides, shape, hydra_conf, tmp_path):
    (tmp_path / "t.txt").write_text("hello hooks, hello world. " * 40)
    overrides = [o.replace("PATH", str(tmp_path / "t.txt")) for o in overrides]
    cfg = compose("config", overrides=[f"model={model}", f"data={data}", *overrides])
    splits = as_splits(instantiate(cfg.data.dataset), cfg.data.get("val_fraction", 0.2))
    node = fill(OmegaConf.to_container(cfg.model, resolve=True), splits.info)
    net = instantiate(node)
    batch = next(iter(torch.utils.data.DataLoader(splits.train, batch_size=4, collate_fn=splits.collate_fn)))
    inputs = batch["input_ids"] if isinstance(batch, dict) else batch[0]
    out = net(inputs)
    logits = out.logits if hasattr(out, "logits") else out
    vocab = splits.info.get("vocab_size")
    assert logits.shape == (4, *(vocab if s is None else s for s in shape))
    logits.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in net.parameters())
    if model == "gpt":
        assert net.embed.num_embeddings == vocab and net.pos_embed.num_embeddings == splits.info["block_size"]
