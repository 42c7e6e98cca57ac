"""/v1/embeddings on `xlm serve --runner pooling` with the official openai client: strings,
lists, token ids, base64 and dimensions give LLM.embed's vectors; bad inputs get 4xx in
OpenAI's shape; a generation request to the pooling model and an embeddings request to a
generating model get a 400 that says what the model serves; the server serves on."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

import xlm
from tests.e2e.conftest import API_KEY
from tests.e2e.server_utils import MODEL, RemoteServer
from xlm.pooling_params import PoolingParams

NAME = "tiny-embed"
FLAGS = ["--runner", "pooling", "--served-model-name", NAME, "--token-buckets", "32,256"]
TEXTS = ["w1 w2 w3", "w10 w20 w30 w40 w50 w60", "w7"]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def pooling_server(model_dir):
    with RemoteServer(FLAGS, model=model_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(pooling_server):
    url = pooling_server.url + "/v1"
    return openai.OpenAI(base_url=url, api_key="x", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def local(model_dir):
    return xlm.LLM(
        model=model_dir,
        runner="pooling",
        max_model_len=256,
        max_num_batched_tokens=256,
        token_buckets=[32, 256],
        kv_cache_memory=0.1,
    )


def vectors(local, prompts, params=None) -> list[np.ndarray]:
    return [o.outputs.data for o in local.embed(prompts, params, use_tqdm=False)]


def test_strings_lists_and_token_ids_equal_llm_embed(client, local):
    tokenizer = local.get_tokenizer()
    want = vectors(local, [{"prompt_token_ids": tokenizer.encode(t)} for t in TEXTS])
    one = client.embeddings.create(model=NAME, input=TEXTS[0])
    assert one.model == NAME and len(one.data) == 1 and one.data[0].index == 0
    np.testing.assert_allclose(one.data[0].embedding, want[0], rtol=1e-5, atol=1e-6)
    many = client.embeddings.create(model=NAME, input=TEXTS)
    for d, w in zip(many.data, want, strict=True):
        np.testing.assert_allclose(d.embedding, w, rtol=1e-5, atol=1e-6)
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model=NAME, input=ids)
    for d, w in zip(by_ids.data, want, strict=True):
        np.testing.assert_allclose(d.embedding, w, rtol=1e-5, atol=1e-6)
    single_ids = client.embeddings.create(model=NAME, input=ids[1])
    np.testing.assert_allclose(single_ids.data[0].embedding, want[1], rtol=1e-5, atol=1e-6)


def test_base64_and_dimensions(client, pooling_server, local):
    tokenizer = local.get_tokenizer()
    prompt = {"prompt_token_ids": tokenizer.encode(TEXTS[1])}
    floats = client.embeddings.create(model=NAME, input=TEXTS[1], encoding_format="float")
    raw = httpx.post(
        pooling_server.url + "/v1/embeddings",
        json={"model": NAME, "input": TEXTS[1], "encoding_format": "base64"},
        timeout=60,
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(floats.data[0].embedding, np.float32))
    # The openai client decodes base64 itself when it asked for it.
    parsed = client.embeddings.create(model=NAME, input=TEXTS[1])
    np.testing.assert_allclose(parsed.data[0].embedding, decoded, rtol=1e-6)
    small = client.embeddings.create(model=NAME, input=TEXTS[1], dimensions=16)
    assert len(small.data[0].embedding) == 16
    want = vectors(local, [prompt], PoolingParams(dimensions=16))[0]
    np.testing.assert_allclose(small.data[0].embedding, want, rtol=1e-5, atol=1e-6)
    assert abs(np.linalg.norm(small.data[0].embedding) - 1.0) < 1e-5  # cut, then normalized


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["a", ""]}, 400, "input"),
        ({"input": [[1, 2], []]}, 400, "input"),
        ({"input": ["w1"] * 2049}, 400, "input"),
        ({"input": [[1] * 300]}, 400, "input"),  # over max_model_len 256
        ({"input": [[10**6]]}, 400, "prompt"),  # out of vocabulary
        ({"input": "w1", "dimensions": 10**5}, 400, "dimensions"),
        ({"input": "w1", "dimensions": 0}, 400, "dimensions"),
        ({"input": "w1", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": 3.5}, 400, "input"),
        ({"input": "w1", "model": "other"}, 404, "model"),
    ],
)
def test_bad_inputs_get_4xx_and_the_server_serves_on(pooling_server, client, body, status, param):
    url = pooling_server.url + "/v1/embeddings"
    r = httpx.post(url, json={"model": NAME, **body}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    assert client.embeddings.create(model=NAME, input="w1 w2").data[0].embedding


def test_the_pooling_model_refuses_generation(client):
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=NAME, prompt="w1 w2", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], stream=True
        )


def test_a_generating_model_refuses_embeddings(server):
    """The session's shared (generating) server."""
    gen = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="generates text.*--runner pooling"):
        gen.embeddings.create(model=MODEL, input="hello")
