"""The "xlm" logger: one handler, level from XLM_LOGGING_LEVEL."""

import logging
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"
_configured = False


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    from xlm import envs

    root = logging.getLogger("xlm")
    if envs.XLM_CONFIGURE_LOGGING:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(envs.XLM_LOGGING_LEVEL)


def init_logger(name: str) -> logging.Logger:
    """Return a logger under the "xlm" hierarchy, configuring it on first use."""
    _configure_root()
    return logging.getLogger(name if name.startswith("xlm") else f"xlm.{name}")
