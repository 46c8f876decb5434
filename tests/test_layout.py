"""The package's import graph, file by file, read with ``ast`` (module-level imports and those inside
functions alike): no circle, and no module imports from a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "hookexp"

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
    ("hookexp.integrations", "hookexp.cli", "hookexp.__main__", "hookexp.report", "hookexp.conf", "hookexp"),
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


def test_the_checks_find_a_circle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("hookexp.engine.kinds") < layer("hookexp.telemetry.probes") < layer("hookexp.run.trainer")


# -- the size of a signature, one meaning per name, short module docstrings ------------------------------------------
def definitions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A function's named parameters, keyword-only ones too, without ``self``/``cls`` (``*args``/``**kwargs``
    not counted)."""
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return names[1:] if names and names[0] in ("self", "cls") else names


def long_signatures(files: list[Path]) -> list[str]:
    return [f"{path.relative_to(PACKAGE)}:{fn.lineno} {fn.name}({', '.join(parameters(fn))})"
            for path in files for fn in definitions(path) if len(parameters(fn)) > 5]


def layer_files(*folders: str, skip: tuple[str, ...] = ()) -> list[Path]:
    return sorted(p for folder in folders for p in (PACKAGE / folder).rglob("*.py")
                  if str(p.relative_to(PACKAGE)) not in skip)


def test_no_function_in_run_or_telemetry_takes_more_than_five_parameters():
    """More than five: the settings belong in an object (a config dataclass, a small options dataclass)."""
    assert long_signatures(layer_files("run", "telemetry", )) == []



def test_the_signature_check_counts_keyword_only_parameters_and_not_self():
    fn = ast.parse("def f(self, a, b, /, c, *args, d, e, f, **kw): pass").body[0]
    assert parameters(fn) == ["a", "b", "c", "d", "e", "f"]  # type: ignore[arg-type]


# Names defined at module level in more than one module, each with the reason it is one meaning.
SAME_MEANING = {
    "HookexpCallback": "the callback of each framework (integrations/lightning.py, integrations/hf.py): one role",
    "__dir__": "the lazy exports of a package (hookexp, hookexp.engine): one protocol",
    "__getattr__": "the lazy exports of a package (hookexp, hookexp.engine): one protocol",
    "_EXPORTS": "the lazy exports of a package (hookexp, hookexp.engine): one protocol",
    "main": "the entry point of a console command (cli, report, ablate)",
}


def module_level_names(files: list[Path]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in files:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                continue
            for name in names:
                if name not in ("__all__", "log"):  # the export list and each module's own logger
                    found.setdefault(name, []).append(str(path.relative_to(PACKAGE)))
    return found


def twice(files: list[Path]) -> dict[str, list[str]]:
    return {name: paths for name, paths in module_level_names(files).items()
            if len(paths) > 1 and name not in SAME_MEANING}


def test_no_name_is_defined_twice_in_run_telemetry_integrations_and_config():
    assert twice([*layer_files("run", "telemetry", "integrations", ), PACKAGE / "config.py"]) == {}


def test_no_name_is_defined_twice_across_the_package():
    assert twice(sorted(PACKAGE.rglob("*.py"))) == {}

