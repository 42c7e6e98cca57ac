"""LLM.embed on tiny random checkpoints: vectors equal transformers' last hidden state pooled
the same way, alone and in a packed batch of 64 mixed-length inputs; zero compilations after
warm-up; every KV block free afterwards; requests the runner cannot serve are refused."""

from __future__ import annotations

import numpy as np
import pytest

import xlm
from tests.conftest import VOCAB_SIZE
from tests.worker.test_pooler import hf_last_hidden_state, np_pool
from xlm.engine.exceptions import RequestValidationError
from xlm.pooling_params import PoolingParams, PoolingType

ENGINE = dict(
    runner="pooling",
    max_model_len=128,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    token_buckets=[32, 2048],
    kv_cache_memory=0.02,
    dtype="float32",
)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def embedder(request, tiny_checkpoint):
    model_dir = tiny_checkpoint(request.param)
    llm = xlm.LLM(model=model_dir, **ENGINE)
    return model_dir, llm


def reference(model_dir: str, prompt: list[int], params: PoolingParams) -> np.ndarray:
    return np_pool(hf_last_hidden_state(model_dir, prompt), params)


def test_one_input_each_pooling_equals_transformers(embedder):
    model_dir, llm = embedder
    prompt = np.random.default_rng(0).integers(0, VOCAB_SIZE, 11).tolist()
    for params in (
        PoolingParams(),
        PoolingParams(pooling_type="mean"),
        PoolingParams(pooling_type="cls", normalize=False),
        PoolingParams(pooling_type="last", dimensions=8),
    ):
        [out] = llm.embed([prompt], params, use_tqdm=False)
        assert out.prompt_token_ids == prompt and out.finished
        assert out.outputs.data.dtype == np.float32
        assert len(out.outputs.embedding) == (params.dimensions or out.outputs.data.size)
        np.testing.assert_allclose(
            out.outputs.data, reference(model_dir, prompt, params), rtol=1e-4, atol=1e-4
        )


def test_packed_batch_of_64_equals_transformers_and_frees_its_blocks(embedder):
    model_dir, llm = embedder
    engine = llm.llm_engine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB_SIZE, int(n)).tolist() for n in rng.integers(1, 40, 64)]
    kinds = list(PoolingType)
    params = [PoolingParams(pooling_type=kinds[i % 3], normalize=i % 2 == 0) for i in range(64)]
    llm.embed(prompts[:2], params[:2], use_tqdm=False)  # warm (programs compiled at start)
    compiles = engine.num_compilations
    outs = llm.embed(prompts, params, use_tqdm=False)
    assert engine.num_compilations == compiles, "the pooling runner compiled after warm-up"
    for prompt, p, out in zip(prompts, params, outs):
        np.testing.assert_allclose(
            out.outputs.data, reference(model_dir, prompt, p), rtol=1e-4, atol=1e-4
        )
    core = engine.engine_core.engine_core
    kv = core.scheduler.kv_cache_manager
    assert not core.scheduler.requests
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks - 1  # null block


def test_a_shared_prefix_is_read_from_the_cache_for_last_token_pooling(embedder):
    model_dir, llm = embedder
    prefix = list(range(1, 33))  # two full blocks of 16
    first, second = prefix + [40, 41], prefix + [50, 51, 52]
    llm.embed([first], use_tqdm=False)
    [out] = llm.embed([second], use_tqdm=False)
    assert out.num_cached_tokens == 32
    np.testing.assert_allclose(
        out.outputs.data, reference(model_dir, second, PoolingParams()), rtol=1e-4, atol=1e-4
    )
    [mean] = llm.embed([second], PoolingParams(pooling_type="mean"), use_tqdm=False)
    assert mean.num_cached_tokens == 0  # mean pooling reads every prompt token's state
    np.testing.assert_allclose(
        mean.outputs.data,
        reference(model_dir, second, PoolingParams(pooling_type="mean")),
        rtol=1e-4,
        atol=1e-4,
    )


def test_bad_requests_name_the_limit_and_the_engine_serves_on(embedder):
    _, llm = embedder
    with pytest.raises(RequestValidationError, match="embedding model.*LLM.embed"):
        llm.generate(["hello"], use_tqdm=False)
    with pytest.raises(RequestValidationError, match=r"dimensions=999 .*allowed 1 to"):
        llm.embed([[1, 2, 3]], PoolingParams(dimensions=999), use_tqdm=False)
    with pytest.raises(RequestValidationError, match="200 tokens.*maximum model length of 128"):
        llm.embed([[1] * 200], use_tqdm=False)
    [whole] = llm.embed([[1] * 128], use_tqdm=False)  # no room for output needed
    assert whole.outputs.data.size
    with pytest.raises(ValueError, match="pooling_type='max' is invalid"):
        PoolingParams(pooling_type="max")
    [out] = llm.embed([[1, 2, 3]], use_tqdm=False)
    assert out.outputs.data.shape == (llm.llm_engine.processor.pooling.hidden_size,)


def test_a_generating_model_refuses_embed(tiny_checkpoint):
    llm = xlm.LLM(
        model=tiny_checkpoint("llama"),
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=[32],
        kv_cache_memory=0.01,
    )
    with pytest.raises(RequestValidationError, match="generates text.*--runner pooling"):
        llm.embed(["hello"], use_tqdm=False)
    assert llm.generate(["hello"], xlm.SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_headless_base_model_checkpoint_is_an_embedder(tiny_checkpoint, tmp_path):
    """A `Qwen3Model` checkpoint (no LM head, tensors without the "model." prefix, as
    e5-mistral and other embedders ship): runner "auto" picks pooling and it loads."""
    import json
    import shutil
    from pathlib import Path

    import torch
    from transformers import AutoModel

    source = tiny_checkpoint("qwen3")
    base_dir = tmp_path / "qwen3-base"
    AutoModel.from_pretrained(source, dtype=torch.float32).save_pretrained(base_dir)
    for tokenizer_file in Path(source).glob("*token*"):
        shutil.copy(tokenizer_file, base_dir / tokenizer_file.name)
    assert json.loads((base_dir / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    llm = xlm.LLM(model=str(base_dir), **{k: v for k, v in ENGINE.items() if k != "runner"})
    assert llm.llm_engine.processor.pooling is not None  # chosen from the checkpoint
    prompt = [5, 9, 17, 3, 44]
    [out] = llm.embed([prompt], use_tqdm=False)
    np.testing.assert_allclose(
        out.outputs.data, reference(source, prompt, PoolingParams()), rtol=1e-4, atol=1e-4
    )


def test_a_sentence_transformers_dense_module_is_refused_at_start(tiny_checkpoint, tmp_path):
    """An embedder whose modules.json projects the pooled vector (2_Dense) would give other
    embeddings without it: the engine refuses the checkpoint instead of serving it."""
    import shutil

    from tests.models.test_pooling_config import write_st

    model_dir = tmp_path / "st-dense"
    shutil.copytree(tiny_checkpoint("llama"), model_dir)
    write_st(model_dir, "mean_tokens", normalize=False, dense=True)
    with pytest.raises(ValueError, match="Dense"):
        xlm.LLM(model=str(model_dir), **ENGINE)
