"""Model library: the registry of architectures, the models and their weight loading."""

from xlm.models.registry import ModelRegistry, register_model

__all__ = ["ModelRegistry", "register_model"]
