"""Sleep mode and weight updates over HTTP: `xlm serve --enable-sleep-mode` with an API key.

POST /sleep?level=N, POST /wake_up, GET /is_sleeping and POST /update_weights answer
behind the key; a completion after sleep and wake-up equals the one before; while asleep
new requests are 503s; after /update_weights the server answers as xlm's offline engine
started from the new checkpoint; bad levels and mismatched checkpoints are 400s the
server survives.
"""

from __future__ import annotations

import httpx
import openai
import pytest

import xlm
from tests.conftest import write_tiny_checkpoint
from tests.e2e.server_utils import RemoteServer
from tests.engine.reference import TINY_ENGINE, cli_engine_flags

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

API_KEY = "sleep-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "w5 w17 w33 w8"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server_sleep")
    return {
        "a": write_tiny_checkpoint("llama", str(root / "a"), seed=0),
        "b": write_tiny_checkpoint("llama", str(root / "b"), seed=1),
        "wide": write_tiny_checkpoint("llama", str(root / "wide"), seed=2, intermediate_size=192),
    }


@pytest.fixture(scope="module")
def expected_b(checkpoints) -> str:
    """xlm's offline engine started from checkpoint b: the completion's text."""
    llm = xlm.LLM(model=checkpoints["b"], **TINY_ENGINE)
    greedy = xlm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [out] = llm.generate([PROMPT], greedy, use_tqdm=False)
    del llm
    return out.outputs[0].text


@pytest.fixture(scope="module")
def server(checkpoints, expected_b):
    flags = [
        *cli_engine_flags(TINY_ENGINE),
        "--startup-programs",
        "all",
        "--enable-sleep-mode",
        "--api-key",
        API_KEY,
        "--served-model-name",
        "m",
        "--disable-log-stats",
    ]
    with RemoteServer(flags, model=checkpoints["a"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=120, max_retries=0)


def complete(client) -> str:
    out = client.completions.create(
        model="m",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def call(server, method: str, path: str, **kwargs) -> httpx.Response:
    kwargs.setdefault("headers", AUTH)
    return httpx.request(method, server.url + path, timeout=300, **kwargs)


def is_sleeping(server) -> bool:
    r = call(server, "GET", "/is_sleeping")
    assert r.status_code == 200, r.text
    return r.json()["is_sleeping"]


def test_routes_need_the_api_key(server):
    for method, path in (
        ("POST", "/sleep?level=1"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/update_weights"),
    ):
        assert call(server, method, path, headers={}).status_code == 401, path
    assert not is_sleeping(server)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_keep_the_completion(server, client, level):
    before = complete(client)
    assert call(server, "POST", f"/sleep?level={level}").status_code == 200
    assert is_sleeping(server)
    with pytest.raises(openai.APIStatusError) as info:
        complete(client)
    assert info.value.status_code == 503
    assert call(server, "POST", "/wake_up").status_code == 200
    assert not is_sleeping(server)
    assert complete(client) == before


def test_errors_are_400s_and_wake_up_when_awake_is_a_no_op(server, client, checkpoints):
    before = complete(client)
    assert call(server, "POST", "/wake_up").status_code == 200
    for level in ("0", "3", "x"):
        r = call(server, "POST", f"/sleep?level={level}")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "level"
    assert not is_sleeping(server)
    r = call(server, "POST", "/update_weights", json={"path": checkpoints["wide"]})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "mlp" in message and "nothing was changed" in message
    assert call(server, "POST", "/update_weights", json={}).status_code == 400
    assert complete(client) == before  # still serving, with the same weights


def test_update_weights_answers_as_the_new_checkpoint(server, client, checkpoints, expected_b):
    before = complete(client)
    assert before != expected_b  # the checkpoints answer differently
    r = call(server, "POST", "/update_weights", json={"path": checkpoints["b"]})
    assert r.status_code == 200, r.text
    assert complete(client) == expected_b
