"""The few-rows path: a step with few real rows of logits samples on the few-rows sampler
bucket (the LM head's tiers: tests/worker/test_programs.py)."""

from __future__ import annotations

from xlm.worker.buckets import FEW_ROWS, Buckets


def test_sampler_rows_take_the_few_rows_bucket_when_few_are_real():
    buckets = Buckets((1, 8, 16, 64), (1, 2, 4, 8, 16, 32), max_num_seqs=32)
    assert buckets.sampler_rows(32, 1) == FEW_ROWS == buckets.few_rows_bucket(32)
    assert buckets.sampler_rows(32, FEW_ROWS) == FEW_ROWS
    assert buckets.sampler_rows(32, FEW_ROWS + 1) == 32
    assert buckets.sampler_rows(8, 1) == 8 and buckets.few_rows_bucket(8) is None
    assert buckets.sampler_rows(1, 1) == 1
    small = Buckets((1, 4), (1, 2, 4), max_num_seqs=4)  # no few-rows bucket below its rows
    assert small.few_rows_bucket(4) is None and small.sampler_rows(4, 1) == 4
