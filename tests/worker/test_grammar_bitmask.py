"""The sampler's structured-output bitmask: applied per row, before every other feature,
with no new compile for any mix of constrained and free rows."""

from __future__ import annotations

import jax
import numpy as np

from tests.sampling_batch import build_sampling_metadata
from xlm.sampling_params import SamplingParams
from xlm.worker.sampler import SamplerConfig, sample_jit

V, R, L = 100, 4, 16


def bitmask(allowed: list[int]) -> np.ndarray:
    bits = np.zeros(((V + 31) // 32) * 32, np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def build(params, grammar=None):
    return build_sampling_metadata(
        params, [[] for _ in params], [[] for _ in params], R, V, L, grammar_bitmask=grammar
    )


def test_bitmask_restricts_rows_and_comes_before_logit_bias():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(R, V)).astype(np.float32)
    allowed = [3, 40, 77, 99]
    greedy = SamplingParams(temperature=0)
    # Row 1 biases a disallowed token up by +100: the bitmask (applied first) still wins.
    biased = SamplingParams(temperature=0, logit_bias={5: 100.0})
    sampled_row = SamplingParams(temperature=1.0, seed=1)
    params = [greedy, biased, sampled_row, greedy]
    md = build(params, {0: bitmask(allowed), 1: bitmask(allowed), 2: bitmask(allowed)})
    cfg = SamplerConfig()
    before = sample_jit._cache_size()
    out = jax.device_get(sample_jit(logits, md, cfg))
    ids = out.sampled_token_ids
    assert ids[0] == allowed[int(np.argmax(logits[0, allowed]))]
    assert ids[1] == allowed[int(np.argmax(logits[1, allowed]))]
    assert ids[2] in allowed
    assert ids[3] == int(np.argmax(logits[3]))  # the free row is untouched
    # Free-only and all-constrained steps reuse the same program.
    for grammar in (None, {i: bitmask([7]) for i in range(R)}):
        out = jax.device_get(sample_jit(logits, build(params, grammar), cfg))
        if grammar:
            assert (out.sampled_token_ids == 7).all()
    assert sample_jit._cache_size() == before + 1


def test_bit_layout_matches_llguidance():
    """Bit i of word w is token 32 * w + i, as llguidance fills it."""
    import llguidance.numpy as llnp

    mask = llnp.allocate_token_bitmask(1, V)
    mask[:] = 0
    mask[0] = bitmask([0, 31, 32, 63, 64, 99])
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [0, 31, 32, 63, 64, 99]
    logits = np.zeros((1, V), np.float32)
    llnp.apply_token_bitmask_inplace(logits, mask)
    assert np.flatnonzero(np.isfinite(logits[0])).tolist() == [0, 31, 32, 63, 64, 99]
