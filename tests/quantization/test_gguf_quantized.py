"""quantization="gguf": a GGUF's own block quants kept as int8 codes with per-group scales
(and minimums), never expanded to float32. The engine equals the same file dequantized to
float32 (the representation is exact), on the real SmolLM2 (Q4_1 projections with
llama.cpp's Q/K permutation, a fused gate | up) and on a tiny Llama mixing five types."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import xlm
from tests.engine.reference import SMOLLM2_ENGINE, TINY_ENGINE
from tests.models.gguf_fixtures import VOCAB, random_hf_state_dict, write_gguf

TYPES = [Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.Q4_0, Q.Q5_1]


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def stored(llm) -> dict:
    from flax import nnx

    flat = nnx.to_flat_state(runner_of(llm).state)
    return {".".join(map(str, p)): v.get_value() for p, v in flat}


def assert_same_as_dequantized(path: str, engine: dict, prompts, new_tokens: int) -> dict:
    params = xlm.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    results = {}
    for quantization in (None, "gguf"):
        llm = xlm.LLM(model=path, quantization=quantization, **engine)
        compiled = llm.llm_engine.num_compilations
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.llm_engine.num_compilations == compiled
        results[quantization] = (outs, stored(llm))
        llm.llm_engine.engine_core.shutdown()
    (plain, _), (kept, params_kept) = results[None], results["gguf"]
    for a, b in zip(plain, kept):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp_a = [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lp_b = [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        np.testing.assert_allclose(lp_b, lp_a, atol=1e-4)
    return params_kept


def test_smollm2_q4_1_kept_equals_dequantized(smollm2_gguf):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, size=n).tolist() for n in (7, 40)]
    params = assert_same_as_dequantized(smollm2_gguf, SMOLLM2_ENGINE, prompts, 12)
    kernel = params["model.layers.0.mlp.gate_up_proj.kernel"]
    assert kernel.dtype == np.int8 and kernel.shape == (576, 2 * 1536)
    # Q4_1: 4-bit codes, a scale and a minimum per 32 inputs.
    assert 0 <= kernel.min() and kernel.max() <= 15
    assert params["model.layers.0.mlp.gate_up_proj.weight_scale"].shape == (576 // 32, 3072)
    assert params["model.layers.0.mlp.gate_up_proj.weight_min"].shape == (576 // 32, 3072)
    q_bytes = sum(v.nbytes for k, v in params.items() if ".layers." in k)
    assert q_bytes < 0.35 * 4 * sum(v.size for k, v in params.items() if k.endswith("kernel"))


def test_mixed_block_types_kept_equal_dequantized(tmp_path, tiny_checkpoint):
    sd = random_hf_state_dict("llama", seed=3)
    projections = [n for n in sd if "_proj." in n]
    types = {n: TYPES[i % len(TYPES)] for i, n in enumerate(projections)}
    path = write_gguf(str(tmp_path / "mixed.gguf"), "llama", sd, quant_types=types)
    # The file has no tokenizer: the tiny checkpoints' one (a larger vocabulary) decodes.
    engine = dict(TINY_ENGINE, tokenizer=tiny_checkpoint("llama"))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 30)]
    params = assert_same_as_dequantized(path, engine, prompts, 10)
    assert all(v.dtype == np.int8 for k, v in params.items() if k.endswith("kernel"))


def test_gguf_needs_a_gguf_file(tiny_checkpoint):
    with pytest.raises(ValueError, match="quantization='gguf'.*not a GGUF"):
        xlm.LLM(model=tiny_checkpoint("llama"), quantization="gguf", **TINY_ENGINE)
