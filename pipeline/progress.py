"""Progress of a long command: rich's status line on a terminal, plain lines in a log.

A status line redraws itself in place and exists only on a terminal; redirected to a file it
leaves nothing, so a log of a five-minute GPU run showed no sign of life. Off a terminal each
step is one line with the seconds since the command started. A step that runs longer than
`HEARTBEAT_S` (building a full-size model on the CPU, timing its passes) says so again every
`HEARTBEAT_S`, with how long it has run, so a quiet log is a stuck run and not a slow step
(a 1.2B-parameter profile on the CPU went 115 s without a line: issue #65).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from rich.console import Console

HEARTBEAT_S = 15.0


@contextmanager
def progress(console: Console, stage: str,
             heartbeat_s: float = HEARTBEAT_S) -> Iterator[Callable[[str], None]]:
    """A `say(step)` for the duration of `stage`."""
    start = time.perf_counter()
    terminal = console.is_terminal and sys.stdout.isatty()
    with ExitStack() as stack:
        if terminal:
            status = stack.enter_context(console.status(stage))

            def show(text: str) -> None:
                status.update(f"{stage}: {text}")
        else:
            def show(text: str) -> None:
                # print(), not the console: a log line must not be wrapped or marked up
                print(f"[{time.perf_counter() - start:7.1f} s] {stage}: {text}", flush=True)

        current = {"step": "start", "since": start, "beats": 0}
        lock = threading.Lock()

        def say(step: str) -> None:
            with lock:
                current.update(step=step, since=time.perf_counter(), beats=0)
                show(step)

        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(heartbeat_s / 3):
                with lock:
                    took = time.perf_counter() - current["since"]
                    if took >= heartbeat_s * (current["beats"] + 1):
                        current["beats"] += 1
                        show(f"{current['step']}: still running, {took:.0f} s")

        if not terminal:
            say("start")
        beater = threading.Thread(target=beat, name="progress-heartbeat", daemon=True)
        beater.start()
        stack.callback(stop.set)
        yield say
