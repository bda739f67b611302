"""Loading candidate source files (generated, proposed or hand-written) as callables.

Every candidate is a standalone Python file defining `forward(*inputs, out, **params)`; each is
imported under its own unique module name so that two candidates of one family, or two
versions of one file, never share a module object or a Triton JIT cache entry keyed on it.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import itertools
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

_counter = itertools.count()


def load_module(path: str | Path):
    """Import the file at `path` as a fresh module (registered in sys.modules: Triton's JIT
    looks its kernels' globals up through the module, and dataclasses/pickling need it)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"candidate source not found: {path}")
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    name = f"_candidate_{stem}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_forward(path: str | Path) -> Callable[..., None]:
    """The `forward` entry point of the candidate file at `path`."""
    module = load_module(path)
    forward = getattr(module, "forward", None)
    if not callable(forward):
        raise AttributeError(f"{path} defines no callable `forward(*inputs, out, **params)`")
    return forward


def kernel_source(kernel) -> str:
    """A `@triton.jit` function's own text, so a rendered file runs exactly this kernel."""
    return textwrap.dedent(inspect.getsource(kernel.fn))


_CUDA_KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")


def kernel_names(text: str) -> set[str]:
    """The GPU kernel names a candidate's source can launch, as a profiler trace names them:
    its `@triton.jit` functions (helpers too, which never show) and its CUDA `__global__`
    functions (a template's trace name holds the name as a word)."""
    names = set(_CUDA_KERNEL.findall(text))
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return names
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list):
            names.add(node.name)
    return names
