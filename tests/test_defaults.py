"""Every default once: the config dataclasses (hookexp/config.py, and HookSpec in hookexp/engine/schema.py) hold
them, and the code reads them. For each field with a default, the package is searched (with ``ast``) for a second
literal of it: a parameter of the same name (or its known alias) defaulting to the same value, a class attribute
of that name set to it, or ``.get("<field>", <value>)``."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hookexp import config
from hookexp.engine.schema import HookSpec

PACKAGE = Path(__file__).parent.parent / "hookexp"
HOME = {config.__file__, str(PACKAGE / "engine" / "schema.py")}  # where the defaults are written
# a field's name where the code spells it otherwise (watch(optimizer_state=...), GradientNoiseScale(ema=...))
ALIASES = {"gns_ema": ("ema",), "optimizer": ("optimizer_state",), "hist_bins": (), "init_timeout": ("timeout",)}
# defaults too common to grep for (a second 0, 1, None, True or an empty list means nothing)
TRIVIAL = (None, True, False, 0, 1, 0.0, 1.0, "", ())


def defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING and not any(
                f.default == t and type(f.default) is type(t) for t in TRIVIAL):
            out[f.name] = f.default
    return out


def literal(node: ast.AST | None) -> Any:
    try:
        return ast.literal_eval(node) if node is not None else dataclasses.MISSING
    except ValueError:
        return dataclasses.MISSING


def same(a: Any, b: Any) -> bool:
    return a is not dataclasses.MISSING and type(a) is type(b) and a == b


def second_literals(fields: dict[str, Any]) -> list[str]:
    """``file:line name=value`` for every other place that writes one of ``fields``' defaults."""
    names = {alias: name for name in fields for alias in (name, *ALIASES.get(name, ()))}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if str(path) in HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            pairs: list[tuple[str, ast.AST | None]] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                positional = [*a.posonlyargs, *a.args]
                named = [p.arg for p in positional[len(positional) - len(a.defaults):]]
                pairs += list(zip(named, a.defaults, strict=True))
                pairs += [(p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                pairs.append((node.target.id, node.value))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)):
                pairs.append((node.args[0].value, node.args[1]))
            for name, value in pairs:
                if name in names and same(literal(value), fields[names[name]]):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name}={fields[names[name]]!r}")
    return sorted(found, key=lambda s: (s.split(":")[0], int(s.split(":")[1].split()[0]), s))


CLASSES = [config.TrainerConfig, config.FsdpConfig, config.StatsConfig, config.GuardConfig, config.LoggerConfig,
           config.ReproConfig, config.HookexpConfig, config.SpikeConfig, config.ForensicsConfig, HookSpec]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_default_is_written_once(cls: type):
    assert second_literals(defaults(cls)) == []


def test_the_noise_scale_ema_is_read_from_stats_config():
    """The EMA was written four times (config, the trainer's observers, gns.py, watch.py)."""
    assert defaults(config.StatsConfig)["gns_ema"] == 0.95
    assert second_literals({"gns_ema": 0.95}) == []


def test_the_search_finds_a_second_literal(tmp_path: Path, monkeypatch):
    """The check itself: a parameter, a class attribute and a .get() restating a default are all found."""
    fake = tmp_path / "hookexp"
    fake.mkdir()
    (fake / "x.py").write_text("class R:\n    window: int = 20\n\n\ndef f(ema=0.95, *, steps=10):\n"
                               "    return {}.get('threshold', 3.0)\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert second_literals({"window": 20, "gns_ema": 0.95, "steps": 10, "threshold": 3.0}) == [
        "x.py:2 window=20", "x.py:5 ema=0.95", "x.py:5 steps=10", "x.py:6 threshold=3.0"]
