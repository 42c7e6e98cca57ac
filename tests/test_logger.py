"""xlm.logger: every logger sits under "xlm", configured once, at XLM_LOGGING_LEVEL."""

from __future__ import annotations

import logging

from xlm.logger import init_logger


def test_names_are_put_under_xlm():
    assert init_logger("xlm.engine.core").name == "xlm.engine.core"
    assert init_logger("plugin_mod").name == "xlm.plugin_mod"
    assert init_logger("plugin_mod").parent is logging.getLogger("xlm")


def test_messages_reach_the_xlm_logger_once(caplog):
    root = logging.getLogger("xlm")
    handlers = list(root.handlers)
    init_logger("xlm.a")
    init_logger("xlm.b")
    assert root.handlers == handlers  # configuring again adds no second handler
    with caplog.at_level(logging.INFO, logger="xlm"):
        root.addHandler(caplog.handler)
        try:
            init_logger("xlm.a").info("hello %d", 7)
        finally:
            root.removeHandler(caplog.handler)
    assert [r.getMessage() for r in caplog.records] == ["hello 7"]
