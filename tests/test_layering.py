"""The package imports only downward: utilities, then the TurboQuant core and the Pallas kernels,
then the KV cache, the models, decoding, the public API, research analyses over it, and the
command-line programs on top; no module-level cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import tqjax

ROOT = Path(tqjax.__file__).parent
RANK = {"errors": 0, "dtypes": 0, "xla": 0, "atomic": 0, "host": 0, "data": 0, "fetch": 0,
        "quant": 1, "pallas": 1, "kv": 2, "models": 3, "decode": 4, "sharding": 4, "api": 5,
        "eval": 5, "cli": 5, "planner": 5, "__init__": 5, "research": 6, "serve": 6,
        "commands": 7}
RANK["sharding"] = 3  # tqjax/sharding.py: over kv and models, under decode and api


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Every tqjax module -> the tqjax modules it imports (anywhere in the file, including
    function-level and TYPE_CHECKING imports)."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tqjax"):
                for alias in node.names:  # "from tqjax.models import checkpoint" names a module
                    sub = f"{node.module}.{alias.name}"
                    is_module = (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                    found.add(sub if is_module else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("tqjax")}
        graph[module_name(path)] = found - {module_name(path)}
    return graph


def rank(module: str) -> int:
    parts = module.split(".")
    return RANK[parts[1] if len(parts) > 1 else "__init__"]


def test_imports_only_go_down() -> None:
    upward = [(m, d) for m, deps in imports().items() for d in deps
              if d != "tqjax" and rank(d) > rank(m)]
    assert not upward, f"upward imports: {upward}"


def test_no_import_cycles() -> None:
    graph = imports()
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            assert state.get(d) != 1, f"import cycle: {' -> '.join([*stack, m, d])}"
            if d not in state:
                visit(d, [*stack, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
