"""Entry-point loading: XLM_PLUGINS filtering, failures skipped, general plugins once."""

import logging
from importlib.metadata import EntryPoint

import pytest

import xlm.plugins as plugins

CALLS: list[str] = []


def plugin_a():
    CALLS.append("a")


def plugin_b():
    CALLS.append("b")


def _eps(group):
    return [
        EntryPoint("a", f"{__name__}:plugin_a", group),
        EntryPoint("b", f"{__name__}:plugin_b", group),
        EntryPoint("broken", "no_such_module_xyz:func", group),
    ]


@pytest.fixture(autouse=True)
def fake_entry_points(monkeypatch):
    monkeypatch.setattr(plugins, "entry_points", lambda group: _eps(group))
    monkeypatch.setattr(plugins, "_general_plugins_loaded", False)
    CALLS.clear()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (None, {"a", "b"}),
        ("", set()),
        ("a", {"a"}),
        ("a, b", {"a", "b"}),
        ("c", set()),
    ],
)
def test_xlm_plugins_filter(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv("XLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("XLM_PLUGINS", env)
    assert set(plugins.load_plugins_by_group("xlm.test")) == expected


def test_failed_plugin_is_logged_with_its_name_and_skipped(monkeypatch, caplog):
    monkeypatch.delenv("XLM_PLUGINS", raising=False)
    logging.getLogger("xlm").propagate = True
    try:
        with caplog.at_level(logging.ERROR, logger="xlm"):
            loaded = plugins.load_plugins_by_group("xlm.test")
    finally:
        logging.getLogger("xlm").propagate = False
    assert set(loaded) == {"a", "b"}
    assert "broken" in caplog.text and "no_such_module_xyz" in caplog.text


def test_general_plugins_run_once(monkeypatch):
    monkeypatch.delenv("XLM_PLUGINS", raising=False)
    plugins.load_general_plugins()
    plugins.load_general_plugins()
    assert sorted(CALLS) == ["a", "b"]
