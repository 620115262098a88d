"""The packages' layout: each imports alone, no module imports another that imports it back
(directly or round a loop), and the rooms keep their walls (docs/architecture.md)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "engine", "worker", "streamvqa", "demo_training", "bench")


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(modules: dict[str, Path], annotations: bool = False) -> dict[str, set[str]]:
    """Module -> the project's modules it imports anywhere in its text (a lazy import counts; one
    under `if TYPE_CHECKING:`, for annotations only and never run, only with `annotations`)."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        tree = ast.parse(path.read_text())
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if not annotations and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for statement in node.body
            for inner in ast.walk(statement)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            elif isinstance(node, ast.Import):
                found |= {known(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                found |= {known(f"{base}.{alias.name}") or known(base) for alias in node.names}
        graph[name] = found - {None, name}
    return graph


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                loops.append(sorted(group))

    for module in graph:
        if module not in index:
            visit(module)
    return loops


def test_no_module_imports_one_that_imports_it_back():
    graph = _imports(_modules())
    assert len(graph) > 80  # every module was read
    assert _loops(graph) == []


def test_no_module_imports_one_that_imports_it_back_even_for_annotations():
    """No loop either counting imports for annotations alone (`if TYPE_CHECKING:`): the engine's
    state (a session's, an answer's) imports nothing that drives it, and an answer nothing that
    changes a cache (the step borrows, gives back and evicts for it)."""
    assert _loops(_imports(_modules(), annotations=True)) == []
    engine = _imports(_modules(), annotations=True)
    for state in ("engine.session_state", "engine.answer"):
        assert not engine[state] & {"engine.step", "engine.runner", "engine.session"}, state
    assert not engine["engine.answer"] & {"engine.loan", "engine.kv_cache"}


def test_the_rooms_keep_their_walls():
    """The engine imports no service code and no training code; the gateway no engine; the
    training package nothing of the service; only the benchmarks and tests import training."""
    graph = _imports(_modules())

    def reaches(prefix: str, module: str) -> bool:
        return any(other == prefix or other.startswith(prefix + ".") for other in graph[module])

    for module in graph:
        room = module.split(".")[0]
        if room == "engine":
            assert not any(reaches(p, module) for p in ("app", "worker", "streamvqa", "demo_training", "bench")), module
        if room == "app":
            assert not any(reaches(p, module) for p in ("engine", "worker", "demo_training")), module
        if room == "demo_training":
            assert not any(reaches(p, module) for p in ("app", "worker", "streamvqa")), module
        if room in ("app", "engine", "worker", "streamvqa"):
            assert not reaches("demo_training", module), module


def test_the_worker_imports_the_engine_through_its_face_alone():
    """The worker names nothing below engine/__init__.py: what it needs of the engine is there."""
    below = []
    for path in sorted((ROOT / "worker").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            below += [f"{path.name}: {name}" for name in names if name.startswith("engine.")]
    assert below == []


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_alone(package):
    result = subprocess.run([sys.executable, "-c", f"import {package}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
