"""Speculative decoding's device and host pieces: verification in the sampler, n-gram
proposals, and the configuration's checks."""

import numpy as np
import pytest

from tests.worker.test_sampler import V, _build, _ref_probs
from xlm.config import SpeculativeConfig
from xlm.sampling_params import SamplingParams
from xlm.worker.sampler import SamplerConfig, sample_jit
from xlm.worker.spec_decode import NgramProposer, may_speculate

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


def _ngram_reference(tokens, k, min_n, max_n):
    """Plain loops: the longest suffix (max_n..min_n) with an earlier occurrence; the
    k tokens after its latest occurrence followed by k tokens, else after its first."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        starts = [s for s in range(L - n) if tokens[s : s + n] == suffix]
        if starts:
            full = [s for s in starts if s + n + k <= L]
            start = full[-1] if full else starts[0]
            return tokens[start + n : start + n + k]
    return []


def test_ngram_proposals_match_a_loop_reference():
    proposer = NgramProposer(2, 4)
    r = np.random.default_rng(3)
    for trial in range(300):
        L = int(r.integers(1, 60))
        tokens = r.integers(0, 4 if trial % 2 else 12, L).tolist()
        k = int(r.integers(1, 6))
        got = proposer.propose(np.array(tokens, np.int32), k)
        assert got == _ngram_reference(tokens, k, 2, 4), (tokens, k)


def test_ngram_proposes_the_copied_span():
    tokens = [5, 6, 7, 8, 9, 10, 1, 2, 5, 6, 7]
    assert NgramProposer(1, 3).propose(np.array(tokens), 3) == [8, 9, 10]
    assert NgramProposer(1, 3).propose(np.array([1, 2, 3]), 3) == []
    # In a loop the whole k tokens come from an earlier turn of it.
    assert NgramProposer(1, 3).propose(np.array([4] * 7), 3) == [4, 4, 4]


def test_requests_whose_sampling_reads_their_tokens_are_not_speculated():
    assert may_speculate(SamplingParams(temperature=0.0))
    assert may_speculate(SamplingParams(temperature=0.7, top_p=0.9, seed=1, logprobs=2))
    assert not may_speculate(SamplingParams(presence_penalty=0.5))
    assert not may_speculate(SamplingParams(repetition_penalty=1.2))
    assert not may_speculate(SamplingParams(min_tokens=4, max_tokens=8))


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "eagle"}, "SpeculativeConfig.method='eagle' is invalid"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens=0 is invalid"),
        ({"num_speculative_tokens": 17}, "an integer from 1 to 16"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min=5 is invalid"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size=0 is invalid"),
        ({"method": "draft_model"}, "SpeculativeConfig.model=None is invalid"),
        ({"model": "x"}, "SpeculativeConfig.model='x' is invalid"),
        ({"adaptive": "no"}, "SpeculativeConfig.adaptive='no' is invalid"),
        ({"num_tokens": 3}, "unknown keys ['num_tokens']"),
        ("{not json", "not JSON"),
        (3, "speculative_config=3 is invalid"),
    ],
)
def test_bad_speculative_configs_name_the_parameter(value, message):
    with pytest.raises(ValueError, match=None) as e:
        SpeculativeConfig.from_dict(value)
    assert message in str(e.value)


def test_speculative_config_from_json_and_rows():
    config = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.num_speculative_tokens == 3 and config.disable_by_batch_size == 8
    # At most 8 requests verify 3 + 1 rows each; a 64-request step keeps one row each.
    assert config.rows_needed(64) == 64 and config.rows_needed(4) == 16
    assert SpeculativeConfig(disable_by_batch_size=None).rows_needed(64) == 64 * 4


def test_policy_proposes_what_pays_for_the_longer_step():
    from types import SimpleNamespace

    from xlm.worker.buckets import default_token_buckets
    from xlm.worker.spec_decode import SpeculationPolicy

    buckets = default_token_buckets(64)

    def bucket_of(n):
        return next(b for b in buckets if b >= n)

    policy = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=3), bucket_of)
    state = SimpleNamespace(spec_acceptance=0.9)
    assert policy.num_to_propose(state, 1) == 3  # no step timed yet: tried in full
    for bucket, seconds in ((1, 0.020), (2, 0.036), (4, 0.060)):
        policy.record_step(bucket, 99.0)  # the first run of a bucket (compiles) is ignored
        policy.record_step(bucket, seconds)
    # 0.9 acceptance: 1 + .9 + .81 + .73 = 3.44 tokens for 3x the time: worth it.
    assert policy.num_to_propose(state, 1) == 3
    # 0.4: at most 1.62 tokens for 1.8x or 3x the time: nothing, and the estimate moves
    # back towards the prior so the request is tried again later.
    state.spec_acceptance = 0.4
    assert policy.num_to_propose(state, 1) == 0
    assert 0.4 < state.spec_acceptance < SpeculationPolicy.PRIOR
    # Verifications move the estimate.
    state.spec_acceptance = 0.6
    policy.record_verification(state, proposed=3, accepted=0)
    assert state.spec_acceptance < 0.6
    # Where a longer step costs nearly nothing (an accelerator), any acceptance pays.
    cheap = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=3), bucket_of)
    for bucket in (1, 2, 4):
        cheap.record_step(bucket, 0.01)
        cheap.record_step(bucket, 0.01)
    assert cheap.num_to_propose(SimpleNamespace(spec_acceptance=0.2), 1) == 3
    # A draft model's step per proposed token counts too: at 0.9 acceptance with free
    # verification, a draft step costing a full step pays for fewer tokens (3.44 tokens
    # for 4x the time at k=3, 2.71 for 3x at k=2, 1.9 for 2x at k=1: none beats 1 token
    # for 1x), a cheap one (a tenth of a step) for all three.
    eager = SimpleNamespace(spec_acceptance=0.9)
    assert cheap.num_to_propose(eager, 1, round_s=0.01) == 0
    assert cheap.num_to_propose(eager, 1, round_s=0.001) == 3
    # adaptive=False (vLLM's behaviour): k always, whatever it costs.
    fixed = SpeculationPolicy(SpeculativeConfig(adaptive=False), bucket_of)
    assert fixed.num_to_propose(SimpleNamespace(spec_acceptance=0.0), 1, round_s=1.0) == 3
    # A proposer that always has proposals (a draft model) never times the plain step on
    # its own: once a longer step is timed, the policy goes without to time it, then
    # weighs (here a 2-token step is not timed yet, so it counts as free: k=1).
    explore = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=3), bucket_of)
    for seconds in (99.0, 0.02):
        explore.record_step(4, seconds)
    eager = SimpleNamespace(spec_acceptance=0.9)
    assert explore.num_to_propose(eager, 1) == 0
    for seconds in (99.0, 0.01):
        explore.record_step(1, seconds)
    assert explore.num_to_propose(eager, 1) == 1
