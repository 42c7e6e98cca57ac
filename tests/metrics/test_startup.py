"""Start-up phases: timed per engine, imports only for a process's first engine, one line."""

from __future__ import annotations

import logging
import threading
import time

from xlm.metrics import startup


def test_phases_add_up_in_order_and_report_once(caplog, monkeypatch):
    monkeypatch.setattr(startup, "_imports_timed", False)
    startup.begin()
    with startup.phase("weights"):
        time.sleep(0.02)
    with startup.phase("programs"):
        time.sleep(0.01)
    with startup.phase("weights"):  # entered again: adds up
        time.sleep(0.02)
    startup.note("programs", "3 compiled, 0 loaded")
    phases = startup.phases()
    assert list(phases) == ["imports", "weights", "programs"]
    assert phases["weights"] >= 0.04
    # The process started before this test: imports covers at least the interpreter.
    assert phases["imports"] > 0
    xlm_logger = logging.getLogger("xlm")  # it does not propagate to caplog's root handler
    xlm_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="xlm"):
            startup.report("Engine")
            startup.report("Engine")
    finally:
        xlm_logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "ready in" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("Engine ready in ")
    assert "programs 0.0" in lines[0] and "(3 compiled, 0 loaded)" in lines[0]


def test_a_second_engine_times_only_its_own_phases():
    startup.begin()
    with startup.phase("tokenizer"):
        pass
    startup.begin()  # a second engine in the same process
    assert startup.phases() == {}
    with startup.phase("weights"):
        pass
    assert list(startup.phases()) == ["weights"]


def test_process_start_is_in_the_past():
    started = startup.process_start_time()
    assert started is not None and started < time.time()


def test_deferred_work_runs_once_in_the_background_and_a_failure_is_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(startup, "_deferred", [])
    ran = []
    started = threading.Event()

    def job():
        started.wait(5)
        ran.append(threading.current_thread().name)

    def broken():
        raise OSError("disk full")

    startup.defer("a cache", job)
    startup.defer("another cache", broken)
    xlm_logger = logging.getLogger("xlm")
    xlm_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="xlm"):
            thread = startup.run_deferred()
            assert ran == []  # run_deferred returned before the job ran
            started.set()
            thread.join(10)
    finally:
        xlm_logger.removeHandler(caplog.handler)
    assert ran == ["xlm-deferred"]
    assert "Deferred start-up work failed: another cache" in caplog.text
    assert startup.run_deferred() is None  # nothing left: a second step runs nothing
