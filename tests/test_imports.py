"""eyas's import graph is the one a reader sees: every import at the top of its file, and no
circles among eyas's modules.

The imports that may wait inside a function are those of optional, heavy dependencies: vLLM,
pyarrow (the `data` extra, for parquet and Arrow sources) and tensorboard (written to only
when it is installed). Inside the vLLM adapter (eyas.vllm, which `eyas capture --help`
imports) torch, safetensors and the adapter's own torch-loading modules wait too, until a
vLLM backend is used. The CLI
modules name a stage's run module as a string (`importlib.import_module`), so that
`eyas --help` stays free of torch; those strings count as imports below.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ADAPTER = "eyas.vllm"
OPTIONAL = ("vllm", "pyarrow", "torch.utils.tensorboard")
ADAPTER_LAZY = (*OPTIONAL, "torch", "safetensors", ADAPTER)


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted((SRC / "eyas").rglob("*.py"))}


def _lazy_exports(tree: ast.Module) -> dict[str, str]:
    """name -> submodule, from a package __init__'s `lazy_exports(__name__, {...})`."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
            table = ast.literal_eval(node.args[1])
            out.update({name: module for module, names in table.items() for name in names})
    return out


LAZY = {name: _lazy_exports(ast.parse(path.read_text())) for name, path in MODULES.items() if path.name == "__init__.py"}


def _targets(node: ast.AST, here: str) -> list[str]:
    """The eyas modules an import statement (or `importlib.import_module("...")`) loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        assert not node.level, f"{here}: eyas imports by absolute names"
        base = node.module
        out = []
        for a in node.names:
            if f"{base}.{a.name}" in MODULES:
                out.append(f"{base}.{a.name}")
            else:
                out.append(LAZY.get(base, {}).get(a.name, base))
        return out
    return [node.args[0].value]  # importlib.import_module("eyas....")


def _imports(path: Path):
    """(node, inside a function, target modules) for every import of the file."""
    here = _module(path)
    found = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            is_call = (isinstance(child, ast.Call) and getattr(child.func, "attr", None) == "import_module"
                       and child.args and isinstance(child.args[0], ast.Constant)
                       and str(child.args[0].value).startswith("eyas"))
            if isinstance(child, (ast.Import, ast.ImportFrom)) or is_call:
                found.append((child, in_function, _targets(child, here)))
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(path.read_text()), False)
    return found


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_imports_are_at_the_top_of_each_file_but_vllms():
    hidden = []
    for name, path in MODULES.items():
        for node, in_function, targets in _imports(path):
            if not in_function or isinstance(node, ast.Call):
                continue
            in_adapter = name == ADAPTER or name.startswith(ADAPTER + ".")
            if all(_within(t, ADAPTER_LAZY if in_adapter else OPTIONAL) for t in targets):
                continue
            hidden.append(f"{path.relative_to(SRC)}:{node.lineno} imports {', '.join(targets)} inside a function")
    assert hidden == []


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for _, _, targets in _imports(path):
            for t in targets:
                while t and t not in MODULES and "." in t:  # `import eyas.x.y as z`, a name of a module
                    t = t.rpartition(".")[0]
                if t in MODULES and t != name:
                    graph[name].add(t)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circles():
    assert _circles(_graph()) == []


def test_the_circle_finder_finds_a_circle():
    """The check above could fail: a circle of three and a tail are found as one circle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
