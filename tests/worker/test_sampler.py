"""The on-device sampler against numpy references on tiny vocabularies."""

import jax
import numpy as np
import pytest

from tests.sampling_batch import build_sampling_metadata
from xlm.sampling_params import SamplingParams
from xlm.worker.sampler import (
    SamplerConfig,
    _sample_full,
    compute_prompt_logprobs,
    process_logits,
    sample_jit,
)

V = 16
L = 32
rng = np.random.default_rng(0)


def _build(params, outputs=None, prompts=None, R=None, step_seed=0):
    n = len(params)
    outputs = outputs or [[] for _ in range(n)]
    prompts = prompts or [[1, 2] for _ in range(n)]
    R = R or (8 if n <= 8 else n)  # one padded size for the small tests: one compile
    return build_sampling_metadata(params, outputs, prompts, R, V, L, step_seed=step_seed)


def _sample(logits, md, cfg):
    """sample_jit with logits padded to the metadata's row count."""
    pad = md.temperature.shape[0] - logits.shape[0]
    out = sample_jit(np.pad(logits, ((0, pad), (0, 0))), md, cfg)
    return jax.tree.map(lambda a: a[: logits.shape[0]], out)


def _ref_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Exact sampling distribution after temperature/min_p/top_k/top_p (vLLM's order)."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k > 0:
        kth = np.sort(np.where(keep, x, -np.inf))[::-1][top_k - 1]
        keep &= x >= kth
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    order = np.argsort(-q, kind="stable")
    mass_before = np.cumsum(q[order]) - q[order]
    keep_p = np.zeros_like(keep)
    keep_p[order] = mass_before < top_p
    q = np.where(keep_p, q, 0.0)
    return q / q.sum()


@pytest.mark.parametrize(
    "kwargs, cap",
    [
        ({"temperature": 0.7}, 64),
        ({"temperature": 1.3, "top_k": 5}, 64),
        ({"temperature": 1.0, "top_p": 0.7}, 64),
        ({"temperature": 0.9, "min_p": 0.1}, 64),
        ({"temperature": 0.8, "top_k": 9, "top_p": 0.9, "min_p": 0.02}, 64),
        # Candidate set smaller than the top-k/top-p sets: the exact bisection path.
        ({"temperature": 2.0, "top_k": 11, "top_p": 0.95}, 4),
    ],
)
def test_sampling_distribution_matches_exact_probabilities(kwargs, cap):
    logits = rng.standard_normal(V).astype(np.float32) * 2
    params = SamplingParams(seed=1234, **kwargs)
    N = 20000
    md = _build([params] * N)
    md.output_lens[:] = np.arange(N)  # the same seeded request at N different steps
    out = sample_jit(np.tile(logits, (N, 1)), md, SamplerConfig(top_k_cap=cap))
    freq = np.bincount(np.asarray(out.sampled_token_ids), minlength=V) / N
    expected = _ref_probs(logits, **kwargs)
    assert np.all(freq[expected == 0] == 0), "a filtered-out token was sampled"
    # Binomial std <= sqrt(0.25 / 20000) = 0.0035: a 0.015 bound is > 4 sigma (seeds fixed).
    np.testing.assert_allclose(freq, expected, atol=0.015)
    chi2 = np.sum((freq - expected)[expected > 0] ** 2 / expected[expected > 0]) * N
    assert chi2 < 3 * V + 30


def test_greedy_is_argmax_of_processed_logits():
    logits = rng.standard_normal((6, V)).astype(np.float32)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=1e-6), None, None]
    out = _sample(logits, _build(params), SamplerConfig())
    np.testing.assert_array_equal(np.asarray(out.sampled_token_ids), logits.argmax(-1))


@pytest.mark.parametrize("logprobs", [None, 2])
def test_greedy_rows_alone_take_the_argmax_as_the_full_path(logprobs):
    """All-greedy steps that ask for nothing else skip the full path's conditionals: the
    same ids (first index of a tie, in the two-level argmax's blocks) and zero logprob
    outputs; asking for logprobs goes the full way."""
    vocab, cfg = 4099, SamplerConfig(max_num_logprobs=4)
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    logits[1, [7, 300, 4098]] = 9.0  # a tie across blocks
    logits[2, [4097, 4098]] = 9.0  # a tie in the padded last block
    params = [SamplingParams(temperature=0.0, logprobs=logprobs)] * 5
    md = build_sampling_metadata(params, [[]] * 5, [[1, 2]] * 5, 8, vocab, L)
    padded = np.pad(logits, ((0, 3), (0, 0)))
    got = jax.tree.map(np.asarray, sample_jit(padded, md, cfg))
    want = jax.tree.map(np.asarray, jax.jit(_sample_full, static_argnums=2)(padded, md, cfg))
    np.testing.assert_array_equal(got.sampled_token_ids[:5], logits.argmax(-1))
    for name in ("sampled_token_ids", "logprobs", "ranks", "topk_ids", "topk_logprobs", "accepted"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert np.any(got.logprobs[:5] != 0) == (logprobs is not None)


def test_seeded_rows_reproducible_across_batches():
    logits = rng.standard_normal((8, V)).astype(np.float32)
    seeded = SamplingParams(seed=7, temperature=1.5, top_p=0.9)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0), None]
    a = _build([seeded, others[0]], outputs=[[3, 4], [5]], step_seed=1)
    b = _build(
        [others[1], others[2], others[0], seeded], outputs=[[], [], [1], [3, 4]], R=8, step_seed=99
    )
    cfg = SamplerConfig()
    rows_a, rows_b = np.array([logits[0], logits[1]]), np.stack([logits[2]] * 3 + [logits[0]] * 5)
    ta = np.asarray(_sample(rows_a, a, cfg).sampled_token_ids)[0]
    tb = np.asarray(_sample(rows_b, b, cfg).sampled_token_ids)[3]
    assert ta == tb
    # The same request at the next step draws a fresh number (not stuck on one token).
    draws = set()
    for step in range(40):
        md = _build([seeded], outputs=[[0] * step])
        draws.add(int(np.asarray(_sample(logits[:1], md, cfg).sampled_token_ids)[0]))
    assert len(draws) > 3


def _ref_process(logits, p, out_ids, prompt_ids):
    x = logits.astype(np.float64).copy()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.allowed_token_ids is not None:
        mask = np.ones(V, bool)
        mask[p.allowed_token_ids] = False
        x[mask] = -np.inf
    counts = np.bincount(out_ids, minlength=V)
    seen = (counts > 0) | (np.bincount(prompt_ids, minlength=V) > 0)
    rep = np.where(seen, p.repetition_penalty, 1.0)
    x = np.where(x > 0, x / rep, x * rep)
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return x


def test_penalties_bias_and_allowed_ids_match_reference():
    logits = rng.standard_normal((4, V)).astype(np.float32) * 3
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(logit_bias={2: 5.0, 7: -3.0}, repetition_penalty=0.8),
        SamplingParams(allowed_token_ids=[1, 3, 5], frequency_penalty=-1.0),
        SamplingParams(),
    ]
    outs = [[1, 1, 4, 9], [2, 2], [3, 1, 1], [5]]
    prompts = [[0, 4, 6], [7, 8], [11], [5]]
    md = _build(params, outputs=outs, prompts=prompts)
    got = np.asarray(jax.jit(process_logits)(np.pad(logits, ((0, 4), (0, 0))), md))
    for i in range(4):
        np.testing.assert_allclose(
            got[i], _ref_process(logits[i], params[i], outs[i], prompts[i]), rtol=1e-6, atol=1e-6
        )


def test_min_tokens_and_bad_words_masks():
    p = SamplingParams(min_tokens=3, stop_token_ids=[4], bad_words=["x"])
    p.all_stop_token_ids.add(0)  # EOS
    p._bad_words_token_ids = [[9], [5, 6, 7]]
    logits = np.zeros((1, V), np.float32)

    def banned(out):
        got = np.asarray(jax.jit(process_logits)(logits, _build([p], outputs=[out], R=1)))[0]
        return set(np.flatnonzero(np.isneginf(got)).tolist())

    assert banned([1, 2]) == {0, 4, 9}  # min_tokens not reached: EOS and stop ids masked
    assert banned([1, 2, 3]) == {9}
    assert banned([1, 2, 5, 6]) == {9, 7}  # the prefix of a multi-token bad word matched
    assert banned([5, 6, 1]) == {9}


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_and_ranks(mode):
    logits = rng.standard_normal((3, V)).astype(np.float32)
    params = [
        SamplingParams(temperature=0, logprobs=3, logit_bias={0: 2.0}),
        SamplingParams(temperature=0.5, logprobs=5, seed=3),
        SamplingParams(temperature=0.7, top_k=4, logprobs=0, seed=4),
    ]
    md = _build(params)
    out = _sample(logits, md, SamplerConfig(max_num_logprobs=5, logprobs_mode=mode))
    ids = np.asarray(out.sampled_token_ids)
    for i in range(3):
        if mode == "raw_logprobs":
            src = logits[i].astype(np.float64)
        else:
            x = logits[i].astype(np.float64) + (2.0 * (np.arange(V) == 0) if i == 0 else 0)
            src = (
                x
                if i == 0
                else np.log(_ref_probs(logits[i], params[i].temperature, top_k=params[i].top_k))
            )
        ref = src - np.logaddexp.reduce(src)
        np.testing.assert_allclose(np.asarray(out.logprobs)[i], ref[ids[i]], rtol=1e-5, atol=1e-5)
        assert np.asarray(out.ranks)[i] == np.sum(ref >= ref[ids[i]])
        order = np.argsort(-ref, kind="stable")[:5]
        np.testing.assert_array_equal(np.asarray(out.topk_ids)[i], order)
        np.testing.assert_allclose(np.asarray(out.topk_logprobs)[i], ref[order], atol=1e-5)


def test_prompt_logprobs():
    logits = rng.standard_normal((5, V)).astype(np.float32)
    nxt = np.array([3, 1, 4, 1, 5], np.int32)
    lp, ranks, top_ids, top_lps = jax.jit(compute_prompt_logprobs, static_argnums=2)(logits, nxt, 2)
    ref = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(lp), ref[np.arange(5), nxt], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(top_ids), np.argsort(-ref, axis=-1)[:, :2])
    assert np.asarray(ranks).tolist() == [int(np.sum(ref[i] >= ref[i, nxt[i]])) for i in range(5)]


def test_no_recompile_across_feature_mixes():
    cfg = SamplerConfig(max_num_logprobs=4)
    logits = rng.standard_normal((8, V)).astype(np.float32)
    mixes = [
        [SamplingParams(temperature=0)],
        [SamplingParams(), SamplingParams(top_p=0.5, seed=1)],
        [SamplingParams(repetition_penalty=1.2, logprobs=2), None, SamplingParams(top_k=3)],
        [SamplingParams(logit_bias={1: 1}, allowed_token_ids=[1, 2], min_p=0.2)],
    ]
    sample_jit(logits, _build(mixes[0], R=8), cfg)
    size = sample_jit._cache_size()
    for params in mixes[1:]:
        jax.block_until_ready(sample_jit(logits, _build(params, R=8), cfg))
    assert sample_jit._cache_size() == size
