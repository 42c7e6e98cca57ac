"""SamplingRows: a request's parameters resolved into its slot's rows, and a step's padded
SamplingMetadata gathered from the slots, checked against values worked out by hand (the
incremental InputBatch against fresh builds: tests/worker/test_input_batch.py)."""

from __future__ import annotations

import numpy as np
import pytest

from xlm.sampling_params import MAX_LOGIT_BIAS_TOKENS, SamplingParams
from xlm.worker.sampling_rows import SamplingRows, banned_token_ids, split_seed

V, L = 20, 12


def _allowed(mask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask_row, bitorder="little")[:V]
    return set(np.flatnonzero(bits).tolist())


def _with_bad_words(words: list[list[int]], **kw) -> SamplingParams:
    params = SamplingParams(bad_words=[f"w{i}" for i in range(len(words))], **kw)
    params._bad_words_token_ids = words  # what update_from_tokenizer would set
    return params


def test_split_seed_gives_low_then_high_words():
    assert split_seed(0) == (0, 0)
    assert split_seed(2**40 + 3) == (3, 2**8)
    assert split_seed(2**64 - 1) == (0xFFFFFFFF, 0xFFFFFFFF)


def test_banned_tokens_are_stop_tokens_before_min_tokens_and_completed_bad_words():
    params = _with_bad_words([[5], [3, 4, 9]], min_tokens=2, stop_token_ids=[7])
    stops = params.all_stop_token_ids
    assert 7 in stops
    assert sorted(banned_token_ids(params, [1])) == sorted([*stops, 5])
    assert banned_token_ids(params, [1, 3]) == [5]  # min_tokens reached
    assert banned_token_ids(params, [1, 3, 4]) == [5, 9]  # ... 3, 4 then 9 is banned
    assert banned_token_ids(params, [3, 4, 1]) == [5]


def test_add_resolves_parameters_and_greedy_rows_ignore_sampling_knobs():
    rows = SamplingRows(4, V, L)
    rows.add(0, SamplingParams(temperature=0.0, top_k=3, top_p=0.5), [1], [])
    rows.add(1, SamplingParams(temperature=0.5, top_k=50, min_p=0.1, seed=2**33 + 1), [1], [])
    rows.add(2, SamplingParams(temperature=0.8, top_k=4, top_p=0.9), [1], [])
    meta = rows.metadata([0, 1, 2], 4, step_seed=9)
    np.testing.assert_array_equal(meta.is_greedy, [True, False, False, True])
    np.testing.assert_allclose(meta.temperature, [1.0, 0.5, 0.8, 1.0])
    np.testing.assert_array_equal(meta.top_k, [V, V, 4, V])  # top_k past V is off
    np.testing.assert_allclose(meta.top_p, [1.0, 1.0, 0.9, 1.0])
    np.testing.assert_allclose(meta.min_p, [0.0, 0.1, 0.0, 0.0])
    np.testing.assert_array_equal(meta.has_seed, [False, True, False, False])
    np.testing.assert_array_equal(meta.seeds[1], [1, 2])
    np.testing.assert_array_equal(meta.step_seed, [9, 0])
    assert not meta.all_greedy and meta.any_filters and not meta.any_penalties
    assert not meta.any_mask and not meta.any_logit_bias and not meta.any_draft


def test_penalty_rows_count_output_tokens_and_the_prompt_for_repetition():
    rows = SamplingRows(2, V, L)
    rows.add(0, SamplingParams(repetition_penalty=1.2), [3, 4], [5])
    rows.add(1, SamplingParams(presence_penalty=0.5), [6], [8])
    rows.append_output(0, 9)
    rows.append_output(1, 2)
    meta = rows.metadata([1, 0], 2, step_seed=0)
    assert meta.any_penalties
    np.testing.assert_array_equal(meta.output_lens, [2, 2])
    np.testing.assert_array_equal(meta.output_token_ids[:, :3], [[8, 2, V], [5, 9, V]])
    # Only repetition_penalty reads the prompt; the rest stays padding (V).
    np.testing.assert_array_equal(meta.prompt_token_ids[:, :3], [[V, V, V], [3, 4, V]])
    np.testing.assert_allclose(meta.repetition_penalty, [1.0, 1.2])
    np.testing.assert_allclose(meta.presence_penalty, [0.5, 0.0])


def test_logit_bias_and_allowed_tokens_and_bans_fill_the_token_mask():
    rows = SamplingRows(3, V, L)
    rows.add(0, SamplingParams(logit_bias={3: 1.5, 11: -2.0}), [1], [])
    rows.add(1, SamplingParams(allowed_token_ids=[2, 3, 4, 19]), [1], [])
    outputs = [6]
    rows.add(2, _with_bad_words([[6, 8]], min_tokens=2, stop_token_ids=[0]), [1], outputs)
    meta = rows.metadata([0, 1, 2], 4, step_seed=0)
    np.testing.assert_array_equal(meta.logit_bias_ids[0, :3], [3, 11, V])
    np.testing.assert_allclose(meta.logit_bias_values[0, :2], [1.5, -2.0])
    assert meta.logit_bias_ids.shape == (4, MAX_LOGIT_BIAS_TOKENS) and meta.any_logit_bias
    assert meta.any_mask
    assert _allowed(meta.token_mask[0]) == set(range(V))
    assert _allowed(meta.token_mask[1]) == {2, 3, 4, 19}
    stops = {t for t in SamplingParams(stop_token_ids=[0]).all_stop_token_ids if t < V}
    assert _allowed(meta.token_mask[2]) == set(range(V)) - stops - {8}
    assert _allowed(meta.token_mask[3]) == set(range(V))  # the padding row
    # The bans follow the request's own output list: two tokens lift min_tokens, and
    # the output no longer ends with 6.
    outputs.append(5)
    rows.append_output(2, 5)
    meta = rows.metadata([2], 1, step_seed=0)
    assert not meta.any_mask and _allowed(meta.token_mask[0]) == set(range(V))


def test_add_overwrites_a_reused_slot_and_remove_forgets_its_bans():
    rows = SamplingRows(1, V, L)
    rows.add(0, _with_bad_words([[4]], frequency_penalty=1.0, logit_bias={2: 1.0}), [1], [3])
    rows.add(0, SamplingParams(temperature=0.0), [1], [])
    meta = rows.metadata([0], 1, step_seed=0)
    assert meta.all_greedy and not meta.any_penalties and not meta.any_logit_bias
    assert not meta.any_mask and meta.output_lens[0] == 0
    rows.add(0, _with_bad_words([[4]]), [1], [])
    rows.remove(0)
    assert not rows.metadata([0], 1, step_seed=0).any_mask


def test_grammar_bitmask_and_drafts_and_too_many_rows():
    rows = SamplingRows(2, V, L)
    rows.add(0, SamplingParams(), [1], [7, 7])
    words = np.array([0b1010], np.int32)
    meta = rows.metadata([0, 0], 4, 0, grammar_bitmask={1: words}, drafts=(
        np.array([-1, 5], np.int32), np.array([0, 1], np.int32)
    ))  # fmt: skip
    assert meta.any_grammar and meta.any_draft
    np.testing.assert_array_equal(meta.grammar_bitmask[:, 0], [-1, 0b1010, -1, -1])
    np.testing.assert_array_equal(meta.draft_token_ids, [-1, 5, -1, -1])
    np.testing.assert_array_equal(meta.output_lens[:2], [2, 3])
    with pytest.raises(ValueError, match="3 requests do not fit num_padded_reqs=2"):
        rows.metadata([0, 1, 0], 2, step_seed=0)
