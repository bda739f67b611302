"""Progress of a long command: rich's status line on a terminal, plain lines in a log.

A status line redraws itself in place and exists only on a terminal; redirected to a file it
leaves nothing, so a log of a five-minute GPU run showed no sign of life. Off a terminal each
step is one line with the seconds since the command started.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console


@contextmanager
def progress(console: Console, stage: str) -> Iterator[Callable[[str], None]]:
    """A `say(step)` for the duration of `stage`."""
    start = time.perf_counter()
    if console.is_terminal and sys.stdout.isatty():
        with console.status(stage) as status:
            yield lambda step: status.update(f"{stage}: {step}")
        return

    def say(step: str) -> None:
        # print(), not the console: a log line must not be wrapped or marked up
        print(f"[{time.perf_counter() - start:7.1f} s] {stage}: {step}", flush=True)

    say("start")
    yield say
