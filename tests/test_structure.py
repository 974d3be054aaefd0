"""The package's imports follow the flow: no cycles, and a module imports only from its own layer
or a lower one. Every import counts, at module level or inside a function. And its rooms stay a
size a reader can hold: no module over MAX_MODULE_LINES lines, no function (or method) over
MAX_FUNCTION_LINES, counted from its `def` to its last line (decorators apart).

The layer order (lowest first) is the map of the code the README draws.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mpihybrid"

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80

# lowest first; a module belongs to the longest prefix that names it
LAYERS = (
    ("mpihybrid", "mpihybrid._threads", "mpihybrid.files", "mpihybrid.units"),
    ("mpihybrid.comm",),
    ("mpihybrid.nn",),
    ("mpihybrid.trace",),
    ("mpihybrid.pipeline",),
    ("mpihybrid.config",),
    ("mpihybrid.train",),
    ("mpihybrid.analysis",),
    ("mpihybrid.predict",),
    ("mpihybrid.cli", "mpihybrid.__main__"),
)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package by its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, at module level or inside a function: `from
    x import y` counts x.y if it is a module, and x if y is a name of x's own. So `from pkg
    import submodule` in a child of pkg adds no edge to pkg (pkg's __init__ has run anyway),
    while a child that imports a name of its parent's does (a loop if the parent imports it)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                keep = len(parts) - node.level + (path.name == "__init__.py")
                base = ".".join(parts[:keep] + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            owns = any(s not in known for s in subs)  # a name of the package's own
            targets = ([base] if owns else []) + subs
        else:
            continue
        found.update(t for t in targets if t in known)
    found.discard(name)
    return found


def layer(name: str) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    if level is None:
        raise AssertionError(f"{name} belongs to no layer: add it to LAYERS")
    return level


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in sorted(edges.items())
        for b in sorted(targets)
        if layer(b) > layer(a)
    ]


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (cycle := visit(w)):
                return cycle
        path.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state and (cycle := visit(v)):
            return cycle
    return None


def test_every_module_has_a_layer():
    for name in modules():
        layer(name)


def test_imports_only_downward():
    wrong = upward_imports(graph())
    assert not wrong, "imports against the flow:\n" + "\n".join(wrong)


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_catch_a_cycle_and_an_upward_import():
    edges = {"mpihybrid.comm.a": {"mpihybrid.cli.b"}, "mpihybrid.cli.b": {"mpihybrid.comm.a"}}
    assert find_cycle(edges) == ["mpihybrid.cli.b", "mpihybrid.comm.a", "mpihybrid.cli.b"]
    assert upward_imports(edges) == ["mpihybrid.comm.a (layer 1) imports mpihybrid.cli.b (layer 9)"]


def test_a_loop_through_a_parent_and_a_lazy_import_is_seen(tmp_path):
    """config/__init__.py imported config.rules inside a function while rules imported the
    job's classes from config: a child importing its parent's names is an edge, a lazy import
    is one too; `from pkg import submodule` in a child is no edge to pkg."""
    pkg = tmp_path / "mpihybrid" / "pkg"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("def f():\n    from mpihybrid.pkg.rules import check\n")
    (pkg / "rules.py").write_text("from mpihybrid.pkg import Job\n")
    (pkg / "other.py").write_text("from mpihybrid.pkg import rules\nfrom . import rules\n")
    known = modules(pkg.parent)
    edges = {name: imports(name, path, known) for name, path in known.items()}
    assert edges["mpihybrid.pkg.other"] == {"mpihybrid.pkg.rules"}
    assert find_cycle(edges) == ["mpihybrid.pkg", "mpihybrid.pkg.rules", "mpihybrid.pkg"]


def long_modules(root: Path = PACKAGE, limit: int = MAX_MODULE_LINES) -> list[str]:
    """'path: N lines' of every module of the package over `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(root.parent)}: {lines} lines")
    return found


def long_functions(root: Path = PACKAGE, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'path:line name: N lines' of every function or method over `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    where = f"{path.relative_to(root.parent)}:{node.lineno}"
                    found.append(f"{where} {node.name}: {lines} lines")
    return found


def test_no_module_over_the_limit():
    wrong = long_modules()
    assert not wrong, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(wrong)


def test_no_function_over_the_limit():
    wrong = long_functions()
    assert not wrong, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(wrong)


def test_the_length_checks_catch_a_long_module_and_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(4))
    (package / "short.py").write_text(f"def f():\n{body}\n")
    (package / "long.py").write_text(
        "\n".join(["x = 1"] * 7) + f"\n\n\n@staticmethod\ndef g():\n{body}\n"
    )
    assert long_modules(package, limit=6) == ["pkg/long.py: 15 lines"]
    assert long_functions(package, limit=4) == [
        "pkg/long.py:11 g: 5 lines",
        "pkg/short.py:1 f: 5 lines",
    ]
    assert long_functions(package, limit=5) == []


# numba kernels take positional arguments; the runtime's per-action row writers stay rows
POSITIONAL_ALLOWED = {"adamw_update", "layernorm_forward", "rmsnorm_forward", "record", "begin"}
MAX_POSITIONAL = 5  # the charter: keyword-only params past five


def positional_walls(root: Path = PACKAGE, limit: int = MAX_POSITIONAL) -> list[str]:
    """'path:line name: N' of every function taking more than `limit` positional parameters
    (self and cls apart): past five, parameters are keyword-only."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args.posonlyargs + node.args.args
                n = len([a for a in args if a.arg not in ("self", "cls")])
                if n > limit and node.name not in POSITIONAL_ALLOWED:
                    where = f"{path.relative_to(root.parent)}:{node.lineno}"
                    found.append(f"{where} {node.name}: {n}")
    return found


def test_keyword_only_past_five_parameters():
    wrong = positional_walls()
    assert not wrong, "more than five positional parameters:\n" + "\n".join(wrong)
