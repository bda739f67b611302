"""A static look at a candidate's source before it runs (as KernelBench does).

What no kernel needs and a cheat does: patching a timer or a synchronise (the timing would lie),
threads or processes (work that outlives the call, or races the check), its own streams (work
the caller's stream does not wait for), imports of the judge or the answer (the project's
verify/ or tests, the family's reference module), and reading tensor values on the host (numpy,
.tolist(): compute there is invisible to the op allow-list of verify/integrity.py). The check
reads the source file itself; a helper module it imports is judged by what it does at run time
(the op allow-list, streams).
"""

from __future__ import annotations

import ast
from pathlib import Path

# Modules whose attributes a timer or device sync lives on: assigning to one is monkeypatching.
_TIMER_NAMES = {"time", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
                "process_time", "synchronize", "Event", "elapsed_time", "record", "do_bench",
                "bench", "query", "wait", "_sleep"}
_CONCURRENCY = ("threading", "_thread", "multiprocessing", "concurrent", "subprocess",
                "asyncio")
_CONCURRENCY_CALLS = {"fork", "forkpty", "spawnv", "spawnl", "posix_spawn", "system",
                      "start_new_thread", "register_at_fork"}
_STREAM_NAMES = {"Stream", "ExternalStream", "set_stream", "stream", "StreamContext",
                 "graph", "CUDAGraph"}
# Modules shared with the verifier even when imported under no name of their own.
_MODULE_ROOTS = {"time", "torch", "triton", "os", "sys", "builtins", "numpy", "functools"}
_HOST_READS = {"numpy", "tolist", "__array__", "__dlpack__", "to_dlpack"}
_JUDGE = ("verify", "tests", "conftest", "pytest", "_pytest", "verify_families")


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _forbidden_import(name: str, reference_module: str | None) -> str | None:
    root = name.split(".")[0]
    if root in _CONCURRENCY:
        return f"imports {name} (threads or processes)"
    if root == "numpy":
        return f"imports {name} (host compute escapes the op allow-list)"
    if root in _JUDGE or root.startswith("test_"):
        return f"imports {name} (the project's verify/ or tests)"
    if reference_module and (name == reference_module or name.startswith(reference_module + ".")):
        return f"imports {name} (the family's reference)"
    if name.split(".")[-1] == "reference":
        return f"imports {name} (a family's reference)"
    return None


def source_problems(source: str, reference_module: str | None = None) -> list[str]:
    """One line per construct a candidate may not use; [] when there is none. A file that does
    not parse is left to the loader (its SyntaxError is the reason)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    problems: list[str] = []
    # every name an import binds: assigning to one of their attributes patches a shared module
    roots = set(_MODULE_ROOTS)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            roots |= {(a.asname or a.name).split(".")[0] for a in node.names}

    def say(node: ast.AST, what: str) -> None:
        problems.append(f"line {getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (why := _forbidden_import(alias.name, reference_module)):
                    say(node, why)
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if (why := _forbidden_import(module.lstrip("."), reference_module)):
                say(node, why)
            for alias in node.names:
                if alias.name in _STREAM_NAMES and "cuda" in module:
                    say(node, f"imports {module}.{alias.name} (stream creation)")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) \
                else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(
                            sub.value, (ast.Name, ast.Attribute)):
                        owner = _dotted(sub.value)
                        if owner and owner.split(".")[0] in roots:
                            say(node, f"assigns {owner}.{sub.attr} (monkeypatching; timer "
                                      "patching if it is a clock or a synchronise)")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            last = name.split(".")[-1]
            if last == "setattr" and node.args and _dotted(node.args[0]).split(".")[0] \
                    in roots:
                say(node, f"setattr on {_dotted(node.args[0])} (monkeypatching)")
            elif name.startswith("os.") and last in _CONCURRENCY_CALLS:
                say(node, f"calls {name} (threads or processes)")
            elif last in _HOST_READS and isinstance(node.func, ast.Attribute):
                say(node, f"calls .{last}() (reads tensor values on the host: a wrapper needs "
                          "shapes and pointers, and host compute escapes the op allow-list)")
            elif last in _STREAM_NAMES and ("cuda" in name or name.startswith("torch.")):
                say(node, f"calls {name} (stream creation: work off the caller's stream)")
            elif last in ("__import__", "import_module") and node.args and isinstance(
                    node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                if (why := _forbidden_import(node.args[0].value, reference_module)):
                    say(node, why)
        elif isinstance(node, ast.Attribute) and node.attr in ("Stream", "ExternalStream"):
            say(node, f"uses {_dotted(node)} (stream creation)")
    return list(dict.fromkeys(problems))


def check_source(path: str | Path, reference_module: str | None = None) -> list[str]:
    """source_problems of the file at `path` ([] when it cannot be read: the loader says so)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return []
    return source_problems(text, reference_module)
