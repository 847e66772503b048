"""The house's layers: every module of ``fedlmc/`` imports only from its own layer or the layers below it
(docs/DESIGN.md draws the same map), no import cycle (function-local imports count too, so neither can
hide behind one), and no function grows past the house's limit."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fedlmc"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module → the fedlmc modules it imports anywhere in its body (``from pkg import sub`` → pkg.sub)."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                if t in files and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle (as a path that returns to its start), or [] if there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_fedlmc_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " → ".join(cycle)


# docs/DESIGN.md's layers, bottom first: a module belongs to the layer of its longest matching prefix
LAYERS = [
    ("ground", ["fedlmc", "fedlmc.models", "fedlmc.data", "fedlmc.io", "fedlmc.scale.allocator", "fedlmc.scale.cpu"]),
    ("ground", ["fedlmc.provenance"]),
    ("ground", ["fedlmc.options", "fedlmc.train"]),
    ("symmetry", ["fedlmc.symmetry"]),
    ("adapters", ["fedlmc.hf"]),
    ("widths", ["fedlmc.merging.widths"]),
    ("averaging", ["fedlmc.merging.averaging", "fedlmc.merging.barrier", "fedlmc.merging.ensemble"]),
    ("averaging", ["fedlmc.merging.distill"]),
    ("matching", ["fedlmc.matching"]),
    ("lora", ["fedlmc.lora"]),
    ("universe", ["fedlmc.scale.replies", "fedlmc.scale.workers", "fedlmc.merging.universe", "fedlmc.merging.screen"]),
    (
        "universe",
        ["fedlmc.merging.manyway", "fedlmc.reproduce", "fedlmc.merging.depths", "fedlmc.merging.mixed_depths"],
    ),
    ("on_clients", ["fedlmc.scale.arrivals", "fedlmc.flower.on_clients"]),
    ("strategies", ["fedlmc.strategies", "fedlmc.baselines"]),
    ("apps", ["fedlmc.federated", "fedlmc.commands", "fedlmc.cli", "fedlmc.flower.launch", "fedlmc.flower.superlink"]),
]


def layer_of(module: str) -> int:
    """The index of ``module``'s layer in ``LAYERS`` (its longest matching prefix); a module in none fails."""
    found = [
        (len(p), i)
        for i, (_, prefixes) in enumerate(LAYERS)
        for p in prefixes
        if module == p or module.startswith(p + ".")
    ]
    assert found, f"{module} is in no layer of LAYERS: place it (and in docs/DESIGN.md)"
    index = max(found)[1]
    return [name for name, _ in LAYERS].index(LAYERS[index][0])


def test_every_module_imports_only_from_its_layer_or_below():
    graph = import_graph()
    upward = sorted(
        f"{m} ({LAYERS[layer_of(m)][0]}) imports {d}"
        for m, deps in graph.items()
        for d in deps
        if layer_of(d) > layer_of(m)
    )
    assert not upward, upward


def test_no_function_is_longer_than_the_house_limit():
    """At most 90 lines a function, its docstring included: a longer one is a function to split."""
    long = {}
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 90:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = n
    assert not long, long


def test_the_core_imports_without_flower():
    """Symmetries, matching, universes, training and the paper's reproduction import with Flower (and
    Ray) unavailable, as on a GPU machine that has only torch's stack: ``make gpu-check`` runs there."""
    import subprocess
    import sys

    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('flwr', 'flwr_datasets', 'ray'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import fedlmc.symmetry, fedlmc.matching, fedlmc.merging.universe, fedlmc.train\n"
        "import fedlmc.reproduce, fedlmc.commands\n"
        "import flwr\n"  # the blocker works: this line must fail
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "ImportError: blocked flwr" in proc.stderr and proc.stderr.count("blocked") == 1, proc.stderr


def test_the_package_shows_its_rooms():
    """``fedlmc/`` is grouped by concern: at most 12 top-level modules beside its packages."""
    top = sorted(p.name for p in PKG.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 12, top


def test_the_library_never_imports_the_lab_or_the_apps():
    """``fedlmc`` imports no module of the lab (``simulations``), of the apps (``clients``, ``server``,
    ``strategies``) or of the tests, anywhere in its body: the wheel ships the library alone."""
    outside = ("simulations", "clients", "server", "strategies", "tests", "bench", "_results", "_models")
    found = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [(str(path.relative_to(ROOT)), n) for n in names if n.split(".")[0] in outside]
    assert not found, found
