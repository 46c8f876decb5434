"""The models the configs name, with module names a hook target can read (docs/models.md).

The image models are ``nn.Sequential`` s with named children (``conv1``, ``relu1``, ``fc1.bias``); :class:`GPT`
is a small decoder-only transformer written to be read and hooked (``blocks.N.attn``, ``blocks.N.mlp``);
:func:`hf` builds a ``transformers`` model. Data-derived arguments are ``auto`` in conf/model, filled from
``Splits.info``. A bad argument is a ValueError whose message starts with the parameter's name, so the run can
name the config key. µP: :class:`MLP` and :class:`GPT` take ``parametrization="mup"`` and a ``base_width`` and
are built with the ``mup`` package (extra ``hookexp[mup]``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookexp.errors import ConfigError, did_you_mean, unfit

PARAMETRIZATIONS = ("sp", "mup")

# -- argument checks ----------------------------------------------------------------------------------------


def _int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        hint = " (auto is filled from the data by a hookexp run; in Python give a number)" if value == "auto" else ""
        raise ValueError(f"{name} must be an integer, got {value!r}{hint}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def _choice(name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        names = [str(c) for c in choices]
        raise ValueError(f"{name} must be one of {', '.join(names)}, got {value!r}.{did_you_mean(str(value), names)}")
    return value


def _fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def _mup() -> Any:
    try:
        import mup
    except ImportError as e:
        raise ConfigError(f"parametrization=mup needs the mup package, which is not installed ({e}). Install it "
                          "without its own requirements: pip install --no-deps 'mup>=1.0' (they pull PyPI's "
                          "torchvision, which replaces a CPU torch; ./scripts/test.sh installs it so).",
                          key="model.parametrization") from None
    return mup


def _base_width(value: Any) -> int:
    if value is None:
        raise ValueError("base_width must be set with parametrization=mup: the width whose behaviour (and tuned "
                         "hyperparameters) every width keeps, e.g. 64")
    return _int("base_width", value)


def _base_shapes(model: nn.Module, build: Any, base_width: int, rescale_params: bool) -> Any:
    """``mup.set_base_shapes(model, base, delta=delta)``, ``base`` and ``delta`` being ``build(base_width)`` and
    ``build(2 * base_width)`` on the meta device; returns the mup module."""
    mup = _mup()
    with torch.device("meta"):
        base, delta = build(base_width), build(2 * base_width)
    mup.set_base_shapes(model, base, delta=delta, rescale_params=rescale_params)
    return mup


# -- image and tabular models -------------------------------------------------------------------------------


class SmallCNN(nn.Sequential):
    """Two 3x3 conv layers and two linear layers: the default model for 8x8 digits (~40k parameters)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8, width: int = 16,
                 hidden: int = 64):
        for name, value in (("in_channels", in_channels), ("num_classes", num_classes), ("width", width),
                            ("hidden", hidden)):
            _int(name, value)
        _int("image_size", image_size, 2)  # the 2x2 pooling needs two pixels a side
        pooled = image_size // 2
        super().__init__(OrderedDict([
            ("conv1", nn.Conv2d(in_channels, width, 3, padding=1)),
            ("relu1", nn.ReLU()),
            ("conv2", nn.Conv2d(width, 2 * width, 3, padding=1)),
            ("relu2", nn.ReLU()),
            ("pool", nn.MaxPool2d(2)),
            ("flatten", nn.Flatten()),
            ("fc1", nn.Linear(2 * width * pooled * pooled, hidden)),
            ("relu3", nn.ReLU()),
            ("fc2", nn.Linear(hidden, num_classes)),
        ]))


class MLP(nn.Sequential):
    """``depth`` linear layers of ``width`` units with ReLU between them (``fc1`` ... ``fc<depth>``).

    The input is flattened: ``input_dim`` features (default ``in_channels * image_size**2``, an image's
    pixels), ``output_dim`` outputs (default ``num_classes``); conf/model/mlp.yaml takes both from the data,
    so one file fits images (classification) and tabular data (regression). ``init_std`` (when set) draws
    every weight from N(0, init_std^2) and zeroes the biases: a badly initialised deep network for
    gradient-noise studies. ``norm="layer"`` puts a LayerNorm (``norm<i>``) after every hidden linear layer.
    ``parametrization="mup"``: µP with ``base_width`` (module docstring): ``fc<depth>`` is a ``mup.MuReadout``,
    and torch's default initialisation is rescaled by ``mup.set_base_shapes`` (``init_std`` must be null).
    """

    def __init__(self, in_channels: int = 1, image_size: int = 8, num_classes: int = 10, depth: int = 3,
                 width: int = 128, init_std: float | None = None, norm: str | None = None,
                 input_dim: int | None = None, output_dim: int | None = None, parametrization: str = "sp",
                 base_width: int | None = None):
        _choice("norm", norm, (None, "layer"))
        _choice("parametrization", parametrization, PARAMETRIZATIONS)
        if parametrization == "mup" and init_std is not None:
            raise ValueError(f"init_std must be null with parametrization=mup (got {init_std!r}): µP scales torch's "
                             "default initialisation with the width (mup.set_base_shapes)")
        given = {"in_channels": in_channels, "image_size": image_size, "num_classes": num_classes, "depth": depth,
                 "norm": norm, "input_dim": input_dim, "output_dim": output_dim}
        for name, value in (("depth", depth), ("width", width)):
            _int(name, value)
        if input_dim is None:
            fan_in = _int("in_channels", in_channels) * _int("image_size", image_size) ** 2
        else:
            fan_in = _int("input_dim", input_dim)
        fan_out = _int("num_classes", num_classes) if output_dim is None else _int("output_dim", output_dim)
        if init_std is not None and (isinstance(init_std, bool) or not isinstance(init_std, Real) or init_std <= 0):
            raise ValueError(f"init_std must be a positive number or null, got {init_std!r}")
        layers: list[tuple[str, nn.Module]] = [("flatten", nn.Flatten())]
        for i in range(1, depth):
            layers.append((f"fc{i}", nn.Linear(fan_in, width)))
            if norm == "layer":
                layers.append((f"norm{i}", nn.LayerNorm(width)))
            layers.append((f"relu{i}", nn.ReLU()))
            fan_in = width
        readout = _mup().MuReadout if parametrization == "mup" else nn.Linear
        layers.append((f"fc{depth}", readout(fan_in, fan_out)))
        super().__init__(OrderedDict(layers))
        if init_std is not None:
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=init_std)
                    nn.init.zeros_(m.bias)
        if parametrization == "mup":
            _base_shapes(self, lambda w: MLP(**given, width=w), _base_width(base_width), rescale_params=True)


class SeedNet(nn.Sequential):
    """The network of the seed example: Conv2d(3, 10, k=2, s=2) -> ReLU -> flatten -> Linear(160, 5)
    on 3x8x8 inputs (channels, classes and size follow the data)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 5, image_size: int = 8):
        _int("in_channels", in_channels)
        _int("num_classes", num_classes)
        _int("image_size", image_size, 2)  # the stride-2 conv needs two pixels a side
        side = image_size // 2
        super().__init__(OrderedDict([
            ("conv", nn.Conv2d(in_channels, 10, kernel_size=2, stride=2)),
            ("relu", nn.ReLU()),
            ("flatten", nn.Flatten()),
            ("fc1", nn.Linear(10 * side * side, num_classes)),
        ]))


class PatchTransformer(nn.Module):
    """A small pre-norm transformer encoder for images: each row of pixels is a token.

    ``embed`` (Linear) -> ``layers.<i>`` (nn.TransformerEncoderLayer: ``self_attn``, ``linear1``,
    ``linear2``, ``norm1``, ``norm2``) -> mean over tokens -> ``head``. Targets such as
    ``re:^layers\\.\\d+\\.self_attn$`` reach every attention block.
    """

    def __init__(self, in_channels: int = 1, image_size: int = 8, num_classes: int = 10, d_model: int = 128,
                 depth: int = 4, heads: int = 4, ff: int = 256):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("image_size", image_size), ("num_classes", num_classes),
                            ("d_model", d_model), ("depth", depth), ("heads", heads), ("ff", ff)):
            _int(name, value)
        if d_model % heads:
            raise ValueError(f"d_model must be divisible by heads, got d_model={d_model}, heads={heads}")
        self.embed = nn.Linear(in_channels * image_size, d_model)
        self.pos = nn.Parameter(torch.zeros(1, image_size, d_model))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(depth))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = self.embed(x.permute(0, 2, 1, 3).reshape(b, h, c * w)) + self.pos
        for layer in self.layers:
            tokens = layer(tokens)
        return self.head(self.norm(tokens).mean(dim=1))


# -- GPT: a small decoder-only transformer ------------------------------------------------------------------

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``qkv`` (one Linear for queries, keys and values), attention by
    ``F.scaled_dot_product_attention``, then ``proj``. ``proj``'s input is the heads side by side,
    ``[B, T, n_head * head_dim]``, so a hook spec's ``select: {heads: [...], num_heads: H}`` on it acts on
    single heads."""

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, bias: bool = True,
                 scale: float | None = None):
        super().__init__()
        self.n_head, self.dropout, self.scale = n_head, dropout, scale  # scale: of q.k (None: 1/sqrt(head_dim))
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        p = self.dropout if self.training else 0.0
        if attention_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=self.scale)
        else:  # key padding: a query sees earlier real tokens, and itself so that no row is empty (NaN)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            keep = causal & attention_mask.bool()[:, None, None, :] | torch.eye(t, dtype=torch.bool, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p, scale=self.scale)
        y = y.transpose(1, 2).reshape(b, t, d)
        return F.dropout(self.proj(y), p, self.training)


class FeedForward(nn.Module):
    """The block's MLP: ``fc`` (d_model -> d_mlp), ``act``, ``proj`` (d_mlp -> d_model)."""

    def __init__(self, d_model: int, d_mlp: int, act: str = "gelu", dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.dropout = dropout
        self.fc = nn.Linear(d_model, d_mlp, bias=bias)
        self.act = ACTIVATIONS[act]()
        self.proj = nn.Linear(d_mlp, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(self.act(self.fc(x))), self.dropout, self.training)


LAYOUTS = ("pre_norm", "normed_stream")


class Block(nn.Module):
    """A transformer block. ``pre_norm`` (GPT-2): ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.
    ``normed_stream`` (the Grokfast and grokking papers' code): ``x = ln1(x)``, ``x + attn(x)``, then
    ``x + mlp(ln2(x))``: the residual stream itself is normalised before attention."""

    def __init__(self, d_model: int, n_head: int, d_mlp: int, dropout: float, act: str, norm: str, bias: bool,
                 scale: float | None = None, layout: str = "pre_norm"):
        super().__init__()
        self.layout = layout
        self.ln1 = nn.LayerNorm(d_model, bias=bias) if norm == "layer" else nn.Identity()
        self.attn = CausalSelfAttention(d_model, n_head, dropout, bias, scale)
        self.ln2 = nn.LayerNorm(d_model, bias=bias) if norm == "layer" else nn.Identity()
        self.mlp = FeedForward(d_model, d_mlp, act, dropout, bias)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.layout == "normed_stream":
            x = self.ln1(x)
            x = x + self.attn(x, attention_mask)
        else:
            x = x + self.attn(self.ln1(x), attention_mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only transformer (GPT-2's layout, as in nanoGPT), named for hook targets:

    ``embed`` (tokens) and ``pos_embed`` (learned positions) -> ``blocks.N`` (``ln1``, ``attn``, ``ln2``,
    ``mlp``) -> ``norm`` -> ``head`` (logits over the vocabulary). ``forward(input_ids [B, T],
    attention_mask [B, T] | None) -> logits [B, T, vocab_size]``; ``attention_mask`` (1 = token, 0 = padding)
    hides padded keys. ``init="gpt2"``: weights N(0, 0.02), the residual projections (``attn.proj``,
    ``mlp.proj``) N(0, 0.02 / sqrt(2 * n_layer)) so the residual stream's variance does not grow with depth;
    biases zero. ``init="torch"``: PyTorch's own defaults, as research code that sets no init has (Linear:
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)) weights and biases; Embedding: N(0, 1); LayerNorm: ones and zeros;
    attention as ``nn.MultiheadAttention`` initialises itself: Xavier-uniform ``qkv.weight``, zero ``qkv`` and
    ``proj`` biases). ``init="normal"``: every Linear and Embedding weight N(0, ``init_std``), biases zero, no
residual scaling (Nanda et al. 2023's grokking model: ``init_std`` = 1/sqrt(d_model)). ``layout``: see
:class:`Block`. ``tie_weights`` shares ``head.weight`` with ``embed.weight`` (then
    listed once, as ``embed.weight``, by ``named_parameters``).

    ``parametrization="mup"``: µP with ``base_width`` (module docstring; the width is ``d_model``, and ``d_mlp``
    grows with it): ``head`` is a ``mup.MuReadout``, the same standard deviations are drawn with
    ``mup.init.normal_`` (matrices shrink by sqrt(base_width / d_model)), and attention scores q.k are scaled
    by 1/head_dim instead of 1/sqrt(head_dim), times sqrt(base head_dim) so that the base width's model is the
    SP one. Not with ``tie_weights`` nor ``init="torch"``.
    """

    def __init__(self, vocab_size: int, block_size: int = 128, n_layer: int = 4, n_head: int = 4, d_model: int = 256,
                 d_mlp: int | None = None, dropout: float = 0.0, act: str = "gelu", norm: str = "layer",
                 bias: bool = True, tie_weights: bool = False, parametrization: str = "sp",
                 base_width: int | None = None, init: str = "gpt2", layout: str = "pre_norm",
                 init_std: float | None = None):
        super().__init__()
        _choice("parametrization", parametrization, PARAMETRIZATIONS)
        if parametrization == "mup" and tie_weights:
            raise ValueError("tie_weights must be false with parametrization=mup: µP's readout (mup.MuReadout) "
                             "scales differently from the embedding")
        if parametrization == "mup" and init != "gpt2":
            raise ValueError(f"init must be gpt2 with parametrization=mup (µP draws its own scaled init), got {init!r}")
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                            ("n_head", n_head), ("d_model", d_model)):
            _int(name, value)
        if d_model % n_head:
            raise ValueError(f"d_model must be divisible by n_head, got d_model={d_model}, n_head={n_head}")
        given = {"vocab_size": vocab_size, "block_size": block_size, "n_layer": n_layer, "n_head": n_head,
                 "dropout": dropout, "act": act, "norm": norm, "bias": bias, "layout": layout}
        mlp_ratio = None if d_mlp is None else _int("d_mlp", d_mlp) / d_model  # d_mlp grows with d_model (µP)
        d_mlp = 4 * d_model if d_mlp is None else d_mlp
        scale = None
        if parametrization == "mup":  # 1/head_dim, equal to 1/sqrt(head_dim) at the base width
            base_width = _base_width(base_width)
            if base_width % n_head:
                raise ValueError(f"base_width must be divisible by n_head (the base model's d_model), got "
                                 f"base_width={base_width}, n_head={n_head}")
            scale = math.sqrt(base_width / n_head) / (d_model // n_head)
        _fraction("dropout", dropout)
        _choice("act", act, tuple(ACTIVATIONS))
        _choice("norm", norm, ("layer", "none"))
        _choice("init", init, ("gpt2", "torch", "normal"))
        if (init == "normal") != (init_std is not None):
            raise ValueError(f"init_std goes with init=normal and only with it (got init={init!r}, "
                             f"init_std={init_std!r}): set model.init=normal model.init_std=0.088, or leave init_std "
                             "null")
        if init_std is not None and (isinstance(init_std, bool) or not isinstance(init_std, Real) or init_std <= 0):
            raise ValueError(f"init_std must be a positive number, got {init_std!r}")
        _choice("layout", layout, LAYOUTS)
        self.block_size, self.dropout = block_size, dropout
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, d_mlp, dropout, act, norm, bias, scale, layout)
                                    for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model, bias=bias) if norm == "layer" else nn.Identity()
        readout = _mup().MuReadout if parametrization == "mup" else nn.Linear
        self.head = readout(d_model, vocab_size, bias=False)
        normal_ = nn.init.normal_
        if parametrization == "mup":
            normal_ = _base_shapes(self, lambda w: GPT(**given, d_model=w, d_mlp=mlp_ratio and round(mlp_ratio * w)),
                                   base_width, rescale_params=False).init.normal_
        for name, module in self.named_modules() if init in ("gpt2", "normal") else ():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = init_std if init == "normal" else (
                    0.02 / math.sqrt(2 * n_layer) if name.endswith(".proj") else 0.02)
                normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for block in self.blocks if init == "torch" else ():  # nn.MultiheadAttention's _reset_parameters
            nn.init.xavier_uniform_(block.attn.qkv.weight)
            for linear in (block.attn.qkv, block.attn.proj):
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
        if tie_weights:
            self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"input_ids has {t} positions, more than block_size={self.block_size}: give shorter "
                             "sequences or a larger block_size")
        x = self.embed(input_ids) + self.pos_embed(torch.arange(t, device=input_ids.device))
        x = F.dropout(x, self.dropout, self.training)
        for block in self.blocks:
            x = block(x, attention_mask)
        return self.head(self.norm(x))


# -- transformers models ------------------------------------------------------------------------------------

HF_KINDS = {"causal_lm": "AutoModelForCausalLM", "sequence_classification": "AutoModelForSequenceClassification",
            "masked_lm": "AutoModelForMaskedLM", "base": "AutoModel"}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(f"model=hf needs transformers, which is not installed ({e}). Install the extra: pip install "
                          "'hookexp[hf]'.", key="model") from None
    return transformers


HF_GPT2_DEFAULTS = ("n_positions", "n_embd", "n_layer", "n_head")  # conf/model/hf.yaml's GPT-2 fields


def _hf_config(transformers: Any, config: dict[str, Any]) -> Any:
    """A transformers config from a mapping, every field checked: transformers itself keeps unknown fields as
    attributes, so a misspelt ``n_layers`` would silently build the default depth."""
    import inspect

    if not isinstance(config, Mapping):
        raise ConfigError(f"must be a mapping (model_type and its fields), got {config!r}.", key="model.config")
    fields = _plain_containers(config)
    model_type = fields.pop("model_type", None)
    known = list(transformers.CONFIG_MAPPING.keys())
    if model_type is None:
        raise ConfigError("is missing: name the architecture, e.g. gpt2, llama or bert.",
                          key="model.config.model_type")
    if model_type not in known:
        raise ConfigError(f"unknown model_type {model_type!r}.{did_you_mean(str(model_type), known)} It is one of "
                          "transformers' CONFIG_MAPPING names (gpt2, llama, bert, ...).", key="model.config.model_type")
    cls = transformers.CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    allowed = set(defaults) | set(getattr(cls, "attribute_map", {}))
    for klass in (cls, transformers.PretrainedConfig):
        allowed |= set(inspect.signature(klass.__init__).parameters) - {"self", "kwargs"}
    allowed |= {"num_labels"}
    for name, value in fields.items():
        if name not in allowed:
            default = (f" It is one of model=hf's GPT-2 defaults (conf/model/hf.yaml): for a {model_type} model, "
                       f"replace the whole mapping, e.g. '~model.config' '+model.config={{model_type:{model_type},"
                       "vocab_size:auto,hidden_size:64,num_hidden_layers:2,num_attention_heads:4}'."
                       if name in HF_GPT2_DEFAULTS and model_type != "gpt2" else "")
            raise ConfigError(f"{cls.__name__} has no field {name!r}.{did_you_mean(name, allowed)}{default}",
                              key=f"model.config.{name}")
        if value == "auto":
            raise ConfigError("is auto, which a hookexp run fills from the data; in Python give a number.",
                              key=f"model.config.{name}")
        default = defaults.get(name)  # what a field whose default is a number or a flag takes
        wanted = unfit({type(default)}, value) if default is not None else None
        if wanted:
            raise ConfigError(f"{cls.__name__} takes {wanted} for {name}, got {value!r}.", key=f"model.config.{name}")
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # transformers' own validation of a value: its whole message, not its first line
        raise ConfigError(f"{cls.__name__} refused the config: {type(e).__name__}: {' '.join(str(e).split())}",
                          key="model.config") from None


def hf(config: dict[str, Any] | None = None, pretrained: str | None = None, kind: str = "causal_lm") -> nn.Module:
    """A ``transformers`` model: from ``config`` (``model_type`` and its fields, e.g. ``{model_type: gpt2,
    n_layer: 2, n_embd: 64, n_head: 4, vocab_size: 256, n_positions: 128}``; random weights, nothing
    downloaded) or ``from_pretrained`` on a local folder (``pretrained``; ``local_files_only``).

    ``kind`` picks the head: causal_lm, sequence_classification (``num_labels`` in the config), masked_lm or
    base. The model takes ``input_ids``/``attention_mask``/``labels`` and returns a ``ModelOutput`` with
    ``.logits``. Needs the extra ``hookexp[hf]``.
    """
    _choice_key("model.kind", kind, tuple(HF_KINDS))
    if (config is None) == (pretrained is None):
        raise ConfigError("give exactly one of model.config (a transformers config mapping) and model.pretrained (a "
                          "local folder); to load a folder set model.config=null.", key="model")
    transformers = _transformers()
    auto = getattr(transformers, HF_KINDS[kind])
    if pretrained is not None:
        folder = Path(str(pretrained)).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"{str(pretrained)!r} is not a folder (looked in {folder.absolute().parent}). Give a "
                              "folder written by save_pretrained; nothing is downloaded.", key="model.pretrained")
        try:
            return auto.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:
            raise ConfigError(f"could not load a {kind} model from {folder}: {type(e).__name__}: {e}",
                              key="model.pretrained") from None
    hf_config = _hf_config(transformers, config)
    try:
        return auto.from_config(hf_config)
    except ValueError as e:  # "Unrecognized configuration class ... for this kind of AutoModel"
        raise ConfigError(f"{hf_config.model_type} has no {kind} model ({str(e).splitlines()[0]}). Use another "
                          f"model.kind ({', '.join(HF_KINDS)}) or model_type.", key="model.kind") from None


def _plain_containers(value: Any) -> Any:
    """Plain dicts and lists (Hydra passes nested config nodes), which transformers' configs serialise."""
    if isinstance(value, Mapping):
        return {str(k): _plain_containers(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain_containers(v) for v in value]
    return value


def _choice_key(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"unknown value {value!r}.{did_you_mean(str(value), choices)} Use one of "
                          f"{', '.join(choices)}.", key=key)
