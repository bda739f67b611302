"""Comments give reasons, not the history of runs: a comment or docstring that retells a past
measurement ("run 11", "call 2", a date) is stale the day the code changes. Where a number backs
a decision, the comment cites a stable record instead (a row of benchmarks/results/latest.json,
a section of benchmarks/results/README.md or benchmarks/probes/README.md)."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "models", "profiling", "verify", "codegen", "pipeline")
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
# "run 11", "runs 3-5", "call 2", an ISO date; a month's name beside a day ("Dec 5", "5 December":
# capitalised, so "1 decode step" is not one)
HISTORY = re.compile(r"\b(?:(?i:run \d+|runs \d+-\d+|calls? \d+)|20\d\d-\d\d-\d\d"
                     rf"|{_MONTH} \d{{1,2}}(?:st|nd|rd|th)?|\d{{1,2}} {_MONTH}(?=\W|$))")


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in `source`."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                first = node.body[0].lineno
                out += [(first + i, line) for i, line in enumerate(doc.splitlines())]
    return out


def history(source: str) -> list[tuple[int, str]]:
    return [(n, text.strip()) for n, text in prose(source) if HISTORY.search(text)]


def sources() -> list[Path]:
    """The packages' modules and the benchmark scripts beside them (not their probes)."""
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))] + sorted(
        (ROOT / "benchmarks").glob("*.py"))


def test_no_comment_retells_a_run_a_call_or_a_date():
    found = [f"{path.relative_to(ROOT)}:{n}: {text}"
             for path in sources() for n, text in history(path.read_text())]
    assert not found, "\n".join(found)


def test_the_check_reads_comments_and_docstrings_not_code():
    source = ('"""Module doc: measured in run 11."""\n'
              "def f():\n"
              '    """Took 3 ms on 2026-12-06."""\n'
              "    runs = 3  # call 2 said so\n"
              "    # as Dec 5 showed; on 5 December too\n"
              "    # N - 1 decode steps, as Run 4 left it\n"
              "    # a mayor's 3 decades: no date\n"
              '    return "run 4 is a string, not a comment"\n')
    assert [n for n, _ in history(source)] == [4, 5, 6, 1, 3]
