"""Which requests may be speculated, and how many proposals the policy gives."""

from types import SimpleNamespace

from xlm.config import SpeculativeConfig
from xlm.sampling_params import SamplingParams
from xlm.worker.buckets import default_token_buckets
from xlm.worker.spec_decode import SpeculationPolicy, may_speculate


def test_requests_whose_sampling_reads_their_tokens_are_not_speculated():
    assert may_speculate(SamplingParams(temperature=0.0))
    assert may_speculate(SamplingParams(temperature=0.7, top_p=0.9, seed=1, logprobs=2))
    assert not may_speculate(SamplingParams(presence_penalty=0.5))
    assert not may_speculate(SamplingParams(repetition_penalty=1.2))
    assert not may_speculate(SamplingParams(min_tokens=4, max_tokens=8))


def test_policy_proposes_what_pays_for_the_longer_step():
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
