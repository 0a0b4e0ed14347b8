"""No import cycle among the modules of the ``kvcompress`` package.

Every module is parsed with ``ast`` (nothing is imported). An edge ``a -> b`` is any
import of ``b`` anywhere in ``a``: at module level or inside a function (a lazy import
that only hides a cycle counts as one). ``from x import y`` points at ``x.y`` when that
is a module of the package, else at ``x``; relative imports are resolved against the
importing module. Importing a submodule is not counted as importing its parent package,
nor is a compiled module (``kvcompress._C``) a node.
The packages and their folders are read from ``pyproject.toml`` (``kvcompress.patches``
lives in ``patches/``).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _package_dirs() -> dict[str, Path]:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools.get("package-dir", {})
    dirs = {}
    for package in setuptools["packages"]:
        folder = mapped.get(package, package.replace(".", "/"))
        dirs[package] = ROOT / folder
    return dirs


def _modules() -> dict[str, Path]:
    """Module name -> file, for every ``.py`` directly in a listed package folder."""
    modules = {}
    for package, folder in _package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules that ``name`` imports anywhere in its source."""
    is_package = path.stem == "__init__"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = []
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.append(submodule if submodule in modules else base)
        else:
            continue
        # Names outside the package (torch, vllm) and compiled modules (kvcompress._C)
        # are not nodes.
        found.update(target for target in targets if target in modules and target != name)
    return found


def _find_cycle(graph: dict[str, set[str]], within: set[str] | None = None) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]`` (among the nodes ``within``, default all), or None."""
    nodes = set(graph) if within is None else within
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node] & nodes):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(nodes):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def _all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per group of modules that import each other (strongly connected)."""
    reach = {node: _reachable(graph, node) for node in graph}
    groups = {frozenset(n for n in reach[node] if node in reach[n]) for node in graph if node in reach[node]}
    return [_find_cycle(graph, set(group)) for group in sorted(groups, key=sorted)]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Nodes reachable from ``start`` by one or more edges."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    return seen


def test_the_scan_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: function-level and relative imports are edges."""
    modules = {"pkg": tmp_path / "__init__.py", "pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    modules["pkg.a"].write_text("import os\n\ndef f():\n    from pkg import b\n    from . import a\n")
    assert _imports("pkg.a", modules["pkg.a"], modules) == {"pkg.b"}
    modules["pkg.b"].write_text("from .a import f\n")
    assert _imports("pkg.b", modules["pkg.b"], modules) == {"pkg.a"}
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    two = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"e"}, "e": {"d"}}
    assert _all_cycles(two) == [["a", "b", "a"], ["d", "e", "d"]]


def test_kvcompress_has_no_import_cycle():
    modules = _modules()
    assert "kvcompress.ops.dispatch" in modules and "kvcompress.patches" in modules
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = _all_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def _folder(module: str) -> str | None:
    """The package folder a module lives in (``kvcompress.vllm_glue``, ``kvcompress.ops``,
    ``kvcompress.patches``); None for the package root's own modules (the root layer,
    which any folder may import)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or module in _FOLDERS else None


_FOLDERS = ("kvcompress.vllm_glue", "kvcompress.ops", "kvcompress.patches")


def _folder_problems(graph: dict[str, set[str]]) -> list[str]:
    """Folders that import each other (each named with one import of either way), and
    imports of the glue or the patches from the kernel layer ``ops``."""
    edges: dict[tuple[str, str], str] = {}
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            pair = (_folder(name), _folder(target))
            if None not in pair and pair[0] != pair[1]:
                edges.setdefault(pair, f"{name} -> {target}")
    problems = [
        f"{a} and {b} import each other: {edges[(a, b)]}; {edges[(b, a)]}"
        for (a, b) in sorted(edges) if a < b and (b, a) in edges
    ]
    problems += [
        f"the kernel layer imports {b}: {example}"
        for (a, b), example in sorted(edges.items())
        if a == "kvcompress.ops" and b in ("kvcompress.vllm_glue", "kvcompress.patches")
    ]
    return problems


def test_the_folder_check_sees_two_way_imports():
    """The checker itself, on made-up graphs: one import each way between two folders
    is a problem, imports into the root layer are not, and ops may import neither the
    glue nor the patches."""
    graph = {
        "kvcompress.vllm_glue.plugin": {"kvcompress.patches", "kvcompress.config"},
        "kvcompress.patches": {"kvcompress.config"},
        "kvcompress.patches.metrics": {"kvcompress.vllm_glue.metrics"},
        "kvcompress.vllm_glue.metrics": set(),
        "kvcompress.config": {"kvcompress.policies"},
        "kvcompress.policies": set(),
    }
    assert _folder_problems(graph) == [
        "kvcompress.patches and kvcompress.vllm_glue import each other: "
        "kvcompress.patches.metrics -> kvcompress.vllm_glue.metrics; "
        "kvcompress.vllm_glue.plugin -> kvcompress.patches"
    ]
    graph["kvcompress.patches.metrics"] = set()
    assert _folder_problems(graph) == []
    graph["kvcompress.ops.dispatch"] = {"kvcompress.patches"}
    assert _folder_problems(graph) == ["the kernel layer imports kvcompress.patches: kvcompress.ops.dispatch -> kvcompress.patches"]


def test_no_two_folders_import_each_other():
    """Layers, not a web: ``vllm_glue`` uses ``patches`` (the plugin hands them the glue
    functions they call, ``patches.GlueHooks``), never the other way; ``ops`` imports
    neither. The package root's own modules are the layer under all of them."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    problems = _folder_problems(graph)
    assert not problems, "\n".join(problems)


_WITHOUT_VLLM_OR_PYDANTIC = r'''
import importlib.abc, pkgutil, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("vllm", "pydantic"):
            raise ImportError(f"{name} is refused in this check")

sys.meta_path.insert(0, Refuse())
import kvcompress.ops
names = sorted(m.name for m in pkgutil.iter_modules(kvcompress.ops.__path__, "kvcompress.ops."))
for name in names:
    importlib.import_module(name)
print(len(names))
'''


def test_kernel_layer_imports_without_vllm_or_pydantic():
    """A GPU machine with torch alone runs benchmarks/kernels/bench_kernels.py (the H200 run of
    2026-11-26 first failed on ``import kvcompress`` pulling in pydantic): every module of
    ``kvcompress.ops`` imports with vLLM and pydantic refused."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _WITHOUT_VLLM_OR_PYDANTIC], capture_output=True,
                            text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) >= 20  # the op modules were all found and imported
