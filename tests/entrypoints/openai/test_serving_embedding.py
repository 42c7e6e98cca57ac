"""/v1/embeddings over a stand-in pooling engine, read by the official openai client: every
input's vector in input order whatever order they finish in, usage, dimensions, one bad
input aborting the others, and a generating model's 400 (the real pooling engine:
tests/e2e/test_server_embeddings.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest

from tests.entrypoints.openai.fake_engine import FakeAsyncEngine
from tests.entrypoints.openai.test_api_server import MODEL, make_client
from xlm.engine.processor import PoolingModel
from xlm.outputs import PoolingOutput, PoolingRequestOutput
from xlm.pooling_params import PoolingParams

HIDDEN = 6


def _vector(ids: list[int]) -> np.ndarray:
    """The stand-in's embedding of a prompt: a fixed function of its tokens."""
    rng = np.random.default_rng(sum(ids) * 31 + len(ids))
    return rng.normal(size=HIDDEN).astype(np.float32)


class _PoolingEngine(FakeAsyncEngine):
    """Embeds with `_vector`, longer prompts finishing first; a prompt holding the token
    of "boom" fails."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, max_model_len=64)
        self.processor.pooling = PoolingModel(PoolingParams(), HIDDEN, max_tokens=64)
        self.boom = tokenizer.encode(" boom", add_special_tokens=False)[0]
        self.cancelled: list[str] = []
        self.started: list[str] = []

    async def encode(self, prompt, pooling_params, request_id, priority=0, lora_request=None):
        ids = prompt.prompt_token_ids
        self.started.append(request_id)
        try:
            for _ in range(20 - len(ids)):
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        if self.boom in ids:
            raise ValueError("the input says boom")
        data = _vector(ids)
        params = prompt.pooling_params
        if params is not None and params.dimensions is not None:
            data = data[: params.dimensions]
        return PoolingRequestOutput(request_id, None, ids, PoolingOutput(data))


@pytest.fixture(scope="module")
def engine(tokenizer):
    return _PoolingEngine(tokenizer)


@pytest.fixture(scope="module")
def oai(tokenizer, engine):
    with make_client(tokenizer, engine=engine) as http:
        yield openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=http)


INPUTS = ["a", "a much longer input than the first one", "middle sized input"]


def test_every_input_in_order_with_usage(oai, tokenizer):
    response = oai.embeddings.create(model=MODEL, input=INPUTS, encoding_format="float")
    ids = [tokenizer.encode(text) for text in INPUTS]
    assert [d.index for d in response.data] == [0, 1, 2]
    for d, prompt in zip(response.data, ids):
        np.testing.assert_array_equal(np.asarray(d.embedding, np.float32), _vector(prompt))
    assert response.usage.prompt_tokens == sum(len(p) for p in ids)
    # The openai client's default encoding (base64) decodes to the same floats.
    again = oai.embeddings.create(model=MODEL, input=INPUTS, dimensions=4)
    for d, prompt in zip(again.data, ids):
        np.testing.assert_array_equal(np.asarray(d.embedding, np.float32), _vector(prompt)[:4])


def test_one_failing_input_aborts_the_others(oai, engine):
    engine.cancelled.clear()
    engine.started.clear()
    with pytest.raises(openai.BadRequestError, match="the input says boom"):
        # The failing input is the longest: it ends while the others still run.
        oai.embeddings.create(model=MODEL, input=["x", "y z", "the longest input goes boom"])
    prefix = engine.started[0].rpartition("-")[0]
    assert sorted(engine.started) == [f"{prefix}-{i}" for i in range(3)]
    assert sorted(engine.cancelled) == [f"{prefix}-0", f"{prefix}-1"]


def test_a_generating_model_refuses_embeddings_naming_the_runner(tokenizer):
    with make_client(tokenizer) as http:
        client = openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=http)
        with pytest.raises(openai.BadRequestError, match="start it with --runner pooling"):
            client.embeddings.create(model=MODEL, input="x")
