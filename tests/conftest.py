"""CPU by default: Triton kernels run under the interpreter when no CUDA device is present.

TRITON_INTERPRET must be set before any module with @triton.jit is imported, hence here.
"""

import inspect
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist (the README's `-n 2`) each worker gets one core's worth of intra-op
# threads: two workers with torch's default of one thread per core would oversubscribe CI's 2.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


TESTS = Path(__file__).resolve().parent


# trylast: after pytest-xdist's own hook, whose group suffix this one completes
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "loadgroup", False):  # a worker of `-n 2 --dist loadgroup`
        for item in items:
            keep_group(item)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def keep_group(item) -> None:
    """One worker for the tests that share a costly module fixture (an optimized run), so the
    second worker does not build it again: those tests form an xdist group, their module's
    (an explicit `xdist_group` mark names its own). xdist 3.8 marks a group by appending
    "@group" to the item's private `_nodeid`, which pytest 9.2's structured node ids no longer
    read (pytest-dev/pytest-xdist#1386): the suffix is set where the id now lives, as xdist's
    proposed fix does, wherever xdist's own did not take."""
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    if not names and shares_a_module_fixture(item):
        names = [item.nodeid.split("::", 1)[0]]
    group = "_".join(names)
    if not group or item.nodeid.endswith(f"@{group}"):
        return
    if hasattr(item, "_id"):  # pytest >= 9.2
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{group}")
    else:
        item._nodeid = f"{item.nodeid}@{group}"


def shares_a_module_fixture(item) -> bool:
    """The test asks for a module- or wider-scoped fixture of these tests (not a plugin's,
    such as tmp_path_factory)."""
    info = getattr(item, "_fixtureinfo", None)  # a test function's; a doctest has none
    for defs in info.name2fixturedefs.values() if info else ():
        fixture = defs[-1]
        if fixture.scope in ("function", "class"):
            continue
        try:
            where = Path(inspect.getfile(fixture.func)).resolve()
        except TypeError:
            continue
        if where.is_relative_to(TESTS):
            return True
    return False


@pytest.fixture
def call_order(monkeypatch):
    """watch(module, attr="label", ...) wraps those module attributes so each call appends its
    label to the list watch returns (one list per test), then runs the real function."""
    order: list[str] = []

    def watch(module, **labels) -> list[str]:
        for attr, label in labels.items():
            real = getattr(module, attr)

            def wrapped(*args, _real=real, _label=label, **kwargs):
                order.append(_label)
                return _real(*args, **kwargs)
            monkeypatch.setattr(module, attr, wrapped)
        return order
    return watch
