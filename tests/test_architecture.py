"""ARCHITECTURE.md's "Where each concern lives" table names the file of every module of the process packages and of
specrelay/, and every module opens with a docstring naming its one concern: a module nobody can find in the map is a
module a newcomer reads the whole tree to find. Plus the import rules and the 60-line function limit."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("broker", "cloud_worker", "edge_worker", "common", "specrelay", "specrelay/bench")
MIN_CONCERN_CHARS = 20  # a first docstring line shorter than this cannot say what a module holds


def _files() -> list[Path]:
    """Every .py file of the folders, their subpackages included (edge_worker/http/, edge_worker/trees/, ...)."""
    return sorted({path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")})


def _modules() -> list[str]:
    return [str(path.relative_to(ROOT)) for path in _files() if path.name not in ("__init__.py", "__main__.py")]


def concern_table(text: str) -> dict[str, str]:
    """The "Where each concern lives" table of ARCHITECTURE.md: every file its second column names -> that row's
    concern."""
    section = text.split("## Where each concern lives", 1)[1].split("\n## ", 1)[0]
    files = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= {"-", " "} or cells[0] == "concern":
            continue
        for path in re.findall(r"`([\w/]+\.py)`", cells[-1]):
            files[path] = cells[0]
    return files


def test_the_concern_table_is_read():
    table = concern_table((ROOT / "ARCHITECTURE.md").read_text())
    assert table["common/protocol.py"].startswith("wire protocol")
    assert concern_table("## Where each concern lives\n\n| concern | the one file |\n|---|---|\n| x | `a/b.py` / `c.py` |\n"
                         "\n## Next\n| y | `d.py` |") == {"a/b.py": "x", "c.py": "x"}


def test_every_file_the_concern_table_names_exists():
    gone = sorted(path for path in concern_table((ROOT / "ARCHITECTURE.md").read_text()) if not (ROOT / path).is_file())
    assert not gone, f"ARCHITECTURE.md's concern table names files that do not exist: {gone}"


def test_every_module_has_a_row_in_the_concern_table():
    table = concern_table((ROOT / "ARCHITECTURE.md").read_text())
    missing = [module for module in _modules() if module not in table]
    assert not missing, f"modules without a row in ARCHITECTURE.md's 'Where each concern lives': {missing}"


def test_every_module_is_named_in_the_package_list():
    text = (ROOT / "ARCHITECTURE.md").read_text().split("## Where each concern lives", 1)[0]
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    missing = [m for m in _modules() if Path(m).stem not in words]
    assert not missing, f"modules not named in ARCHITECTURE.md's packages: {missing}"


def test_every_module_opens_with_a_docstring_naming_its_concern():
    """First statement a docstring, its first line a sentence of what the module holds; not a line count (a module
    split "to stay under N lines" is split by size, not by concern)."""
    wrong = []
    for path in _files():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.strip().split("\n", 1)[0]
        if len(first) < MIN_CONCERN_CHARS or re.search(r"\b\d+ lines\b", doc):
            wrong.append(f"{path.relative_to(ROOT)}: {first!r}")
    assert not wrong, f"modules whose docstring does not open by naming their concern: {wrong}"


# ------------------------------------------------------------------------------------------ the import graph

PACKAGES = {"specrelay": "specrelay", "specrelay.bench": "specrelay/bench", "specrelay.common": "common",
            "specrelay.broker": "broker", "specrelay.edge_worker": "edge_worker",
            "specrelay.cloud_worker": "cloud_worker"}  # pyproject.toml's package-dir
PROCESS_PACKAGES = ("specrelay.broker", "specrelay.cloud_worker", "specrelay.edge_worker")
MAX_FUNCTION_LINES = 60  # past this a function holds more than one step: split it


def _sources() -> dict[str, Path]:
    """Every module of the installed `specrelay` package by its dotted name (packages by their own name)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if package == "specrelay" and parts[0] == "bench":
                continue  # specrelay.bench is its own entry
            dotted = ".".join((package,) + parts)
            out[dotted.removesuffix(".__init__")] = path
    return out


def _imported(module: str, path: Path, names: set[str]) -> set[str]:
    """The package's modules that `module` imports anywhere in its source: at module level, inside functions,
    relative imports resolved; `from X import y` counts X.y when that is a module, else X."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            found |= {f"{source}.{alias.name}" if f"{source}.{alias.name}" in names else source
                      for alias in node.names}
    return {name for name in found if name in names and name != module}


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    return {module: _imported(module, path, set(sources)) for module, path in sources.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (depth-first search, three colours), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    graph = _graph()
    assert "specrelay.edge_worker.server" in graph["specrelay.cli"]  # inside cmd_edge_worker, relative
    assert "specrelay.common.protocol" in graph["specrelay.edge_worker.frontend"]  # `from ..common import protocol`
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_counting_imports_inside_functions():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_common_imports_no_process_package():
    wrong = sorted(f"{module} -> {target}" for module, targets in _graph().items()
                   if module.startswith("specrelay.common") for target in targets
                   if target.startswith(PROCESS_PACKAGES))
    assert not wrong, f"common/ imports a process package: {wrong}"


def test_the_graph_sees_subpackages():
    graph = _graph()
    assert "specrelay.edge_worker.draft.drafter" in graph["specrelay.edge_worker.trees.rounds"]  # `from ..draft...`
    assert "specrelay.edge_worker.http.server" in graph["specrelay.onebox"]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a process package (broker, cloud_worker, edge_worker) of specrelay's own top-level modules
    (cli, defaults, runtime, ...): the layering is bench -> specrelay -> process packages -> common, one way."""
    top = {name for name in graph if name.count(".") == 1 and not name.startswith(
        ("specrelay.bench", "specrelay.common", "specrelay.broker", "specrelay.edge_worker", "specrelay.cloud_worker"))}
    return sorted(f"{module} -> {target}" for module, targets in graph.items() if module.startswith(PROCESS_PACKAGES)
                  for target in targets if target in top)


def test_process_packages_never_import_specrelay_top_level_modules():
    assert upward_imports({"specrelay.edge_worker.server": {"specrelay.runtime"}, "specrelay.runtime": set()}) == \
        ["specrelay.edge_worker.server -> specrelay.runtime"]
    wrong = upward_imports(_graph())
    assert not wrong, f"a process package imports specrelay's top level (the arrow points up): {wrong}"


def test_no_function_past_60_lines():
    too_long = []
    for module, path in _sources().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                too_long.append(f"{module}.{node.name}: {length} lines")
    assert not too_long, f"functions past {MAX_FUNCTION_LINES} lines: {too_long}"
