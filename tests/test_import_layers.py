"""The package's layering, read from its source with `ast`: every import (module level and inside functions,
absolute and relative) of every vlserve module, mapped to the top-level unit it reaches.

Checked: (1) a unit imports only units of the same or a lower rank; (2) no cycle between units; (3) vlserve.core
imports no torch; (4) no file is over 500 lines; (5) vlserve never imports the checkout's other top-level packages
(tests, training, benchmarks), which may import vlserve. Edges not yet removed are listed in KNOWN_BREACHES; the
test fails on a new breach and on a listed one that no longer exists, so the list only shrinks.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG_ROOT = pathlib.Path(__file__).resolve().parents[1] / "vlserve"
MAX_LINES = 500

# Lowest first. A unit is a top-level subpackage or module of vlserve; "vlserve" is the package's own __init__.
RANKS = {
    "demo": 0,  # the checkpoint locator, the demo worlds, tiny random checkpoints: import nothing from vlserve
    "config": 1,
    "transfer_config": 1,
    "sampling_params": 1,
    "outputs": 1,
    "pooling_params": 1,
    "shorten": 1,
    "beam_search": 1,
    "structured_output": 1,  # params (pure), backends and the manager: import only shorten among ours
    "reasoning": 1,  # reasoning parsers and the engine's tracker (pure Python): import only shorten among ours
    "core": 2,
    "kernels": 2,
    "multimodal": 2,
    "distributed": 2,
    "encoders": 3,
    "models": 4,
    "lora": 4,  # lora wraps the decoder's layers (models); the runner (worker) will own it
    "worker": 5,
    "spec_decode": 6,
    "executor": 7,
    "engine": 8,
    "llm": 9,
    "llm_pooling": 9,
    "api": 9,
    "vlserve": 9,
    "cli": 10,
    "serve_args": 10,  # the serve flags (cli and the server tests read them)
    "serve_help": 10,  # their help formatter and the command's description
    "bench": 10,
    "quickstart": 10,
}
# The checkout's top-level packages beside vlserve: they may import vlserve, vlserve never imports them.
OUTSIDE = {"tests", "training", "benchmarks"}

# (module, imported module) edges that break the rule today, each with the helper whose part removes it.
KNOWN_BREACHES: set[tuple[str, str]] = set()
# Loops that exist today (sorted tuples), same rule: between subpackages, and between modules of one subpackage.
KNOWN_CYCLES: set[tuple[str, str]] = set()
KNOWN_MODULE_CYCLES: set[tuple[str, str]] = set()


def _module_name(path: pathlib.Path, root: pathlib.Path = PKG_ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, root: pathlib.Path) -> set[str]:
    """Every vlserve module `path` imports, anywhere in the file (the `from X import name` names are tried as
    submodules of X, so `from vlserve import kernels` counts as vlserve.kernels, not as the package root)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "vlserve")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "vlserve":
                continue
            subs = {f"{target}.{alias.name}" for alias in node.names}
            subs = {sub for sub in subs if _exists(sub, root)}
            found.update(subs)
            if len(subs) < len(node.names):  # some name is an attribute of `target` itself
                found.add(target)
    return found


def _exists(module: str, root: pathlib.Path) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "vlserve"


def _all_edges(root: pathlib.Path = PKG_ROOT) -> set[tuple[str, str]]:
    edges = set()
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        edges.update((module, imported) for imported in _imports(path, root))
    return edges


def _breaches(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    bad = set()
    for src, dst in edges:
        su, du = _unit(src), _unit(dst)
        if su != du and RANKS[du] > RANKS[su]:
            bad.add((src, dst))
    return bad


def _outside_imports(root: pathlib.Path = PKG_ROOT) -> set[tuple[str, str]]:
    """(vlserve module, imported module) for every import, anywhere in a file, of a package in OUTSIDE."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found.update((_module_name(path, root), n) for n in names if n.split(".")[0] in OUTSIDE)
    return found


def _unit_cycles(edges: set[tuple[str, str]]) -> set[tuple[str, ...]]:
    """Strongly connected groups of more than one unit."""
    return _cycles({(_unit(src), _unit(dst)) for src, dst in edges})


def _module_cycles(edges: set[tuple[str, str]], root: pathlib.Path = PKG_ROOT) -> set[tuple[str, ...]]:
    """Strongly connected groups of more than one module; edges into a package's __init__ are left out (a
    subpackage's __init__ re-exports its modules, which is no loop between them)."""
    return _cycles(
        {(src, dst) for src, dst in edges if not (root / pathlib.Path(*dst.split(".")[1:]) / "__init__.py").is_file()}
    )


def _cycles(edges: set[tuple[str, str]]) -> set[tuple[str, ...]]:
    """Strongly connected groups of more than one node (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for su, du in edges:
        graph.setdefault(su, set())
        graph.setdefault(du, set())
        if su != du:
            graph[su].add(du)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: set[tuple[str, ...]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.add(tuple(sorted(group)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


@pytest.fixture(scope="module")
def edges() -> set[tuple[str, str]]:
    return _all_edges()


def test_every_unit_has_a_rank():
    units = {_unit(_module_name(p)) for p in PKG_ROOT.rglob("*.py")}
    assert units - set(RANKS) == set(), "give each new top-level module/subpackage a rank in RANKS"


def test_imports_follow_the_layer_order(edges):
    breaches = _breaches(edges)
    new = sorted(breaches - KNOWN_BREACHES)
    assert not new, f"imports that reach a higher layer: {new}"
    gone = sorted(KNOWN_BREACHES - breaches)
    assert not gone, f"fixed breaches still listed in KNOWN_BREACHES (remove them): {gone}"


def test_vlserve_never_imports_the_checkout_packages():
    found = sorted(_outside_imports())
    assert not found, f"vlserve modules importing {sorted(OUTSIDE)} (the package must stand alone): {found}"


def test_no_cycle_between_subpackages(edges):
    cycles = _unit_cycles(edges)
    assert cycles - KNOWN_CYCLES == set(), f"import loops between subpackages: {sorted(cycles - KNOWN_CYCLES)}"
    assert KNOWN_CYCLES - cycles == set(), f"fixed loops still listed in KNOWN_CYCLES: {sorted(KNOWN_CYCLES - cycles)}"


def test_no_cycle_between_modules(edges):
    cycles = _module_cycles(edges)
    new = sorted(cycles - KNOWN_MODULE_CYCLES)
    assert not new, f"import loops between modules: {new}"
    assert KNOWN_MODULE_CYCLES - cycles == set(), f"fixed loops still listed: {sorted(KNOWN_MODULE_CYCLES - cycles)}"


def test_core_imports_no_torch():
    offenders = []
    for path in sorted((PKG_ROOT / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            )
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert not offenders, f"vlserve.core must stay pure Python: {offenders}"


def test_no_file_over_the_line_limit():
    long = {
        str(p.relative_to(PKG_ROOT)): n
        for p in sorted(PKG_ROOT.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """The parser catches function-level, relative and `import vlserve.x` imports, and the rules flag them."""
    pkg = tmp_path / "vlserve"
    (pkg / "core").mkdir(parents=True)
    (pkg / "engine").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "loop.py").write_text("from ..core import sched\n")
    (pkg / "core" / "sched.py").write_text("def f():\n    import vlserve.engine.loop\n")
    (pkg / "core" / "fixture.py").write_text("def g():\n    from tests.support import tokenizer\n")
    (pkg / "engine" / "train.py").write_text("import training.train\nfrom benchmarks import gpu_check\n")
    found = _all_edges(pkg)
    assert ("vlserve.engine.loop", "vlserve.core.sched") in found
    assert ("vlserve.core.sched", "vlserve.engine.loop") in found
    assert _breaches(found) == {("vlserve.core.sched", "vlserve.engine.loop")}
    assert _outside_imports(pkg) == {
        ("vlserve.core.fixture", "tests.support"),
        ("vlserve.engine.train", "training.train"),
        ("vlserve.engine.train", "benchmarks"),
    }
    assert _unit_cycles(found) == {("core", "engine")}
    assert _module_cycles(found, pkg) == {("vlserve.core.sched", "vlserve.engine.loop")}
