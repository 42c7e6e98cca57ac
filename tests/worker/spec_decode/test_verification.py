"""Speculative decoding's verification in the sampler: rejection sampling keeps the
target distribution, greedy rows accept exactly the argmax."""

import numpy as np
import pytest

from tests.worker.test_sampler import V, _build, _ref_probs
from xlm.sampling_params import SamplingParams
from xlm.worker.sampler import SamplerConfig, sample_jit

rng = np.random.default_rng(1)


def _verify(params, logits, drafts, N):
    """N rows of the same request at N positions, each verifying draft `drafts[i]`."""
    md = _build([params] * N)
    md.output_lens[:] = np.arange(N)
    md.draft_token_ids[:] = drafts
    md.any_draft = np.bool_(True)
    out = sample_jit(np.tile(logits, (N, 1)), md, SamplerConfig())
    return np.asarray(out.sampled_token_ids), np.asarray(out.accepted)


def _chi2(freq, expected, n):
    keep = expected > 0
    return np.sum((freq - expected)[keep] ** 2 / expected[keep]) * n


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.8},
        {"temperature": 1.2, "top_k": 5},
        {"temperature": 1.0, "top_p": 0.8},
        {"temperature": 0.9, "top_k": 8, "top_p": 0.9, "min_p": 0.02},
    ],
)
def test_rejection_sampling_keeps_the_target_distribution(kwargs):
    """A row that verifies a proposed token emits the accepted proposal or the residual's
    draw: its token is distributed exactly as the target (the same sampling without
    speculation), for a likely, an unlikely and a filtered-out proposal alike."""
    logits = rng.standard_normal(V).astype(np.float32) * 2
    expected = _ref_probs(logits, **kwargs)
    order = np.argsort(-expected)
    N = 40000
    # Enough draws to see a 2% bias: moving 2% of the mass from the likeliest token to
    # the next fails the chi-square bound below.
    biased = expected.copy()
    biased[order[0]] -= 0.02
    biased[order[1]] += 0.02
    bound = 3 * V + 30
    assert _chi2(biased, expected, N) > bound
    params = SamplingParams(seed=99, **kwargs)
    for draft in (order[0], order[2], order[-1]):
        tokens, accepted = _verify(params, logits, np.full(40000, draft, np.int32), N)
        freq = np.bincount(tokens, minlength=V) / N
        assert np.all(freq[expected == 0] == 0), "a filtered-out token was emitted"
        assert _chi2(freq, expected, N) < bound, (draft, freq, expected)
        # Acceptance happens with the target's probability of the proposal.
        assert abs(accepted.mean() - expected[draft]) < 0.015
        assert np.all(tokens[accepted] == draft)


def test_a_residual_drawn_without_the_rejected_proposal_is_what_keeps_it_exact():
    """The test above would see the classic bug: after a rejection, drawing again from
    the target (not the residual) over-weights the proposal by (1 - p(d)) p(d)."""
    logits = rng.standard_normal(V).astype(np.float32) * 2
    p = _ref_probs(logits, temperature=1.0)
    d = int(np.argmax(p))
    buggy = p * (1 - p[d])
    buggy[d] += p[d]
    assert _chi2(buggy, p, 40000) > 3 * V + 30


def test_greedy_rows_accept_exactly_the_argmax():
    logits = rng.standard_normal((6, V)).astype(np.float32)
    argmax = logits.argmax(-1)
    drafts = np.array([argmax[0], (argmax[1] + 1) % V, -1, argmax[3], 0, argmax[5]], np.int32)
    params = [SamplingParams(temperature=0.0)] * 6
    md = _build(params)
    md.draft_token_ids[:6] = drafts
    md.any_draft = np.bool_(True)
    out = sample_jit(np.pad(logits, ((0, 2), (0, 0))), md, SamplerConfig())
    accepted = np.asarray(out.accepted)[:6]
    assert list(accepted) == [True, False, False, True, bool(argmax[4] == 0), True]
    assert list(np.asarray(out.sampled_token_ids)[:6]) == list(argmax)


def test_rows_without_proposals_sample_as_before():
    """draft -1 everywhere (any_draft off) is the plain sampler, draw for draw."""
    logits = rng.standard_normal((8, V)).astype(np.float32)
    params = [SamplingParams(temperature=0.9, seed=5 + i) for i in range(8)]
    plain = sample_jit(logits, _build(params), SamplerConfig())
    md = _build(params)
    md.any_draft = np.bool_(True)  # the verification branch with no row verifying
    verified = sample_jit(logits, md, SamplerConfig())
    np.testing.assert_array_equal(plain.sampled_token_ids, verified.sampled_token_ids)
    assert not np.asarray(verified.accepted).any()
