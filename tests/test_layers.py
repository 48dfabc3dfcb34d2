"""The core depends one way (docs/architecture.md).

Every ``import`` and ``from ... import`` in ``kvcore/`` -- function bodies included -- is
read from the source (no module is imported), and:

* every module belongs to exactly one layer of :data:`LAYERS`;
* every kvcore import points down or sideways: a module imports only modules of its own
  layer or of a layer below it;
* there is no import cycle (not even within a layer);
* no kvcore module is imported inside a function: a function-level import is how a cycle
  hides. The only exceptions are imports that exist for an optional dependency (triton,
  numpy, pytest), each listed in :data:`FUNCTION_LEVEL_ALLOWED` with its reason: today one,
  the pytest hooks of ``kvcore.testing`` (the pytest plugin is imported when pytest calls
  them, not when a plugin imports ``kvcore.testing`` for its fixture contract).

A new module must be given a layer here; a new arrow that points up, or a new cycle, fails
with the edge (file and line) that breaks the rule.
"""

from __future__ import annotations

import ast
import fnmatch
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvcore"

#: The layers, bottom first: ``(layer name, module patterns)``. A pattern is a dotted
#: module name, ``fnmatch``-style (``kvcore.kernels.*``); ``kvcore`` itself is the package's
#: ``__init__`` (the public facade). A module's exact name wins over a pattern
#: (``kvcore.cli_args`` is not ``kvcore.cli_*``). A module may import modules of its own
#: layer or lower.
LAYERS: list[tuple[str, list[str]]] = [
    ("errors and hook specs", ["kvcore.errors", "kvcore.hookspecs"]),
    ("grammar and input checks", ["kvcore.grammar", "kvcore.inputs", "kvcore.cli_args"]),
    (
        "declarations and containers",
        [
            "kvcore.format_decl",
            "kvcore.hint_decl",
            "kvcore.detection_decl",
            "kvcore.containers",
            "kvcore.dtypes",
            "kvcore.tensor_description",
        ],
    ),
    ("stride table", ["kvcore.strides", "kvcore.aliasing"]),
    ("spec", ["kvcore.plane_reader", "kvcore.spec"]),
    (
        "plugin host",
        ["kvcore.plugin_isolation", "kvcore.plugin_kernels", "kvcore.plugin_answers", "kvcore.plugin_host", "kvcore.registry"],
    ),
    ("layout", ["kvcore.layout"]),
    ("detection", ["kvcore.detect_context", "kvcore.memory_order", "kvcore.resolution", "kvcore.detection"]),
    ("kernels", ["kvcore.kernels", "kvcore.kernels.*"]),
    ("plans and transfer", ["kvcore.transfer_path", "kvcore.layout_plan", "kvcore.transfer"]),
    ("copy", ["kvcore.layout_copy"]),
    ("distribution", ["kvcore.distributed", "kvcore.distributed.*", "kvcore.distributed_*", "kvcore.p2p*"]),
    ("public API and built-in plugin", ["kvcore", "kvcore.builtin"]),
    ("compat and testing", ["kvcore.compat", "kvcore.compat.*", "kvcore.testing", "kvcore.testing.*"]),
    ("bench and cli", ["kvcore.bench", "kvcore.bench.*", "kvcore.bench_*", "kvcore.cli", "kvcore.cli.*", "kvcore.cli_*"]),
]

#: ``{(importing module, imported module): why}``: kvcore imports allowed inside a
#: function. Only for a kvcore module used with an optional dependency (one a plain
#: ``pip install kvcore`` does not bring: triton, numpy, pytest), so that importing the
#: caller neither needs it nor pays for it.
FUNCTION_LEVEL_ALLOWED: dict[tuple[str, str], str] = {
    ("kvcore.testing", "kvcore.testing.pytest_plugin"): (
        "`pytest -p kvcore.testing`: the package's two pytest hooks forward to the pytest plugin, which pytest (a test "
        "extra) alone calls; imported at the top it would load the whole conformance suite into every plugin that "
        "imports kvcore.testing for FixtureCase at load"
    ),
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported kvcore module
    path: str  # file:line
    in_function: bool


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def scan(package: Path) -> tuple[set[str], list[Import]]:
    """Every module of ``package`` and every import of one of its modules, read from the
    source: ``from a import b`` is an import of ``a.b`` when that is a module, else of ``a``;
    relative imports are resolved; imports under ``if TYPE_CHECKING:`` count too."""
    files = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    top = package.name
    out: list[Import] = []

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in files:
                return ".".join(parts[:i])
        return None

    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))

        def visit(node: ast.AST, in_function: bool, mod: str = mod, path: Path = path, is_pkg: bool = is_pkg) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                        here = here[: len(here) - (child.level - 1)]
                        base = ".".join(here + ([child.module] if child.module else []))
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in child.names]
                else:
                    targets = []
                for t in dict.fromkeys(targets):
                    if t.split(".")[0] != top:
                        continue
                    r = resolve(t)
                    if r is not None and r != mod:
                        where = f"{path.relative_to(package.parent)}:{child.lineno}"
                        out.append(Import(mod, r, where, in_function))
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, inner)

        visit(tree, False)
    return set(files), out


def layer_of(module: str, layers: list[tuple[str, list[str]]] = LAYERS) -> list[int]:
    """The layers that list ``module`` by name, or else those with a pattern it matches."""
    exact = [i for i, (_, pats) in enumerate(layers) if module in pats]
    return exact or [i for i, (_, pats) in enumerate(layers) if any(fnmatch.fnmatchcase(module, p) for p in pats)]


def cycles(modules: set[str], imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for i in imports:
        graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def upward(imports: list[Import], layers: list[tuple[str, list[str]]] = LAYERS) -> list[str]:
    bad = []
    for i in imports:
        (src,), (dst,) = layer_of(i.source, layers), layer_of(i.target, layers)
        if dst > src:
            bad.append(f"{i.path}: {i.source} (layer {layers[src][0]!r}) imports {i.target} (layer {layers[dst][0]!r}, above it)")
    return bad


def function_level(imports: list[Import]) -> list[str]:
    return [
        f"{i.path}: {i.source} imports {i.target} inside a function"
        for i in imports
        if i.in_function and (i.source, i.target) not in FUNCTION_LEVEL_ALLOWED
    ]


MODULES, IMPORTS = scan(PACKAGE)


def test_every_module_has_exactly_one_layer():
    unplaced = sorted(m for m in MODULES if not layer_of(m))
    twice = sorted(m for m in MODULES if len(layer_of(m)) > 1)
    assert not unplaced, f"modules without a layer (add them to LAYERS in tests/test_layers.py): {unplaced}"
    assert not twice, f"modules in more than one layer: {twice}"


def test_no_import_cycle():
    found = cycles(MODULES, IMPORTS)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_kvcore_import_inside_a_function():
    bad = function_level(IMPORTS)
    assert not bad, "kvcore imports inside functions (import at the top; if that makes a cycle, fix the layering):\n" + "\n".join(bad)


def test_every_import_points_down():
    if any(not layer_of(m) for m in MODULES):
        pytest.skip("a module has no layer (test_every_module_has_exactly_one_layer)")
    bad = upward(IMPORTS)
    assert not bad, "imports that point up the layers:\n" + "\n".join(bad)


def test_the_allowlist_names_real_function_level_imports():
    seen = {(i.source, i.target) for i in IMPORTS if i.in_function}
    stale = sorted(set(FUNCTION_LEVEL_ALLOWED) - seen)
    assert not stale, f"FUNCTION_LEVEL_ALLOWED lists imports that no longer exist: {stale}"
    assert all(why.strip() for why in FUNCTION_LEVEL_ALLOWED.values())


def test_the_scanner_reads_the_real_tree():
    # the graph is read, not empty: known arrows of the layering are found
    edges = {(i.source, i.target) for i in IMPORTS}
    assert ("kvcore.layout", "kvcore.registry") in edges
    assert ("kvcore.registry", "kvcore.spec") in edges
    assert ("kvcore.transfer", "kvcore.layout_plan") in edges
    assert ("kvcore.layout_plan", "kvcore.transfer_path") in edges
    assert len(MODULES) > 50 and len(IMPORTS) > 200


# -- the checks catch what they are for (a scanner that finds nothing proves nothing) --------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "kvcore"
    for name, src in files.items():
        p = pkg / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
    return pkg


def test_a_cycle_hidden_in_a_function_is_found(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "low.py": "def f():\n    from kvcore import high\n    return high\n",
            "high.py": "from kvcore.low import f\n",
            "sub/__init__.py": "",
            "sub/a.py": "from . import b\n",
            "sub/b.py": "from ..low import f\nimport kvcore.sub.a\n",
        },
    )
    modules, imports = scan(pkg)
    assert modules == {"kvcore", "kvcore.low", "kvcore.high", "kvcore.sub", "kvcore.sub.a", "kvcore.sub.b"}
    assert sorted(cycles(modules, imports)) == [["kvcore.high", "kvcore.low"], ["kvcore.sub.a", "kvcore.sub.b"]]
    assert function_level(imports) == ["kvcore/low.py:2: kvcore.low imports kvcore.high inside a function"]
    assert ("kvcore.sub.b", "kvcore.low") in {(i.source, i.target) for i in imports}


def test_an_upward_import_is_named(tmp_path):
    pkg = _package(tmp_path, {"__init__.py": "", "low.py": "from kvcore.high import X\n", "high.py": "X = 1\n"})
    _, imports = scan(pkg)
    layers = [("bottom", ["kvcore.low"]), ("top", ["kvcore", "kvcore.high"])]
    assert upward(imports, layers) == ["kvcore/low.py:1: kvcore.low (layer 'bottom') imports kvcore.high (layer 'top', above it)"]
    assert upward([Import("kvcore.high", "kvcore.low", "x", False)], layers) == []
