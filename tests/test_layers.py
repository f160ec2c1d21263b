"""The layers import downward only: cli -> app -> sessions -> engine, app -> store."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import quipu

pytestmark = pytest.mark.quick  # (the quick set: `python -m pytest -m quick`)

ROOT = Path(quipu.__file__).parent
# What each package may import from quipu, beyond itself and the shared modules.
SHARED = {"quipu", "quipu.errors", "quipu.paths", "quipu.config", "quipu.models", "quipu.gguf", "quipu.shown",
          "quipu.options"}
ALLOWED = {
    "engine": set(),
    "sessions": {"engine"},
    "store": set(),
    "app": {"sessions", "store", "engine"},
    "serve": {"app", "sessions"},
    "cli": {"app", "serve"},
}


def quipu_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n == "quipu" or n.startswith("quipu.")}


def test_each_package_imports_only_the_layers_below_it():
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).glob("*.py")):
            for name in quipu_imports(path):
                if name in SHARED or name.startswith(f"quipu.{package}"):
                    continue
                if not any(name == f"quipu.{a}" or name.startswith(f"quipu.{a}.") for a in allowed):
                    wrong.append(f"{package}/{path.name} imports {name}")
    assert not wrong


def test_the_shared_modules_import_no_layer():
    for name in ("errors", "paths", "config", "models", "gguf", "shown", "options"):
        for imported in quipu_imports(ROOT / f"{name}.py"):
            assert imported in SHARED, f"{name}.py imports {imported}"


def test_every_package_says_where_things_live():
    for package in ALLOWED:
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        if package not in ("cli",):
            modules = {p.stem for p in (ROOT / package).glob("*.py")} - {"__init__"}
            assert doc and all(f"{m}.py" in doc for m in modules), package


def test_no_import_circles():
    # Between modules, wherever the import stands (a lazy one inside a function included): a
    # circle means two modules each need the other, and neither can be read alone.
    paths = {("quipu." + ".".join(p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
             for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from quipu.x import y` imports module quipu.x.y when there is one, else quipu.x
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(paths)
                deps |= subs or {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {n for n in deps if n in paths and n not in (name, "quipu")}
    seen, on_path, circles = set(), [], []

    def visit(m):
        if m in on_path:
            circles.append(on_path[on_path.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        on_path.pop()

    for m in sorted(graph):
        visit(m)
    assert not circles, circles


def test_the_server_answers_through_the_one_turn_path_in_short_functions():
    # (its requests are turns `app/served.py` runs through `app/turns.py`: no turn, conversation or
    # session of its own assembly; and none of its functions is a page long)
    for path in sorted((ROOT / "serve").glob("*.py")):
        tree = ast.parse(path.read_text())
        made = {node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                for node in ast.walk(tree) if isinstance(node, ast.Call)}
        assert not made & {"Turn", "InferenceSession", "NamedSession"}, path.name
        assert "Conversation" not in path.read_text(), path.name
        long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno >= 80]
        assert not long, (path.name, long)
