"""Where start-up time goes: phases timed once per process and logged in one line.

Each process that builds part of the engine times its own phases (the API server: its
tokenizer and the wait for the engine process; the engine core: weights, KV cache,
programs) with `startup.phase(name)` after `startup.begin()`, and `startup.report()` logs
them once the engine is ready, beginning with the interpreter and imports (process start
to `begin`). The first step is timed apart: its cost is
part of the first request's latency, not of start-up.

Work a start owes but the first token does not need (writing the dequantized GGUF's
cache) is `defer`red: the engine core calls `run_deferred` after its first step, which
runs it in a background thread that the process waits for at exit. A process that never
runs a step leaves the work to the next start.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from xlm.logger import init_logger

logger = init_logger(__name__)

# Phase name -> seconds, in the order first entered; and a note per phase (e.g. "cached").
_phases: dict[str, float] = {}
_notes: dict[str, str] = {}
_imports_timed = False  # only the first engine of a process timed the imports
_reported = False
_deferred: list[tuple[str, Callable[[], object]]] = []  # (what, job), run after a first step


def process_start_time() -> float | None:
    """When this process started (epoch seconds), from /proc; None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            # The command name (field 2) may hold spaces: fields are counted after its ")".
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22: start time in clock ticks since boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def begin() -> None:
    """An engine starts building here: forget an earlier engine's phases; the first engine
    of the process also gets "imports", from the process start to now."""
    global _imports_timed, _reported
    _phases.clear()
    _notes.clear()
    _reported = False
    if not _imports_timed:
        _imports_timed = True
        started = process_start_time()
        if started is not None:
            _phases["imports"] = max(0.0, time.time() - started)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time one start-up phase (phases entered again add up)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _phases[name] = _phases.get(name, 0.0) + time.perf_counter() - start


def note(name: str, text: str) -> None:
    """Say something about a phase in the report (what was loaded from a cache, counts)."""
    _notes[name] = text


def phases() -> dict[str, float]:
    """The phases so far, in seconds, in the order they began."""
    return dict(_phases)


def report(what: str) -> None:
    """Log the start-up phases of this process once: `what` is what became ready."""
    global _reported
    if _reported:
        return
    _reported = True
    timed = phases()
    parts = []
    for name, seconds in timed.items():
        extra = f" ({_notes[name]})" if name in _notes else ""
        parts.append(f"{name} {seconds:.2f} s{extra}")
    logger.info("%s ready in %.1f s: %s.", what, sum(timed.values()), ", ".join(parts))


def defer(what: str, job: Callable[[], object]) -> None:
    """Run `job` (`what` names it in a failure's warning) after the first step instead of
    before the first token."""
    _deferred.append((what, job))


def run_deferred() -> threading.Thread | None:
    """Start the deferred jobs in one background thread, waited for at exit; the thread,
    or None when nothing was deferred."""
    jobs = list(_deferred)
    _deferred.clear()
    if not jobs:
        return None
    thread = threading.Thread(target=_run_jobs, args=(jobs,), name="xlm-deferred", daemon=True)
    thread.start()
    atexit.register(thread.join)  # a job may be writing a cache entry: let it finish
    return thread


def _run_jobs(jobs: list[tuple[str, Callable[[], object]]]) -> None:
    for what, job in jobs:
        try:
            job()
        except Exception:
            logger.warning("Deferred start-up work failed: %s.", what, exc_info=True)
