"""A step's SamplingMetadata from plain lists: the tests' reference for InputBatch's."""

from __future__ import annotations

import numpy as np

from xlm.sampling_params import SamplingParams
from xlm.worker.sampler import SamplingMetadata
from xlm.worker.sampling_rows import SamplingRows


def build_sampling_metadata(
    params: list[SamplingParams | None],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
    num_padded_reqs: int,
    vocab_size: int,
    max_model_len: int,
    step_seed: int = 0,
    grammar_bitmask: dict[int, np.ndarray] | None = None,
) -> SamplingMetadata:
    """The SamplingMetadata of one step from plain lists (None entries are padding)."""
    if len(params) > num_padded_reqs:
        raise ValueError(f"{len(params)} requests do not fit num_padded_reqs={num_padded_reqs}")
    rows = SamplingRows(num_padded_reqs, vocab_size, max_model_len)
    for i, p in enumerate(params):
        if p is not None:
            rows.add(i, p, prompt_token_ids[i], output_token_ids[i])
    idx = [i if params[i] is not None else rows.pad_row for i in range(len(params))]
    return rows.metadata(idx, num_padded_reqs, step_seed, grammar_bitmask)
