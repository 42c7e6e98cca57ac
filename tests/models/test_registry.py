"""ModelRegistry: built-in architectures, plugin registration, clear errors."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil

import pytest

import xlm.plugins
from xlm.config import ModelConfig, XlmConfig
from xlm.models import ModelRegistry, register_model
from xlm.models.llama import LlamaForCausalLM
from xlm.models.loader import get_model


class PluginLlama(LlamaForCausalLM):
    """An out-of-tree architecture: Llama under another name."""


def register_plugin_model() -> None:
    """The general plugin's entry point."""
    register_model("PluginLlamaForCausalLM", "tests.models.test_registry:PluginLlama")


@pytest.fixture
def clean_registry():
    before = dict(ModelRegistry.models)
    yield ModelRegistry
    ModelRegistry.models.clear()
    ModelRegistry.models.update(before)


def test_builtin_architectures_resolve(clean_registry):
    for arch in ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]:
        cfg = type("Cfg", (), {"architectures": ["Unknown", arch]})()
        cls, name = ModelRegistry.resolve(cfg)
        assert name == arch and cls.__name__ == arch


def test_general_plugin_registers_architecture(
    tmp_path, tiny_checkpoint, monkeypatch, clean_registry
):
    ep = importlib.metadata.EntryPoint(
        name="my_models",
        value="tests.models.test_registry:register_plugin_model",
        group=xlm.plugins.GENERAL_PLUGINS_GROUP,
    )
    monkeypatch.setattr(
        xlm.plugins,
        "entry_points",
        lambda group: [ep] if group == xlm.plugins.GENERAL_PLUGINS_GROUP else [],
    )
    monkeypatch.setattr(xlm.plugins, "_general_plugins_loaded", False)
    monkeypatch.delenv("XLM_PLUGINS", raising=False)
    model_dir = str(tmp_path / "m")
    shutil.copytree(tiny_checkpoint("llama"), model_dir)
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = ["PluginLlamaForCausalLM"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    model = get_model(XlmConfig(ModelConfig(model=model_dir)))
    assert type(model).__name__ == "PluginLlama"
    assert "PluginLlamaForCausalLM" in ModelRegistry.get_supported_archs()


def test_register_class_directly_and_bad_qualname(clean_registry):
    register_model("DirectForCausalLM", PluginLlama)
    cfg = type("Cfg", (), {"architectures": ["DirectForCausalLM"]})()
    assert ModelRegistry.resolve(cfg)[0] is PluginLlama
    with pytest.raises(ValueError, match="module.path:ClassName"):
        register_model("Bad", "no_colon")


def test_unknown_and_missing_architectures(clean_registry):
    with pytest.raises(ValueError, match="Fancy.*not supported.*LlamaForCausalLM"):
        ModelRegistry.resolve(type("Cfg", (), {"architectures": ["Fancy"]})())
    with pytest.raises(ValueError, match="no 'architectures'.*Qwen3MoeForCausalLM"):
        ModelRegistry.resolve(type("Cfg", (), {"model_type": "llama"})())
