"""The package's import structure: no cycle, and every import runs down the layers.

Imports are read with `ast` from every module under `captioning/`, including the imports inside
functions (a lazy import is still a dependency, and the cycles this test guards against ran
through them).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "captioning"

#: Layers, lowest first; a module may import only from its own layer or below. Within a layer,
#: `SIBLINGS_APART` pairs of packages must not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("captioning", "captioning.vocab", "captioning.atomic", "captioning.scst", "captioning.cider", "captioning.locks"),
    ("captioning.models", "captioning.data", "captioning.losses", "captioning.viz"),
    ("captioning.metrics", "captioning.pointing", "captioning.objectives",
     "captioning.checkpoint"),
    ("captioning.evaluation",),
    ("captioning.lit_module", "captioning.callbacks"),
    ("captioning.commands",),
    ("captioning.cli", "captioning.__main__"),
)
SIBLINGS_APART = {("captioning.data", "captioning.models"), ("captioning.models", "captioning.data")}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: modules of the package it imports}, for every module under `root`."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                found = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in found:
                while target and target not in files:  # `from pkg import name` -> pkg
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _group(module: str) -> tuple[int, str]:
    """(layer, the LAYERS entry) of a module: its longest matching prefix."""
    best = (-1, "")
    for level, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > len(best[1]):
                best = (level, n)
    if best[0] < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best


def wrong_directions(graph: dict[str, set[str]]) -> list[str]:
    """Imports that run up the layers, or between packages kept apart."""
    bad = []
    for a, targets in sorted(graph.items()):
        la, ga = _group(a)
        for b in sorted(targets):
            lb, gb = _group(b)
            if lb > la:
                bad.append(f"{a} -> {b} (layer {la} imports layer {lb})")
            elif (ga, gb) in SIBLINGS_APART:
                bad.append(f"{a} -> {b} ({ga} must not import {gb})")
    return bad


def private_imports(root: Path, *others: Path) -> list[str]:
    """`from captioning.x import _name`, or `m._name` for a module m of the package, in the
    package (`root`) and the files under `others` (the tests, the scripts): private names stay
    in their module."""
    bad = []
    for path in sorted(p for base in (root, *others) for p in base.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        modules: dict[str, str] = {}  # local name -> the package's module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("captioning"):
                bad += [f"{path.relative_to(root.parent)}: {node.module}.{a.name}"
                        for a in node.names if a.name.startswith("_")]
                modules.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                                if _is_module(root, f"{node.module}.{a.name}")})
            elif isinstance(node, ast.Import):
                modules.update({a.asname: a.name for a in node.names
                                if a.asname and a.name.startswith("captioning.")})
        bad += [f"{path.relative_to(root.parent)}: {modules[n.value.id]}.{n.attr}"
                for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id in modules
                and n.attr.startswith("_") and not n.attr.startswith("__")]
    return bad


def _is_module(root: Path, dotted: str) -> bool:
    path = root.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(import_graph(PACKAGE)) == []


def test_imports_run_down_the_layers() -> None:
    assert wrong_directions(import_graph(PACKAGE)) == []


def test_no_module_imports_another_modules_private_names() -> None:
    assert private_imports(PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "scripts") == []


def _write(root: Path, files: Iterable[tuple[str, str]]) -> Path:
    for rel, text in files:
        path = root / "captioning" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "captioning"


@pytest.mark.parametrize("lazy", [False, True])
def test_a_cycle_is_caught(tmp_path: Path, lazy: bool) -> None:
    back = "def f():\n    from captioning.cli import main\n" if lazy else "import captioning.cli\n"
    root = _write(tmp_path, [
        ("__init__.py", ""), ("cli.py", "from captioning.commands.demo import main\n"),
        ("commands/__init__.py", ""), ("commands/demo.py", "from captioning.data import features\n"),
        ("data/__init__.py", ""), ("data/features.py", back)])
    graph = import_graph(root)
    assert cycles(graph) == [["captioning.cli", "captioning.commands.demo",
                              "captioning.data.features"]]
    assert "captioning.data.features -> captioning.cli (layer 1 imports layer 6)" in \
        wrong_directions(graph)


def test_an_upward_import_and_a_private_name_are_caught(tmp_path: Path) -> None:
    root = _write(tmp_path, [
        ("__init__.py", ""), ("metrics.py", "def _helper():\n    pass\n"),
        ("data/__init__.py", ""), ("data/datamodule.py", "from captioning.metrics import _helper\n"),
        ("models/__init__.py", ""), ("models/encoder.py", "import captioning.data.datamodule\n")])
    graph = import_graph(root)
    assert cycles(graph) == []
    assert wrong_directions(graph) == [
        "captioning.data.datamodule -> captioning.metrics (layer 1 imports layer 2)",
        "captioning.models.encoder -> captioning.data.datamodule "
        "(captioning.models must not import captioning.data)"]
    assert private_imports(root) == ["captioning/data/datamodule.py: captioning.metrics._helper"]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "from captioning import metrics\nimport captioning.data.datamodule as dm\n"
        "metrics._helper()\nmetrics.__name__\ndm._x\n")
    assert sorted(private_imports(root, tmp_path / "tests")[1:]) == [
        "tests/test_x.py: captioning.data.datamodule._x",
        "tests/test_x.py: captioning.metrics._helper"]


#: Functions allowed past FUNCTION_LINES: the search and the teacher-forced pass read best whole.
LONG_FUNCTIONS = {("captioning/models/decoding.py", "beam_search"),
                  ("captioning/models/decoder.py", "forward")}
FILE_LINES, FUNCTION_LINES = 450, 60


def test_files_and_functions_stay_small() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        text = path.read_text()
        if text.count("\n") > FILE_LINES:
            too_long.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                    (rel, node.name) not in LONG_FUNCTIONS and \
                    node.end_lineno - node.lineno + 1 > FUNCTION_LINES:
                too_long.append(f"{rel}:{node.lineno} {node.name}")
    assert too_long == []
    assert (PACKAGE / "lit_module.py").read_text().count("\n") <= 300  # a thin LightningModule
