"""The pooler: per-row last/mean/CLS pooling, Matryoshka width and normalization over a
packed ragged batch, against numpy and against transformers' last hidden state."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from tests.conftest import VOCAB_SIZE
from tests.paged_batch import BlockAllocator, StepRequest, build_metadata
from xlm.config import ModelConfig, XlmConfig
from xlm.models.loader import get_model
from xlm.pooling_params import PoolingParams, PoolingType
from xlm.worker.pooler import classify_activation, finish_vector, pool, pooling_metadata

BLOCK_SIZE = 4


def np_pool(hidden: np.ndarray, p: PoolingParams) -> np.ndarray:
    """The reference: one request's hidden states [L, H] -> its vector."""
    v = {PoolingType.LAST: hidden[-1], PoolingType.MEAN: hidden.mean(0), PoolingType.CLS: hidden[0]}
    v = v[p.pooling_type][: p.dimensions]
    return v / np.linalg.norm(v) if p.normalize else v


def pool_packed(hidden: np.ndarray, lengths: list[int], params: list[PoolingParams], rows: int):
    cu = np.full(rows + 1, sum(lengths), np.int32)
    cu[0] = 0
    cu[1 : len(lengths) + 1] = np.cumsum(lengths)
    md = pooling_metadata(params, rows, hidden.shape[1])
    out = np.asarray(jax.jit(pool)(hidden, cu, **md))
    return [finish_vector(out[i], p) for i, p in enumerate(params)], out


def test_pool_matches_numpy_with_padding():
    rng = np.random.default_rng(0)
    lengths = [5, 1, 9, 3, 2, 7]
    params = [
        PoolingParams(),
        PoolingParams(pooling_type="mean"),
        PoolingParams(pooling_type="cls", normalize=False),
        PoolingParams(pooling_type="mean", dimensions=3),
        PoolingParams(pooling_type="last", normalize=False, dimensions=5),
        PoolingParams(pooling_type="cls", dimensions=8),
    ]
    hidden = rng.normal(size=(40, 8)).astype(np.float32)  # 27 real tokens, 13 padding
    got, raw = pool_packed(hidden, lengths, params, rows=8)
    start = 0
    for n, p, v in zip(lengths, params, got):
        np.testing.assert_allclose(v, np_pool(hidden[start : start + n], p), rtol=1e-5, atol=1e-6)
        start += n
    assert raw[3, 3:].tolist() == [0.0] * 5  # truncated components are zero on device
    assert not raw[len(lengths) :].any()  # padding rows give zero vectors


def hf_last_hidden_state(model_dir: str, token_ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([token_ids])).last_hidden_state[0].numpy()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_packed_batch_of_64_matches_transformers(arch, tiny_checkpoint):
    """64 prompts of mixed lengths in one packed step, each pooled three ways."""
    model_dir = tiny_checkpoint(arch)
    model = get_model(XlmConfig(ModelConfig(model=model_dir, dtype="float32")))
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 13, 64).tolist()
    prompts = [rng.integers(0, VOCAB_SIZE, n).tolist() for n in lengths]
    kinds = list(PoolingType)
    params = [PoolingParams(pooling_type=kinds[i % 3]) for i in range(64)]
    alloc = BlockAllocator(64 * 4 + 1)
    reqs = [StepRequest(alloc.allocate(-(-n // BLOCK_SIZE)), 0, n) for n in lengths]
    num_tokens = 512
    md = build_metadata(reqs, BLOCK_SIZE, num_tokens=num_tokens, num_reqs=64, max_blocks=4)
    ids = np.zeros(num_tokens, np.int32)
    ids[: sum(lengths)] = np.concatenate(prompts)
    graphdef, state = nnx.split(model)
    kv_caches = model.make_kv_caches(64 * 4 + 1, BLOCK_SIZE, np.float32)

    @jax.jit
    def forward(state, ids, kv_caches, md):
        hidden, _ = nnx.merge(graphdef, state)(ids, kv_caches, md)
        return hidden

    hidden = np.asarray(forward(state, ids, kv_caches, md))
    got, _ = pool_packed(hidden, lengths, params, rows=64)
    # Alone: the first prompt in a batch of its own gives the same vector.
    alone, _ = pool_packed(hidden[: lengths[0]], lengths[:1], params[:1], rows=1)
    np.testing.assert_allclose(alone[0], got[0], rtol=1e-6, atol=1e-7)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        ref = np_pool(hf_last_hidden_state(model_dir, prompt), p)
        np.testing.assert_allclose(got[i], ref, atol=1e-4, err_msg=f"{arch} prompt {i} {p}")


def test_classify_rows_are_never_normalized_and_take_vllms_activation():
    params = [PoolingParams(task="classify"), PoolingParams(), PoolingParams(task="classify")]
    rows = pooling_metadata(params, 4, 8)
    assert rows["normalize"].tolist() == [False, True, False, False]
    logits = np.array([0.5, -1.0, 2.0], np.float32)
    e = np.exp(logits - logits.max())
    np.testing.assert_allclose(classify_activation(logits), e / e.sum(), rtol=1e-6)
    np.testing.assert_allclose(classify_activation(np.array([0.3])), [1 / (1 + np.exp(-0.3))])
    raw = finish_vector(logits, PoolingParams(task="classify", activation=False))
    np.testing.assert_array_equal(raw, logits)
    np.testing.assert_allclose(finish_vector(logits, params[0]), e / e.sum(), rtol=1e-6)
