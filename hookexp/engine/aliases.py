"""Portable targets: ``@blocks``, ``@attn``, ``@mlp``, ``@embed``, ``@unembed``, ``@norm`` per architecture.

One hook set (``target: "@attn"``) runs unchanged on GPT-2, Llama- and BERT-family models and the package's
models: the table finds the architecture's base module (by class name or a structural test) and names the
aliased modules relative to it, ``N`` for any block index (heads that wrap the base: relative to its parent,
``outer``). What an alias became is in the hook table and the dry run. A model the table does not know is an
error that says how to add an entry::

    hookexp.engine.register_aliases("my_net", classes=["MyNet"],
                                    aliases={"blocks": "layers.N", "attn": "layers.N.attn", ...})
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from hookexp.engine.patterns import compile_pattern
from hookexp.engine.schema import ALIAS_NAMES
from hookexp.errors import RegistryError, did_you_mean

STANDARD = ALIAS_NAMES
Rel = str | Callable[[nn.Module], str]


@dataclass(frozen=True)
class AliasEntry:
    """One architecture of the table. ``aliases`` are relative to the base module (``""``: the base
    itself), ``outer`` to the base's parent (a tuple: the first name that exists). ``notes`` say why an
    alias is missing, for the error message."""

    name: str
    classes: tuple[str, ...]
    detect: Callable[[nn.Module], bool] | None
    aliases: Mapping[str, Rel]
    outer: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    notes: Mapping[str, str] = field(default_factory=dict)

    def matches(self, module: nn.Module) -> bool:
        if self.classes and not {c.__name__ for c in type(module).__mro__} & set(self.classes):
            return False
        return self.detect is None or self.detect(module)

    def names(self) -> list[str]:
        return [*self.aliases, *self.outer]


ALIASES: dict[str, AliasEntry] = {}


def register_aliases(name: str, *, classes: Sequence[str] = (), detect: Callable[[nn.Module], bool] | None = None,
                     aliases: Mapping[str, Rel], outer: Mapping[str, str | tuple[str, ...]] | None = None,
                     notes: Mapping[str, str] | None = None) -> None:
    """Add an architecture to the alias table (entries registered later are tried first).

    ``classes``: class names of the architecture's base module (a base class counts); ``detect``: a test
    on a module instead of (or as well as) the class. ``aliases``: alias name (without ``@``) -> module
    name relative to the base module, ``N`` standing for any block index (``"layers.N.attn"``), or a
    function of the base module returning that name. ``outer``: aliases named relative to the base's
    parent (output heads around a base model, e.g. ``{"unembed": "lm_head"}``).
    """
    if name in ALIASES:
        raise RegistryError(f"an alias table entry named {name!r} is already registered.")
    if not classes and detect is None:
        raise RegistryError(f"alias table entry {name!r} needs 'classes' or 'detect' to recognise its models.")
    keys = [*aliases, *(outer or {})]
    bad = [k for k in keys if not re.fullmatch(r"[A-Za-z_]\w*", k)]
    if bad:
        raise RegistryError(f"alias table entry {name!r}: alias names are identifiers without '@', got {bad}.")
    ALIASES[name] = AliasEntry(name, tuple(classes), detect, dict(aliases), dict(outer or {}), dict(notes or {}))


def known_aliases() -> list[str]:
    names = list(STANDARD)
    for entry in ALIASES.values():
        names += [n for n in entry.names() if n not in names]
    return names


@dataclass(frozen=True)
class Resolved:
    """What ``@alias`` became in one model: the architecture, the module name pattern (``N`` = any block
    index) and the regular expression the targets are matched with."""

    alias: str
    architecture: str
    pattern: str
    regex: str

    def describe(self) -> str:
        return f"{self.alias} = {self.pattern or '(root)'} ({self.architecture})"


def _regex(full: str, on: Literal["module", "parameter"]) -> str:
    parts = [r"\d+" if seg == "N" else re.escape(seg) for seg in full.split(".")] if full else []
    body = r"\.".join(parts)
    if on == "module":
        return f"^{body}$"
    return f"^{body}\\." if body else "^"


def find_architecture(model: nn.Module) -> tuple[AliasEntry, str, nn.Module] | None:
    """The first (outermost) module of ``model`` that an entry recognises: (entry, its name, the module)."""
    entries = list(reversed(ALIASES.values()))
    for name, module in model.named_modules():
        for entry in entries:
            if entry.matches(module):
                return entry, name, module
    return None


def expand(model: nn.Module, alias: str, on: Literal["module", "parameter"], missing_ok: bool = False) -> Resolved:
    """Resolve ``@name`` for ``model``; raises ``LookupError`` with a one-paragraph message, which the caller
    turns into the error of the setting it resolves (a hook spec's TargetError, another key's ConfigError).
    ``missing_ok`` (a spec with ``optional: true``): an alias the model's architecture lacks names nothing, so
    that one portable hook set runs on architectures without, say, a final norm."""
    key = alias.removeprefix("@")
    if key not in known_aliases():
        raise LookupError(f"unknown alias {alias!r}.{did_you_mean('@' + key, ['@' + a for a in known_aliases()])} "
                           f"Aliases: {', '.join('@' + a for a in known_aliases())}.")
    found = find_architecture(model)
    if found is None:
        known = "; ".join(f"{e.name} ({', '.join(e.classes) or 'by structure'})" for e in ALIASES.values())
        raise LookupError(
            f"{type(model).__name__} is not in the alias table, so {alias!r} means nothing for it (entries: {known}). "
            f"Add an entry before attaching: hookexp.engine.register_aliases('my_model', classes=["
            f"'{type(model).__name__}'], aliases={{'blocks': 'layers.N', 'attn': 'layers.N.attn', 'mlp': "
            "'layers.N.mlp', 'embed': 'embed', 'norm': 'norm', 'unembed': 'head'}) with your module names "
            "(N stands for any block index), or name the modules directly.")
    entry, base, module = found
    if key in entry.aliases:
        rel = entry.aliases[key]
        rel = rel(module) if callable(rel) else rel
        full = ".".join(p for p in (base, rel) if p)
    elif key in entry.outer:
        parent = base.rpartition(".")[0]
        candidates = entry.outer[key]
        names = {n for n, _ in model.named_modules()}
        full = ""
        options = (candidates,) if isinstance(candidates, str) else candidates
        for rel in options:
            cand = ".".join(p for p in (parent, rel) if p)
            if any(re.match(_regex(cand, "module"), n) for n in names):
                full = cand
                break
        else:
            if missing_ok:
                return Resolved(alias, entry.name, "(none)", r"(?!)")
            raise LookupError(f"{alias!r} names {' or '.join(repr(c) for c in options)} around the {entry.name} base "
                               f"module {base or '(root)'!r}, and {type(model).__name__} has no such module (a base "
                               "model without an output head).")
    else:
        if missing_ok:
            return Resolved(alias, entry.name, "(none)", r"(?!)")
        note = entry.notes.get(key, "")
        raise LookupError(f"{alias!r} has no meaning for {type(module).__name__} (alias table entry "
                           f"{entry.name!r}){': ' + note if note else ''}. Its aliases: "
                           f"{', '.join('@' + a for a in entry.names())}.")
    return Resolved(alias, entry.name, full, _regex(full, on))


def alias_hint(model: nn.Module, target: str, on: Literal["module", "parameter"]) -> str:
    """When ``target`` matches nothing in ``model`` but names what an alias names in another architecture of the
    table (``blocks.0.attn``: ``@attn`` of the package's GPT) and that alias means something in ``model``: a
    sentence naming the alias, what it became here and, for an exact name, the same module here. Else ``""``."""
    if on != "module" or target.startswith("@"):
        return ""
    exact = not target.startswith("re:") and not any(c in target for c in "*?[")
    pattern = compile_pattern(target)

    def indices(rel: str) -> list[str] | None:
        """The block indices ``target`` gives where it names ``rel`` (under any base module), else None."""
        segs = rel.split(".")
        if not exact:  # a glob or regex: does it take the entry's name (block 0)?
            return [] if pattern(".".join("0" if seg == "N" else seg for seg in segs)) else None
        body = r"\.".join(r"(\d+)" if seg == "N" else re.escape(seg) for seg in segs)
        found = re.search(rf"(?:^|\.){body}$", target)
        return None if found is None else list(found.groups())

    modules = dict(model.named_modules())
    for entry in reversed(ALIASES.values()):
        for key, rel in entry.aliases.items():
            given = indices(rel) if isinstance(rel, str) and rel else None
            if given is None:
                continue
            try:
                here = expand(model, "@" + key, "module")
            except LookupError:
                continue
            if here.architecture == entry.name:  # the model's own layout: a typo or an index, did-you-mean says
                continue
            same = ""
            parts = here.pattern.split(".")
            if exact and parts.count("N") == len(given):
                numbers = iter(given)
                concrete = ".".join(next(numbers) if p == "N" else p for p in parts)
                same = f", or {concrete!r} for this one" if concrete in modules else ""
            return (f" {target!r} is what @{key} names in {entry.name} models; in {type(model).__name__} "
                    f"{here.describe()}: use target '@{key}' (every block, on every architecture){same}.")
    return ""


# ----------------------------------------------------------------------------------------------------
# The table. transformers' families are recognised by their base model's class (a model with a head,
# e.g. GPT2LMHeadModel, contains it); the package's models by their own classes.


def _llama_like(module: nn.Module) -> bool:
    """Llama and the families that copied its layout (Mistral, Qwen2/3, Gemma, OLMo, Phi-3, Granite, ...)."""
    layers = getattr(module, "layers", None)
    return (isinstance(getattr(module, "embed_tokens", None), nn.Module) and isinstance(layers, nn.ModuleList)
            and len(layers) > 0 and hasattr(layers[0], "self_attn") and hasattr(layers[0], "mlp")
            and isinstance(getattr(module, "norm", None), nn.Module))


def _last_linear(module: nn.Module) -> str:
    return [n for n, m in module.named_children() if isinstance(m, nn.Linear)][-1]


register_aliases("gpt2", classes=["GPT2Model"],
                 aliases={"blocks": "h.N", "attn": "h.N.attn", "mlp": "h.N.mlp", "embed": "wte", "norm": "ln_f"},
                 outer={"unembed": "lm_head"})
register_aliases("llama", detect=_llama_like,
                 aliases={"blocks": "layers.N", "attn": "layers.N.self_attn", "mlp": "layers.N.mlp",
                          "embed": "embed_tokens", "norm": "norm"},
                 outer={"unembed": "lm_head"})
register_aliases("bert", classes=["BertModel", "RobertaModel", "XLMRobertaModel"],
                 aliases={"blocks": "encoder.layer.N", "attn": "encoder.layer.N.attention.self",
                          "mlp": "encoder.layer.N.intermediate", "embed": "embeddings.word_embeddings"},
                 outer={"unembed": ("cls.predictions.decoder", "lm_head.decoder")},
                 notes={"norm": "BERT is post-norm: every block ends in its own LayerNorm "
                                "(encoder.layer.N.output.LayerNorm) and there is no final norm"})
register_aliases("hookexp.gpt", classes=["GPT"],
                 detect=lambda m: isinstance(getattr(m, "blocks", None), nn.ModuleList) and hasattr(m, "embed"),
                 aliases={"blocks": "blocks.N", "attn": "blocks.N.attn", "mlp": "blocks.N.mlp", "embed": "embed",
                          "norm": "norm", "unembed": "head"})
register_aliases("hookexp.transformer", classes=["PatchTransformer"],
                 aliases={"blocks": "layers.N", "attn": "layers.N.self_attn", "embed": "embed", "norm": "norm",
                          "unembed": "head"},
                 notes={"mlp": "nn.TransformerEncoderLayer runs its feed-forward inline (linear1, activation, "
                               "linear2), with no module around it; target layers.N.linear1 or layers.N.linear2"})
_CLASSIFIER_NOTE = "a classifier without blocks; it has only @unembed (the output layer)"
for _cls, _head in (("SmallCNN", "fc2"), ("MLP", _last_linear), ("SeedNet", "fc1")):
    register_aliases(f"hookexp.{_cls.lower()}", classes=[_cls],
                     detect=lambda m: type(m).__module__ == "hookexp.workloads.models",
                     aliases={"unembed": _head},
                     notes={a: _CLASSIFIER_NOTE for a in STANDARD if a != "unembed"})
