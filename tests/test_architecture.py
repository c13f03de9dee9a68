"""The house rules that imports can show: layers point one way and nothing imports in a circle.

    nodes/, sjd_core/tools/  ->  sjd_core/figures.py  ->  sjd_core/decoding/
                             ->  sjd_core/models/protocol.py  <-  families

Every ``import`` in every project module (at the top or inside a function) is read from the
source, resolved to a project module, and checked against the layer rules; the whole graph must
have no cycle. A runtime check imports the decoding core in a fresh interpreter and lists what it
pulled in.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sjd_core", "nodes")
NODE_MODULES = {"nodes.decode", "nodes.diagnostics", "nodes.loader", "nodes.sampler",
                "nodes.options", "nodes.sampler_legacy"}


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the pack's packages."""
    found = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            parts = list(file.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = file
    return found


def imports_of(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that ``name`` imports anywhere in its source."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            for alias in node.names:
                targets.add(f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem)
    resolved = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, file, modules) for name, file in modules.items()}


def layer(module: str) -> str:
    if module == "sjd_core.models.protocol":
        return "protocol"
    for prefix, name in (("sjd_core.decoding", "core"), ("sjd_core.figures", "figures"),
                         ("sjd_core.models", "models"),
                         ("sjd_core.tools", "tools"), ("nodes", "nodes")):
        if module == prefix or module.startswith(prefix + "."):
            return name
    return "package"  # sjd_core/__init__.py


ALLOWED = {
    "protocol": {"package"},
    "core": {"core", "protocol", "package"},
    "models": {"models", "protocol", "package"},
    "figures": {"core", "protocol", "package"},  # pictures of a trace, for nodes and tools
    "tools": {"tools", "figures", "core", "models", "protocol", "package"},
    "nodes": {"nodes", "tools", "figures", "core", "models", "protocol", "package"},
    "package": {"package"},  # sjd_core/__init__.py, messages.py, files.py, compiled.py, ...
}


def test_every_import_points_down_the_layers():
    graph = import_graph()
    assert {"sjd_core.decoding.engine", "sjd_core.models.registry", "sjd_core.tools.demo",
            "nodes.sampler"} <= graph.keys()
    wrong = [f"{a} ({layer(a)}) imports {b} ({layer(b)})"
             for a, targets in graph.items() for b in sorted(targets)
             if layer(b) not in ALLOWED[layer(a)]]
    assert not wrong, "imports against the layer rules:\n" + "\n".join(wrong)


def test_node_modules_do_not_import_each_other():
    graph = import_graph()
    wrong = [f"{a} imports {b}" for a in NODE_MODULES & graph.keys()
             for b in graph[a] if b in NODE_MODULES]
    assert not wrong, "node modules share code through helpers, not each other:\n" + "\n".join(wrong)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_a_cycle_and_the_layer_rule_sees_a_wrong_way_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert layer("sjd_core.models.chameleon") not in ALLOWED["core"]
    assert layer("sjd_core.tools.bench") not in ALLOWED["models"]
    assert layer("sjd_core.figures") not in ALLOWED["core"]


def test_the_family_table_is_explicit():
    source = (ROOT / "sjd_core/models/registry.py").read_text(encoding="utf-8")
    assert "FAMILIES: tuple[Family, ...] = (" in source
    every = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "sjd_core").rglob("*.py"))
    assert "register_family" not in every and "import_module" not in every


def test_importing_the_core_loads_no_family_tool_or_comfyui():
    code = ("import sys, sjd_core.decoding.engine, sjd_core.decoding.trace; "
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith(('sjd_core', 'comfy', "
            "'transformers', 'nodes')))))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    allowed = {"sjd_core", "sjd_core.decoding", "sjd_core.messages", "sjd_core.files",
               "sjd_core.checks", "sjd_core.transfer", "sjd_core.compiled",
               "sjd_core.models", "sjd_core.models.protocol"}
    stray = [m for m in loaded if m not in allowed and not m.startswith("sjd_core.decoding.")]
    assert "sjd_core.decoding.engine" in loaded
    assert not stray, f"importing the core loaded {stray}"


def fast_test(file: Path) -> bool:
    """Whether ``pytest -m "not slow"`` runs a test of ``file``: not marked slow as a whole, and
    one ``test_`` function at least without the slow mark."""
    tree = ast.parse(file.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and "slow" in ast.unparse(node.value) and any(
                getattr(target, "id", "") == "pytestmark" for target in node.targets):
            return False
    return any(isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
               and not any("slow" in ast.unparse(d) for d in node.decorator_list)
               for node in tree.body)


def reached_from(file: Path, modules: dict[str, Path], seen: set[Path]) -> set[str]:
    """Project modules a test file imports: directly, through the test helpers it imports, by
    importing the pack (every node), or by running ``python -m`` on one."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "import_pack":
            names.add("nodes")
        elif isinstance(node, ast.Constant) and node.value in modules:
            names.add(node.value)
    found = set()
    for name in names:
        name = name.removeprefix("sjd_pack.")
        helper = ROOT / "tests" / f"{name}.py"
        if helper.is_file() and helper not in seen:
            seen.add(helper)
            found |= reached_from(helper, modules, seen)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def test_the_fast_loop_reaches_every_module():
    modules, graph = project_modules(), import_graph()
    fast = [f for f in sorted((ROOT / "tests").glob("test_*.py")) if fast_test(f)]
    assert len(fast) > 20 and not fast_test(ROOT / "tests" / "test_comfyui_server.py")
    reached = set().union(*(reached_from(f, modules, {f}) for f in fast))
    todo = list(reached)
    while todo:
        for module in graph[todo.pop()] - reached:
            reached.add(module)
            todo.append(module)
    assert reached >= {"nodes.options", "sjd_core.decoding.engine", "sjd_core.tools.demo"}
    assert sorted(set(modules) - reached) == [], "modules no fast test imports"
