"""Plugins found through entry points: platform plugins and general plugins."""

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from xlm import envs
from xlm.logger import init_logger

logger = init_logger(__name__)

PLATFORM_PLUGINS_GROUP = "xlm.platform_plugins"
GENERAL_PLUGINS_GROUP = "xlm.general_plugins"

_general_plugins_loaded = False


def load_plugins_by_group(group: str) -> dict[str, Callable[[], Any]]:
    """Load the entry points of a group, filtered by XLM_PLUGINS; failures are logged, skipped."""
    discovered = entry_points(group=group)
    if not discovered:
        logger.debug("No plugins for group %s found.", group)
        return {}
    allowed = envs.XLM_PLUGINS
    plugins: dict[str, Callable[[], Any]] = {}
    for plugin in discovered:
        if allowed is not None and plugin.name not in allowed:
            logger.debug("Plugin %s (group %s) skipped: not in XLM_PLUGINS.", plugin.name, group)
            continue
        try:
            plugins[plugin.name] = plugin.load()
            logger.debug("Loaded plugin %s (%s) from group %s.", plugin.name, plugin.value, group)
        except Exception:
            logger.exception(
                "Failed to load plugin %s (%s) of group %s; skipping it.",
                plugin.name,
                plugin.value,
                group,
            )
    return plugins


def load_general_plugins() -> None:
    """Run every general plugin once per process; calling again does nothing."""
    global _general_plugins_loaded
    if _general_plugins_loaded:
        return
    _general_plugins_loaded = True
    for name, func in load_plugins_by_group(GENERAL_PLUGINS_GROUP).items():
        try:
            func()
        except Exception:
            logger.exception("General plugin %s failed; skipping it.", name)
