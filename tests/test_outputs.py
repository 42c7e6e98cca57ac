"""The output records: a completion knows when it ended, a pooling vector lists as floats."""

from __future__ import annotations

import numpy as np

from xlm.outputs import CompletionOutput, PoolingOutput, RequestOutput


def test_completion_is_finished_once_it_has_a_reason():
    out = CompletionOutput(
        index=0, text="hi", token_ids=[5], cumulative_logprob=None, logprobs=None
    )
    assert not out.finished()
    out.finish_reason = "length"
    assert out.finished()


def test_embedding_is_the_vector_as_floats():
    vector = np.array([0.5, -1.25], dtype=np.float32)
    assert PoolingOutput(vector).embedding == [0.5, -1.25]
    assert all(type(x) is float for x in PoolingOutput(vector).embedding)


def test_request_output_repr_names_the_request_not_the_encoder_prompt():
    out = RequestOutput("r1", "p", [1, 2], None, [], finished=True, encoder_prompt="secret")
    text = repr(out)
    assert "request_id='r1'" in text and "prompt_token_ids=[1, 2]" in text
    assert "finished=True" in text and "secret" not in text
