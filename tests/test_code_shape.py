"""The package stays readable: no function over 80 lines of code, and the model runner
mixin (vLLM's overrides only) at most 300 lines.

Lines of code are a function's body lines that are neither blank nor comments, its
docstring excluded. Every ``.py`` of the packages listed in ``pyproject.toml`` counts
(``kvcompress``, its sub-packages, and ``kvcompress.patches`` in ``patches/``).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_RUNNER_LINES = 300


def _package_files() -> list[Path]:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools.get("package-dir", {})
    files = []
    for package in setuptools["packages"]:
        folder = ROOT / mapped.get(package, package.replace(".", "/"))
        files.extend(sorted(folder.glob("*.py")))
    return files


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef, source_lines: list[str]) -> int:
    """Non-blank, non-comment lines of ``function``'s body after its docstring."""
    body = function.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if not body:
        return 0
    lines = source_lines[body[0].lineno - 1: function.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def long_functions(path: Path, limit: int) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            count = code_lines(node, lines)
            if count > limit:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({count} lines)")
    return found


def test_the_counter_skips_docstrings_comments_and_blanks():
    source = 'def f():\n    """doc\n    more"""\n    # why\n\n    a = 1\n    return a\n'
    function = ast.parse(source).body[0]
    assert code_lines(function, source.splitlines()) == 2
    nested = "def g():\n    def h():\n        return 1\n    return h\n"
    assert code_lines(ast.parse(nested).body[0], nested.splitlines()) == 3


def test_no_function_over_80_lines_of_code():
    files = _package_files()
    assert any(path.name == "runner.py" for path in files) and len(files) > 40
    found = [hit for path in files for hit in long_functions(path, MAX_FUNCTION_LINES)]
    assert not found, "functions over 80 lines of code:\n" + "\n".join(found)


def test_the_runner_holds_only_vllm_overrides():
    lines = (ROOT / "kvcompress" / "vllm_glue" / "runner.py").read_text().splitlines()
    assert len(lines) <= MAX_RUNNER_LINES, f"runner.py has {len(lines)} lines"
