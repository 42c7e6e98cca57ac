"""read_sampled: each request's new tokens from a step's sampler rows, appended to its row
in the batch: one token per request, or with speculative decoding the accepted proposals
then the correction (or the bonus token); logprob rows of the same tokens for requests that
asked; nothing for requests whose step samples nothing."""

from __future__ import annotations

import numpy as np

from xlm.config import SpeculativeConfig
from xlm.sampling_params import SamplingParams
from xlm.worker.input_batch import CachedRequestState, InputBatch
from xlm.worker.sampler import SamplerOutput
from xlm.worker.spec_decode import SpeculationPolicy
from xlm.worker.step_outputs import StepInFlight, read_sampled

K = 3  # top-k width of the sampler output


def make_batch(*reqs: tuple[str, list[int], SamplingParams]) -> InputBatch:
    batch = InputBatch(4, 32, 4, 100)
    for req_id, prompt, params in reqs:
        batch.add(CachedRequestState(req_id, prompt, params), [1], len(prompt))
    return batch


def sampler_output(tokens: list[int], accepted: list[bool]) -> SamplerOutput:
    """Rows whose logprob, rank and top-k are derived from the row index (to check which
    rows each request reads)."""
    rows = len(tokens)
    r = np.arange(rows)
    return SamplerOutput(
        sampled_token_ids=np.asarray(tokens, np.int32),
        logprobs=-0.5 * r.astype(np.float32),
        ranks=(r + 1).astype(np.int32),
        topk_ids=(100 * r[:, None] + np.arange(K)).astype(np.int32),
        topk_logprobs=(-r[:, None] - 0.25 * np.arange(K)).astype(np.float32),
        accepted=np.asarray(accepted, bool),
    )


def test_one_token_per_request_appended_and_no_logprobs_unless_asked():
    batch = make_batch(("a", [1, 2], SamplingParams()), ("b", [3], SamplingParams()))
    step = StepInFlight(["a", "b"], np.array([True, True]), sampler_output([7, 9], [0, 0]))
    tokens, logprobs = read_sampled(step, batch)
    assert tokens == [[7], [9]] and logprobs is None
    a, b = batch.requests["a"], batch.requests["b"]
    assert a.output_token_ids == [7] and b.output_token_ids == [9]
    assert batch.token_ids[a.slot, :3].tolist() == [1, 2, 7]


def test_a_request_that_does_not_sample_gets_nothing_and_keeps_its_row():
    """A prefill chunk that is not the prompt's last: its row is read past, not appended."""
    batch = make_batch(("a", [1, 2], SamplingParams()), ("b", [3], SamplingParams(logprobs=2)))
    step = StepInFlight(["a", "b"], np.array([False, True]), sampler_output([7, 9], [0, 0]))
    tokens, logprobs = read_sampled(step, batch)
    assert tokens == [[], [9]]
    assert batch.requests["a"].output_token_ids == []
    assert logprobs[0] is None
    # b's row is row 1: its token, its logprob and its top 2.
    assert logprobs[1].logprob_token_ids == [[9, 100, 101]]
    assert logprobs[1].logprobs == [[-0.5, -1.0, -1.25]]
    assert logprobs[1].sampled_token_ranks == [2]


def test_speculative_rows_give_accepted_proposals_then_correction_or_bonus():
    policy = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=3), lambda n: n)
    batch = make_batch(
        ("a", [1], SamplingParams(temperature=0.0, logprobs=1)),
        ("b", [2], SamplingParams(temperature=0.0)),
        ("c", [3], SamplingParams(temperature=0.0)),
    )
    # a: 3 proposals, 1 accepted -> the accepted one, then the correction of row 1.
    # b: 2 proposals, both accepted -> both, then the bonus token of its last row.
    # c: no proposals, one row.
    tokens = [10, 11, 12, 13, 20, 21, 22, 30]
    accepted = [1, 0, 1, 0, 1, 1, 0, 0]  # a's row 2 after a rejection does not count
    step = StepInFlight(
        ["a", "b", "c"],
        np.array([True, True, True]),
        sampler_output(tokens, accepted),
        row_counts=np.array([4, 3, 1]),
        spec_lens=np.array([3, 2, 0]),
    )
    before = {r: batch.requests[r].spec_acceptance for r in "abc"}
    out, logprobs = read_sampled(step, batch, policy)
    assert out == [[10, 11], [20, 21, 22], [30]]
    assert batch.requests["b"].output_token_ids == [20, 21, 22]
    slot_b = batch.requests["b"].slot
    assert batch.token_ids[slot_b, :4].tolist() == [2, 20, 21, 22]
    # The policy saw 1 of 3 accepted for a, 2 of 2 for b; c proposed nothing.
    w = SpeculationPolicy.WEIGHT
    assert np.isclose(batch.requests["a"].spec_acceptance, before["a"] + w * (1 / 3 - before["a"]))
    assert np.isclose(batch.requests["b"].spec_acceptance, before["b"] + w * (1 - before["b"]))
    assert batch.requests["c"].spec_acceptance == before["c"]
    # a's logprobs: rows 0 and 1, top 1; b and c asked for none.
    assert logprobs[0].logprob_token_ids == [[10, 0], [11, 100]]
    assert logprobs[0].sampled_token_ranks == [1, 2]
    assert logprobs[1] is None and logprobs[2] is None


def test_a_request_gone_since_dispatch_gets_its_tokens_but_no_row_update():
    batch = make_batch(("a", [1], SamplingParams()), ("b", [2], SamplingParams()))
    batch.release("b", forget=False)  # preempted after the step was dispatched
    step = StepInFlight(["a", "b"], np.array([True, True]), sampler_output([7, 9], [0, 0]))
    tokens, _ = read_sampled(step, batch)
    assert tokens == [[7], [9]]
    assert batch.requests["b"].output_token_ids == []
