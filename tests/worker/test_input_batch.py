"""InputBatch keeps the sampler's per-request rows incrementally: after adds, sampled tokens,
preemption and resumption, a step's SamplingMetadata equals one built afresh from lists."""

import dataclasses

import numpy as np

from tests.sampling_batch import build_sampling_metadata
from xlm.sampling_params import SamplingParams
from xlm.worker.compilation import ProgramKey, ProgramKind
from xlm.worker.input_batch import CachedRequestState, InputBatch

V, L = 40, 24


def _params():
    masks = SamplingParams(
        temperature=1.0,
        top_p=0.8,
        min_tokens=3,
        stop_token_ids=[7],
        bad_words=["x", "y"],
        allowed_token_ids=[4, 5, 6, 7, 8, 9, 10],
        logit_bias={6: 2.5, 8: -1.0},
    )
    masks._bad_words_token_ids = [[4, 5], [9]]  # what update_from_tokenizer would set
    return {
        "greedy": SamplingParams(temperature=0, max_tokens=8),
        "penalties": SamplingParams(
            temperature=0.7,
            top_k=5,
            seed=2**40 + 3,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            repetition_penalty=1.3,
            logprobs=2,
        ),
        "masks": masks,
    }


def _assert_same(a, b):
    for f in dataclasses.fields(a):
        np.testing.assert_array_equal(
            np.asarray(getattr(a, f.name)), np.asarray(getattr(b, f.name)), err_msg=f.name
        )


def test_incremental_rows_equal_fresh_build():
    params = _params()
    prompts = {"greedy": [1, 2, 3], "penalties": [3, 3, 9, 11], "masks": [2]}
    batch = InputBatch(4, L, 4, V)
    states = {}
    for name in params:
        states[name] = CachedRequestState(name, list(prompts[name]), params[name])
        batch.add(states[name], [1], 0)
    rng = np.random.default_rng(0)
    for step in range(6):
        order = ["masks", "greedy", "penalties"][step % 3 :] + ["masks", "greedy", "penalties"][
            : step % 3
        ]
        got = batch.sampling_metadata(batch.slots(order), 8, step_seed=step)
        want = build_sampling_metadata(
            [params[n] for n in order],
            [states[n].output_token_ids for n in order],
            [prompts[n] for n in order],
            8,
            V,
            L,
            step_seed=step,
        )
        _assert_same(got, want)
        for name in order:
            batch.append_sampled(states[name], int(rng.choice([4, 5, 7, 9, 12])))
        if step == 2:  # preempt one request, then resume it with its outputs so far
            batch.release("penalties", forget=False)
            state = states["penalties"]
            state.output_token_ids = list(state.output_token_ids)
            batch.add(state, [2], 0)
    assert bool(got.any_mask) and bool(got.any_penalties) and not bool(got.all_greedy)


def test_program_keys_are_typed():
    key = ProgramKey(ProgramKind.SAMPLER, 16)
    assert key == ProgramKey(ProgramKind.SAMPLER, 16) and hash(key) == hash(
        ProgramKey(ProgramKind.SAMPLER, 16)
    )
    assert key != ProgramKey(ProgramKind.MODEL, 16)
