"""The package's import graph, file by file, read with ``ast`` (module-level imports and those inside
functions alike): no circle, and no module imports from a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "hookexp"

# the old import paths (issue 26.5 moved them), kept for users: each is the new module under its old name
SHIMS = ("hookexp.tasks", "hookexp.models", "hookexp.data", "hookexp.schedules", "hookexp.report", "hookexp.ablate",
         "hookexp.plots", "hookexp.sinks")

# lowest first; a module may import from its own layer and the layers below
LAYERS = [
    ("hookexp.errors",),
    ("hookexp.goals",),
    ("hookexp.engine",),
    ("hookexp.config",),  # the config schema and its checks (hook specs' fields from hookexp.engine.schema)
    ("hookexp.telemetry",),  # takes the stats and guard configs
    ("hookexp.workloads",),  # tasks, models, data, schedules
    ("hookexp.run.sinks", "hookexp.analysis.plots"),  # the trainer writes through the sinks and draws a plot
    ("hookexp.run",),
    ("hookexp.analysis",),  # report, ablate
    ("hookexp.integrations", "hookexp.cli", "hookexp.__main__", "hookexp.conf", "hookexp"),
    SHIMS,  # highest: each imports the module it stands for, and nothing imports them
]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts).removesuffix(".__init__")] = path
    return found


def imports() -> dict[str, set[str]]:
    """Each module's hookexp imports, as module names (``from pkg import submodule`` is the submodule)."""
    mods = modules()

    def resolve(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    above = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*above, *filter(None, [base])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            graph[name].update(t for t in map(resolve, targets) if t.startswith("hookexp") and t != name)
    return graph


def layer(module: str) -> int:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (rank, len(prefix))
    assert best is not None, f"{module} is in no layer of tests/test_layout.py"
    return best[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_in_a_circle():
    assert cycles(imports()) == []


def test_no_module_imports_from_a_layer_above():
    graph = imports()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if layer(t) > layer(m))
    assert upward == []


def test_nothing_in_the_package_imports_an_old_path():
    """The modules left at the old paths (``hookexp.tasks``, ``hookexp.sinks``, ...) are for users; hookexp's own
    modules import the new ones, so that the shims can go without breaking anything inside."""
    graph = imports()
    assert sorted(m for m in graph if m in SHIMS) == sorted(SHIMS)
    assert sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if t in SHIMS) == []


def test_the_checks_find_a_circle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("hookexp.engine.kinds") < layer("hookexp.telemetry.probes") < layer("hookexp.run.trainer")
