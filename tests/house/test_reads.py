"""The pipeline reads artifacts as typed records (`core.records`), as attributes, and its
functions stay small enough to read: two bounds that only move down.

- Distinct string keys read in pipeline/ (`x["key"]`, `x.get("key")`): each one is a field
  of an artifact or a report row that no record declares, read where a typo fails at run time.
  Measured from the AST of every pipeline/*.py (`key_reads`): a subscript with a constant
  string that is loaded (not stored), or a call of `.get`, `.pop` or `.setdefault` whose first
  argument is a constant string; the distinct strings over all files are counted. Issue #60
  measured 306 at d130199 and set the goal under 100; the report now reads its typed view
  (`pipeline.report_view`) and the artifacts' records, and `KEYS` is where the code stands.
- Cyclomatic complexity of every function in pipeline/, counted as radon counts it (`radon cc`:
  1, plus one per if, elif, loop, except, assert, conditional expression, comprehension and
  extra operand of `and`/`or`): at most `COMPLEXITY` (#60: the report's dict-walking blocks
  had reached 78; split one block per function).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "pipeline"

KEYS = 50
COMPLEXITY = 30
OVER: dict[str, int] = {}  # function -> its complexity, for one above the bound until split


def key_reads(source: str) -> list[str]:
    """Every string key `source` reads: `x["key"]` (not a store) and `x.get/pop/setdefault(
    "key", ...)`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            out.append(node.slice.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "pop", "setdefault") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append(node.args[0].value)
    return out


_BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.IfExp, ast.Assert,
             ast.ExceptHandler, ast.comprehension)


def complexity(func: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """radon's cyclomatic complexity of `func`, nested functions and classes left to their own
    count (as radon reports them)."""
    total = 1

    def visit(node: ast.AST) -> None:
        nonlocal total
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(child, _BRANCHES):
                total += 1
                if isinstance(child, ast.comprehension):
                    total += len(child.ifs)
                elif isinstance(child, (ast.For, ast.AsyncFor, ast.While)) and child.orelse:
                    total += 1
            elif isinstance(child, ast.BoolOp):
                total += len(child.values) - 1
            elif isinstance(child, ast.Try) and child.orelse:
                total += 1
            visit(child)

    visit(func)
    return total


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{path.relative_to(ROOT)}:{node.name}", complexity(node)


def _sources():
    return sorted(PIPELINE.rglob("*.py"))


def test_the_pipeline_reads_no_more_string_keys_than_it_did():
    keys = {k for path in _sources() for k in key_reads(path.read_text())}
    assert len(keys) <= KEYS, (
        f"{len(keys)} distinct string keys read in pipeline/ (at most {KEYS}): read the "
        "artifact as its record (core.artifacts.load) and its fields as attributes")


def test_no_pipeline_function_grows_past_the_complexity_bound():
    found = dict(f for path in _sources() for f in functions(path))
    over = {name: c for name, c in found.items() if c > COMPLEXITY}
    grown = {name: c for name, c in over.items() if c > OVER.get(name, COMPLEXITY)}
    assert not grown, f"over cyclomatic complexity {COMPLEXITY}: {grown}: split it"
    assert set(OVER) <= set(over), ("split below the bound, or gone: take them out of OVER: "
                                    f"{sorted(set(OVER) - set(over))}")


def test_the_counts_read_code_as_radon_and_the_keys_as_reads():
    source = ("def f(x, rec):\n"
              "    if x and rec['a'] or x:\n"          # if, two extra operands
              "        return [y for y in x if y]\n"   # comprehension, its if
              "    for y in x:\n"                      # loop with an else
              "        rec['stored'] = rec.get('b')\n"
              "    else:\n"
              "        pass\n"
              "    def inner(z):\n"                    # its own count
              "        return z if z else 0\n"
              "    return 1 if x else 2\n")            # conditional expression
    [(_, c)] = [(n.name, complexity(n)) for n in ast.parse(source).body]
    assert c == 1 + 1 + 2 + 2 + 2 + 1
    assert sorted(key_reads(source)) == ["a", "b"]
