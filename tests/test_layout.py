"""The code stays readable in an afternoon: short functions, modules of one
concern, no reaching into another module's private names, tools that are thin
scripts over the package (issue 17's rules, checked on every file), and a
package on floors whose imports only go down, without cycles (issue 34)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import REPO

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
# The commented defaults: one key after another, a comment above each.
LONG_MODULES_ALLOWED = {"distribuuuu/config/defaults.py"}
# The floors of the package (docs/code-layout.md): a module imports from the
# floors below its own, and from its own floor where no cycle forms.
FLOORS = {
    "errors": 0, "fileio": 0, "logger": 0, "__init__": 0,
    "config": 1, "dist": 1,
    "checkpoint": 2, "reporting": 2,
    "models": 3, "data": 3, "optim": 3,
    "strategies": 4, "inference": 4,
    "engine": 5, "plan": 5, "bench": 5,
    "cli": 6, "job": 6, "preflight": 6,
}  # fmt: skip
MAX_TOP_LEVEL_MODULES = 8
# The config tree stops at the engine: config/, the engine's spec builders and
# the few modules above them name it; everything else takes specs.
MAX_FILES_WITH_CFG = 15
MAX_FMT_SKIPS = 10  # for tables only


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


# --------------------------------------------------------------------------- #
# Floors and cycles
# --------------------------------------------------------------------------- #
def _package_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package under ``root``."""
    files = root.glob("distribuuuu/**/*.py")
    return {_module_name(str(path.relative_to(root))): path for path in files}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (annotations only)."""
    exempt = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            exempt.update(id(inner) for part in node.body for inner in ast.walk(part))
    return exempt


def _imported(node: ast.AST, modules: dict) -> list[str]:
    """The modules of ours that an import statement reaches."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    if not isinstance(node, ast.ImportFrom) or node.level or node.module not in modules:
        return []
    found = [f"{node.module}.{alias.name}" for alias in node.names]
    return [name if name in modules else node.module for name in found]


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line}, imports inside functions
    included (lazy only in time), ``TYPE_CHECKING`` ones left out."""
    modules = _package_modules(root)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        exempt, edges = _type_checking_only(tree), {}
        for node in ast.walk(tree):
            if id(node) not in exempt:
                for target in _imported(node, modules):
                    if target != name:
                        edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1] if len(parts) > 1 else "__init__")


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a module on a higher floor than the importer's."""
    return [
        f"{source}:{line} imports {target} (floor {_floor(source)} -> {_floor(target)})"
        for source, edges in sorted(graph.items())
        for target, line in edges.items()
        if _floor(target) > _floor(source)
    ]


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_every_module_is_on_a_floor():
    graph = import_graph(Path(REPO))
    homeless = sorted(module for module in graph if _floor(module) is None)
    assert not homeless, f"{homeless}: add their package to FLOORS"


def test_imports_only_go_down():
    found = upward_imports(import_graph(Path(REPO)))
    assert not found, "\n".join(found)


def test_no_import_cycle():
    cycles = import_cycles(import_graph(Path(REPO)))
    assert not cycles, f"import cycles: {cycles}"


def test_the_package_keeps_few_modules_at_its_top():
    top = sorted(path.name for path in Path(REPO, "distribuuuu").glob("*.py"))
    top.remove("__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules: {top}"


def test_the_floor_checks_can_fail(tmp_path):
    """A lazy import of a higher floor is found, and so is a cycle closed by
    a lazy import; an import for annotations only is neither."""
    package = tmp_path / "distribuuuu"
    (package / "config").mkdir(parents=True)
    (package / "engine").mkdir()
    (package / "config" / "__init__.py").write_text(
        "def f():\n    from distribuuuu.engine import loop\n"
    )
    (package / "engine" / "__init__.py").write_text("")
    (package / "engine" / "loop.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from distribuuuu import job\nfrom distribuuuu.engine import state\n"
    )
    (package / "engine" / "state.py").write_text(
        "def g():\n    import distribuuuu.engine.loop\n"
    )
    (package / "job.py").write_text("")
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == [
        "distribuuuu.config:2 imports distribuuuu.engine.loop (floor 1 -> 5)"
    ]
    assert import_cycles(graph) == [
        ["distribuuuu.engine.loop", "distribuuuu.engine.state"]
    ]


# --------------------------------------------------------------------------- #
# The config stops at the engine; formatting is skipped for tables only
# --------------------------------------------------------------------------- #
def names_the_config(tree: ast.Module) -> bool:
    """Whether a module names the config tree: ``CfgNode``, or a parameter or
    variable named ``cfg`` (a checkpoint's "cfg" key is a string, not one)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg == "cfg":
            return True
        if isinstance(node, ast.Name) and node.id in ("cfg", "CfgNode"):
            return True
        if isinstance(node, ast.alias) and node.name.endswith("CfgNode"):
            return True
    return False


def test_few_modules_name_the_config():
    package = [path for path in _sources() if path.startswith("distribuuuu/")]
    naming = [path for path in package if names_the_config(_tree(path))]
    assert len(naming) <= MAX_FILES_WITH_CFG, f"{len(naming)} files: {naming}"


def test_formatting_is_skipped_for_tables_only():
    package = [path for path in _sources() if path.startswith("distribuuuu/")]
    skips = {
        path: Path(REPO, path).read_text().count("# fmt: skip") for path in package
    }
    total = sum(skips.values())
    assert total <= MAX_FMT_SKIPS, {path: n for path, n in skips.items() if n}


def test_the_config_check_can_fail():
    assert names_the_config(ast.parse("def f(cfg):\n    pass\n"))
    assert names_the_config(ast.parse("from yacs.config import CfgNode\n"))
    assert not names_the_config(ast.parse("state = {'cfg': dump}\n"))
