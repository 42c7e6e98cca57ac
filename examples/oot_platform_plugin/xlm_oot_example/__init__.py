"""Entry points of the example out-of-tree plugin."""

import os


def detect_platform() -> str | None:
    """Activate the example platform only when XLM_OOT_EXAMPLE=1 asks for it."""
    if os.environ.get("XLM_OOT_EXAMPLE") == "1":
        return "xlm_oot_example.platform.ExampleOotPlatform"
    return None


def register_ops() -> None:
    """General plugin: substitute the example RMSNorm for xlm's."""
    from xlm_oot_example import ops  # noqa: F401  (registration happens on import)
