"""The code stays readable in an afternoon: short functions, modules of one
concern, no reaching into another module's private names, and tools that are
thin scripts over the package (issue 17's rules, checked on every file)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import REPO

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
# The commented defaults: one key after another, a comment above each.
LONG_MODULES_ALLOWED = {"distribuuuu/config/defaults.py"}


def _sources() -> list[str]:
    root = Path(REPO)
    files = [*root.glob("distribuuuu/**/*.py"), *root.glob("tools/*.py")]
    return sorted(str(path.relative_to(root)) for path in files)


def _tree(relative: str) -> ast.Module:
    return ast.parse(Path(REPO, relative).read_text(), relative)


def _module_name(relative: str) -> str:
    return relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _our_imports(tree: ast.Module) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Aliases bound to our modules, and (module, name) of every ``from`` import
    of ours."""
    aliases, names = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("distribuuuu") and alias.asname:
                    aliases[alias.asname] = alias.name
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] in ("distribuuuu", "tools")
        ):
            for alias in node.names:
                names.append((node.module, alias.name))
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases, names


@pytest.mark.parametrize("relative", _sources())
def test_no_function_is_longer_than_60_lines(relative):
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(_tree(relative))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{relative}: {', '.join(long)}"


@pytest.mark.parametrize("relative", _sources())
def test_no_module_is_longer_than_500_lines(relative):
    if relative in LONG_MODULES_ALLOWED:
        return
    lines = len(Path(REPO, relative).read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{relative}: {lines} lines"


@pytest.mark.parametrize("relative", _sources())
def test_no_module_uses_another_modules_private_names(relative):
    tree = _tree(relative)
    own = _module_name(relative)
    aliases, names = _our_imports(tree)
    found = [f"from {module} import {name}" for module, name in names
             if _is_private(name) and module != own]  # fmt: skip
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _is_private(node.attr)
        ):
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
    assert not found, f"{relative}: {', '.join(found)}"


@pytest.mark.parametrize("relative", [p for p in _sources() if p.startswith("tools")])
def test_tools_import_only_the_package(relative):
    _, names = _our_imports(_tree(relative))
    others = [module for module, _ in names if not module.startswith("distribuuuu")]
    others += [m for m, _ in names if m.startswith("distribuuuu.tools")]
    assert not others, f"{relative} imports {others}: tools import only distribuuuu"


def test_every_module_says_what_it_is_for():
    missing = [path for path in _sources() if ast.get_docstring(_tree(path)) is None]
    assert not missing, f"no module docstring: {missing}"


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """A 61-line function and a private name of another module are found."""
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    bad = tmp_path / "distribuuuu" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(
        '"""Bad."""\n\nfrom distribuuuu import checkpoint as cp\n'
        "from distribuuuu.engine.trainer import _hidden\n\n\n"
        f"def long():\n    cp._secret()\n{body}\n"
    )
    monkeypatch.setitem(globals(), "REPO", str(tmp_path))
    with pytest.raises(AssertionError, match="long \\(62 lines"):
        test_no_function_is_longer_than_60_lines("distribuuuu/bad.py")
    with pytest.raises(AssertionError, match="import _hidden, cp._secret"):
        test_no_module_uses_another_modules_private_names("distribuuuu/bad.py")
