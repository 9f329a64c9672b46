"""The package's layering (docs/design.md, "Layout"): every import points down the stack of
stages, none runs in a circle, the index maps import only the contracts, and nothing below the
report stage draws (imports matplotlib)."""

from __future__ import annotations

import ast
from pathlib import Path

import lakeloader

PACKAGE = Path(lakeloader.__file__).parent

# Lower number = lower layer. A module may import modules of a lower layer, or of its own
# package (stage) without a cycle. The foundation modules sit just above the contracts.
LAYERS = {
    "contracts": 0,
    "config": 1, "storage": 1, "tokenizer": 1, "specs": 1, "images": 1,
    "index": 2, "plan": 3, "catalog": 4, "read": 5, "ingest": 6, "feed": 7,
    "report": 8, "demo": 9, "cli": 10, "": 10,
}
INDEX_MAY_IMPORT = {"contracts"}
DRAWS = "report"   # the stage that draws: matplotlib is imported there and above, never below


def _module_name(path: Path) -> str:
    parts = ("lakeloader",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every lakeloader module ``path`` imports, at any depth (functions, TYPE_CHECKING blocks)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("lakeloader") and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, name, set(paths)) for name, path in paths.items()}


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_belongs_to_a_layer() -> None:
    unknown = sorted(m for m in _graph() if _stage(m) not in LAYERS)
    assert not unknown, f"modules outside the layers of docs/design.md: {unknown}"


def test_imports_point_down_the_stack() -> None:
    upward = sorted((m, t) for m, targets in _graph().items() for t in targets
                    if _stage(t) != _stage(m) and LAYERS[_stage(t)] >= LAYERS[_stage(m)]
                    and not (LAYERS[_stage(t)] == LAYERS[_stage(m)] == 1))
    assert not upward, f"imports against the flow: {upward}"


def test_the_index_maps_import_only_the_contracts() -> None:
    wrong = sorted((m, t) for m, targets in _graph().items() if _stage(m) == "index" for t in targets
                   if _stage(t) not in INDEX_MAY_IMPORT | {"index"})
    assert not wrong, f"index modules must take plain specs, not config or feed objects: {wrong}"


def test_the_contracts_import_no_stage() -> None:
    wrong = sorted((m, t) for m, targets in _graph().items() if _stage(m) == "contracts" for t in targets
                   if _stage(t) != "contracts")
    assert not wrong, f"the contracts layer imports nothing of lakeloader: {wrong}"


def _imports_matplotlib(path: Path) -> bool:
    """Whether ``path`` imports matplotlib anywhere (functions, TYPE_CHECKING blocks)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(name.split(".")[0] == "matplotlib" for name in names):
            return True
    return False


def test_only_the_report_stage_and_above_draw() -> None:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    drawing = sorted(m for m, path in paths.items() if _imports_matplotlib(path))
    below = [m for m in drawing if LAYERS[_stage(m)] < LAYERS[DRAWS]]
    assert not below, f"modules below the {DRAWS} stage import matplotlib (they compute, {DRAWS} draws): {below}"
    assert any(_stage(m) == DRAWS for m in drawing), "the check finds no module that draws: is it broken?"


def test_no_import_circles() -> None:
    graph = _graph()
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in order:
            visit(module)
    assert not circles, f"import circles (lazy and TYPE_CHECKING imports count): {circles}"
