"""The engine on an NVIDIA GPU (`pytest -m gpu tests/gpu`, run by
benchmarks/gpu/device_check.sh with JAX_PLATFORMS=cuda,cpu): greedy tokens of the tiny
families in float32 equal transformers' on the same GPU, with LoRA adapters equal to
transformers + peft there, speculative decoding equal to the engine without it, and zero
compilations after warm-up. Without a GPU they skip; `XLM_GPU_TESTS_ON_CPU=1` runs them on
the CPU instead (how they are checked on a machine without one).

SmolLM2's GGUF (over the 64 MiB a device run carries) is not among them: the families'
tiny checkpoints have its architecture (llama) and Qwen3's."""

from __future__ import annotations

import os

import numpy as np
import pytest

import xlm
from tests.conftest import VOCAB_SIZE
from tests.lora.adapters import write_adapter

pytestmark = pytest.mark.gpu

ENGINE = dict(max_model_len=128, max_num_seqs=8, seed=0, startup_programs="all")
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def device() -> str:
    """The torch device of the reference: the GPU xlm runs on, or the CPU when asked."""
    import jax

    if os.environ.get("XLM_GPU_TESTS_ON_CPU") == "1":
        return "cpu"
    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("no GPU device")
    # Float32 products at full precision on both sides (XLA:GPU and cuBLAS may use TF32).
    jax.config.update("jax_default_matmul_precision", "highest")
    return "cuda"


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(6, VOCAB_SIZE, size=n).tolist() for n in (5, 17, 40)]


def _greedy() -> xlm.SamplingParams:
    return xlm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _torch_greedy(model, prompt: list[int], device: str) -> list[int]:
    import torch

    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _load_torch(path: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_equals_transformers_on_the_same_device(family, tiny_checkpoint, device):
    path = tiny_checkpoint(family)
    llm = xlm.LLM(model=path, dtype="float32", **ENGINE)
    assert llm.llm_engine.num_compilations > 0  # compiled on the device before serving
    compiled = llm.llm_engine.num_compilations
    got = _tokens(llm.generate(_prompts(), _greedy(), use_tqdm=False))
    assert llm.llm_engine.num_compilations == compiled, "a program compiled after warm-up"
    model = _load_torch(path, device)
    assert got == [_torch_greedy(model, p, device) for p in _prompts()]


def test_lora_adapters_equal_transformers_peft_on_the_same_device(
    tiny_checkpoint, device, tmp_path
):
    base = tiny_checkpoint("llama")
    refs = [write_adapter(base, str(tmp_path / f"a{i}"), "llama", seed=i, r=8) for i in (1, 2)]
    loras = [xlm.LoRARequest(f"a{i}", i, str(tmp_path / f"a{i}")) for i in (1, 2)]
    llm = xlm.LLM(
        model=base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE
    )
    compiled = llm.llm_engine.num_compilations
    for lora, ref in zip(loras, refs):
        got = _tokens(llm.generate(_prompts(), _greedy(), use_tqdm=False, lora_request=lora))
        ref = ref.to(device)
        assert got == [_torch_greedy(ref, p, device) for p in _prompts()], lora.lora_name
    assert llm.llm_engine.num_compilations == compiled


def test_speculative_decoding_equals_the_engine_without_it(tiny_checkpoint, device):
    path = tiny_checkpoint("llama")
    # Prompts that repeat themselves, so that prompt lookup proposes and is accepted.
    prompts = [(p * 4)[:60] for p in _prompts()]
    plain = _tokens(
        xlm.LLM(model=path, dtype="float32", **ENGINE).generate(prompts, _greedy(), use_tqdm=False)
    )
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = xlm.LLM(model=path, dtype="float32", speculative_config=spec, **ENGINE)
    compiled = llm.llm_engine.num_compilations
    assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == plain
    assert llm.llm_engine.num_compilations == compiled
    assert llm.get_stats().spec_num_draft_tokens > 0
