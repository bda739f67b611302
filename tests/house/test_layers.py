"""The import structure the README's layout section states: which package may import which.

Read from the code (every import statement, module level or inside a function), so an upward
import or a cycle fails here before it reaches a newcomer.
"""

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "models", "profiling", "verify", "codegen", "pipeline")
# package -> the project packages it may import (besides itself)
ALLOWED = {
    "models": set(),
    "core": set(),
    "profiling": {"core", "models"},
    "verify": {"core"},
    "codegen": {"core", "models", "profiling", "verify"},
    "pipeline": {"core", "models", "profiling", "verify", "codegen"},
}


def imports(path: Path) -> set[str]:
    """The project modules `path` imports (dotted names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def module_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    for name, path in files.items():
        graph.add_node(name)
        for target in imports(path):
            # `from a.b import c` names a.b.c: keep the longest name that is a module
            while target not in files and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in files and target != name:
                graph.add_edge(name, target)
    return graph


def test_packages_import_only_the_floors_below_them():
    upward = sorted((a, b) for a, b in module_graph().edges
                    if b.split(".")[0] != a.split(".")[0]
                    and b.split(".")[0] not in ALLOWED[a.split(".")[0]])
    assert not upward, upward


def test_no_module_imports_itself_round_a_cycle():
    graph = module_graph()
    # a package's __init__ naturally sits above its submodules; cycles are about modules
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert not cycles, cycles[:5]


def test_the_check_sees_an_upward_import(tmp_path):
    """The reader catches what it is for: an import inside a function too."""
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from pipeline.api import apply_kernels\n"
                    "import torch\nfrom core.errors import UserError\n")
    assert imports(path) == {"pipeline.api", "pipeline.api.apply_kernels", "core.errors",
                             "core.errors.UserError"}


def test_the_projection_calls_no_stage():
    """pipeline/projection/ is what the stages call to project; a stage it imported would run
    the pipeline backwards (and round a cycle, sooner or later)."""
    graph = module_graph()
    projection = [n for n in graph if n.startswith("pipeline.projection")]
    assert projection, "pipeline/projection/ not found"
    called = sorted((a, b) for a in projection for b in nx.descendants(graph, a)
                    if b.startswith("pipeline.stages"))
    assert not called, called
