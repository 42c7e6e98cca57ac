"""The bucket policy: token buckets (powers of two, 1.5x midpoints from 16), the sampler's
row buckets, and the few-rows path (a step with few real rows of logits samples on the
few-rows sampler bucket; the LM head's tiers: tests/worker/test_programs.py)."""

from __future__ import annotations

import pytest

from xlm.config import CompilationConfig, ModelConfig, SchedulerConfig, XlmConfig
from xlm.config.speculative import SpeculativeConfig
from xlm.worker.buckets import FEW_ROWS, Buckets, StepShape, default_token_buckets


def _config(max_num_batched_tokens=64, max_num_seqs=48, token_buckets=None, spec=None):
    return XlmConfig(
        ModelConfig(model="unused"),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs
        ),
        compilation_config=CompilationConfig(token_buckets=token_buckets),
        speculative_config=spec,
    )


def test_default_token_buckets_add_midpoints_from_16():
    """Powers of two, their 1.5x midpoints from 16 up, and the budget itself; the sampler's
    row buckets are powers of two up to max_num_seqs."""
    assert default_token_buckets(2048) == [
        1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048
    ]  # fmt: skip
    assert default_token_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert default_token_buckets(16) == [1, 2, 4, 8, 16]
    assert default_token_buckets(24) == [1, 2, 4, 8, 16, 24]
    buckets = Buckets.from_config(_config())
    assert buckets.token_buckets == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert buckets.sampler_buckets == (1, 2, 4, 8, 16, 32, 48)
    assert buckets.max_logit_rows == 48


def test_from_config_takes_given_buckets_and_speculative_rows():
    given = Buckets.from_config(_config(token_buckets=[8, 64]))
    assert given.token_buckets == (8, 64)
    with pytest.raises(
        ValueError, match=r"token_buckets=\[8, 32\] must reach max_num_batched_tokens=64"
    ):
        Buckets.from_config(_config(token_buckets=[8, 32]))
    # 3 proposed tokens: 4 logit rows for each of at most 8 speculating requests.
    spec = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=8)
    buckets = Buckets.from_config(_config(max_num_seqs=16, spec=spec))
    assert spec.rows_needed(16) == 32 == buckets.max_logit_rows
    assert buckets.sampler_buckets == (1, 2, 4, 8, 16, 32) and buckets.max_num_seqs == 16


@pytest.mark.parametrize("budget", [1, 2, 3, 7, 17, 33, 100, 257, 1000, 4097])
def test_default_token_buckets_pad_by_at_most_their_ratio(budget):
    """Every step of 1..budget tokens has a bucket; it pads a step of n tokens to less than
    2n (below 16) or 1.5n (from 16 up) tokens, never past the budget."""
    buckets = default_token_buckets(budget)
    assert buckets == sorted(set(buckets)) and buckets[-1] == budget
    for n in range(1, budget + 1):
        padded = min(b for b in buckets if b >= n)
        assert padded < 2 * n
        if n > 16:
            assert 2 * padded <= 3 * n or padded == budget


def test_token_bucket_is_the_smallest_that_fits():
    buckets = Buckets((4, 16, 64), (1, 4, 16), max_num_seqs=16)
    assert [buckets.token_bucket(n) for n in (1, 4, 5, 16, 17, 64)] == [4, 4, 16, 16, 64, 64]
    with pytest.raises(ValueError, match="65 tokens exceeds the largest token bucket 64"):
        buckets.token_bucket(65)
    assert buckets.rows_for_tokens(4) == 4 and buckets.rows_for_tokens(64) == 16
    assert buckets.sampler_bucket(5) == 16 and buckets.sampler_bucket(1) == 1


def test_max_logit_rows_is_at_least_max_num_seqs():
    """Speculative decoding raises the logit rows past the request rows; never below them."""
    assert Buckets((8,), (1, 8), max_num_seqs=8).max_logit_rows == 8
    spec = Buckets((8, 64), (1, 8, 32), max_num_seqs=8, max_logit_rows=32)
    assert spec.rows_for_tokens(64) == 8 and spec.logit_rows_for_tokens(64) == 32


def test_sampler_rows_take_the_few_rows_bucket_when_few_are_real():
    buckets = Buckets((1, 8, 16, 64), (1, 2, 4, 8, 16, 32), max_num_seqs=32)
    assert buckets.sampler_rows(32, 1) == FEW_ROWS == buckets.few_rows_bucket(32)
    assert buckets.sampler_rows(32, FEW_ROWS) == FEW_ROWS
    assert buckets.sampler_rows(32, FEW_ROWS + 1) == 32
    assert buckets.sampler_rows(8, 1) == 8 and buckets.few_rows_bucket(8) is None
    assert buckets.sampler_rows(1, 1) == 1
    small = Buckets((1, 4), (1, 2, 4), max_num_seqs=4)  # no few-rows bucket below its rows
    assert small.few_rows_bucket(4) is None and small.sampler_rows(4, 1) == 4


def test_step_shape_and_the_buckets_a_token_bucket_may_run():
    buckets = Buckets((1, 8, 16, 64), (1, 2, 4, 8, 16, 32), max_num_seqs=32)
    assert buckets.step_shape(64, 3) == StepShape(64, 32, FEW_ROWS, True)
    assert buckets.step_shape(64, 20) == StepShape(64, 32, 32, False)
    assert buckets.step_shape(8, 3) == StepShape(8, 8, 8, False)
    assert buckets.sampler_buckets_for_tokens(64) == [32, FEW_ROWS]
    assert buckets.sampler_buckets_for_tokens(16) == [16, FEW_ROWS]
    assert buckets.sampler_buckets_for_tokens(8) == [8]
    # Every shape a step may take is one of the buckets warm-up compiles.
    for tokens in buckets.token_buckets:
        for real in range(1, buckets.logit_rows_for_tokens(tokens) + 1):
            shape = buckets.step_shape(tokens, real)
            assert shape.sampler_rows in buckets.sampler_buckets_for_tokens(tokens)
            assert shape.sampler_rows >= real
