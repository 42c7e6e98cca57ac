"""Images over HTTP: `xlm serve` on the tiny LLaVA with the official openai client.

Chat completions take `image_url` content parts (data URLs; file:// under
--allowed-local-media-path; remote hosts only when --allowed-media-domains names them);
the replies equal transformers' greedy continuation, usage counts the expanded image
placeholders, and every bad image is a 400 the server survives. `/v1/responses`
(`input_image` parts, the openai client) and `/v1/messages` (Anthropic's base64 image
blocks, httpx) answer as chat completions do on the same image.
"""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest

from tests.e2e.server_utils import RemoteServer
from tests.engine.reference import TINY_ENGINE, cli_engine_flags
from tests.multimodal_fixtures import (
    TOKENS_PER_IMAGE,
    build_llava_tokenizer,
    make_image,
    transformers_greedy,
)
from xlm.tokenizer import apply_chat_template

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 6
MAX_PIXELS = 100 * 100


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    make_image(21).save(root / "allowed" / "cat.png")
    make_image(22).save(root / "outside.png")
    return root


@pytest.fixture(scope="module")
def server(tiny_llava, media_dir):
    args = [
        *cli_engine_flags(TINY_ENGINE),
        "--startup-programs",
        "all",
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--max-image-pixels",
        str(MAX_PIXELS),
        "--allowed-local-media-path",
        str(media_dir / "allowed"),
    ]
    with RemoteServer(args, model=tiny_llava) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=60, max_retries=0)


def _chat(client, parts: list, **kwargs):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": parts}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        **kwargs,
    )


def _reference(path: str, parts: list, images: list) -> tuple[str, int]:
    """transformers' reply text and the expanded prompt length."""
    tokenizer = build_llava_tokenizer()
    template_parts = [p if p["type"] == "text" else {"type": "image"} for p in parts]
    messages = [{"role": "user", "content": template_parts}]
    ids = apply_chat_template(tokenizer, messages, add_generation_prompt=True)
    out = transformers_greedy(path, ids, images, MAX_TOKENS)
    num_prompt = len(ids) + len(images) * (TOKENS_PER_IMAGE - 1)
    return tokenizer.decode(out, skip_special_tokens=True), num_prompt


def test_chat_with_images_equals_transformers(client, tiny_llava, media_dir):
    one = make_image(20)
    parts = [image_part(data_url(_png(one))), {"type": "text", "text": "w5 w9"}]
    response = _chat(client, parts)
    text, num_prompt = _reference(tiny_llava, parts, [one])
    assert response.choices[0].message.content.strip() == text.strip()
    assert response.usage.prompt_tokens == num_prompt

    local = make_image(21)  # the file under the allowed directory
    two = [
        image_part(data_url(_png(one))),
        {"type": "text", "text": "w3"},
        image_part((media_dir / "allowed" / "cat.png").as_uri()),
    ]
    response = _chat(client, two)
    text, num_prompt = _reference(tiny_llava, two, [one, local])
    assert response.choices[0].message.content.strip() == text.strip()
    assert response.usage.prompt_tokens == num_prompt


def test_shared_image_streamed(client, tiny_llava):
    image = make_image(23)
    parts = [image_part(data_url(_png(image))), {"type": "text", "text": "w7"}]
    first = _chat(client, parts).choices[0].message.content
    chunks = _chat(client, parts, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == first
    assert first.strip() == _reference(tiny_llava, parts, [image])[0].strip()


def _bad_cases(media_dir) -> dict[str, list]:
    png = _png(make_image(24))
    return {
        "not base64": [image_part("data:image/png;base64,@@@")],
        "not an image": [image_part(data_url(b"hello, world", "text/plain"))],
        "truncated": [image_part(data_url(png[: len(png) // 2]))],
        "too many pixels": [image_part(data_url(_png(make_image(25, 200, 200))))],
        "too many images": [image_part(data_url(png))] * 3,
        "remote host": [image_part("http://127.0.0.1:1/cat.png")],
        "file outside": [image_part((media_dir / "outside.png").as_uri())],
        "bad scheme": [image_part("ftp://example.com/cat.png")],
        "unknown part": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
    }


def test_bad_images_are_400_and_the_server_keeps_serving(client, media_dir):
    for name, parts in _bad_cases(media_dir).items():
        with pytest.raises(openai.BadRequestError) as err:
            _chat(client, parts)
        assert err.value.status_code == 400, name
    good = [image_part(data_url(_png(make_image(26)))), {"type": "text", "text": "w1"}]
    assert _chat(client, good).choices[0].message.content is not None


def _responses(client, content: list, **kwargs):
    return client.responses.create(
        model=client.models.list().data[0].id,
        input=[{"role": "user", "content": content}],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        **kwargs,
    )


def test_responses_input_image_equals_chat(client, media_dir):
    one, two = _png(make_image(30)), _png(make_image(31))
    chat = _chat(client, [image_part(data_url(one)), {"type": "text", "text": "w2 w4"}])
    content = [
        {"type": "input_image", "image_url": data_url(one), "detail": "auto"},
        {"type": "input_text", "text": "w2 w4"},
    ]
    response = _responses(client, content)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens

    local = (media_dir / "allowed" / "cat.png").as_uri()  # the same media rules as chat
    two_parts = [image_part(data_url(two)), {"type": "text", "text": "w3"}, image_part(local)]
    chat = _chat(client, two_parts)
    content = [
        {"type": "input_image", "image_url": data_url(two)},
        {"type": "input_text", "text": "w3"},
        {"type": "input_image", "image_url": local},
    ]
    response = _responses(client, content)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_bad_images_are_400(client, media_dir):
    for name, parts in _bad_cases(media_dir).items():
        if name == "unknown part":
            content = [{"type": "input_file", "file_id": "f"}]
        else:
            content = [{"type": "input_image", "image_url": p["image_url"]["url"]} for p in parts]
        with pytest.raises(openai.BadRequestError) as err:
            _responses(client, content)
        assert err.value.status_code == 400, name
        assert err.value.body["message"], name  # OpenAI's error shape
    good = [{"type": "input_image", "image_url": data_url(_png(make_image(32)))}]
    assert _responses(client, good).output_text is not None


def _message(server, content: list) -> httpx.Response:
    body = {
        "model": "ignored-by-one-model-servers",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    body["model"] = models["data"][0]["id"]
    return httpx.post(server.url + "/v1/messages", json=body, timeout=60)


def _image_block(data: bytes, media_type: str = "image/png") -> dict:
    source = {"type": "base64", "media_type": media_type, "data": base64.b64encode(data).decode()}
    return {"type": "image", "source": source}


def test_messages_image_block_equals_chat(client, server):
    one = _png(make_image(33))
    chat = _chat(client, [image_part(data_url(one)), {"type": "text", "text": "w6"}])
    r = _message(server, [_image_block(one), {"type": "text", "text": "w6"}])
    assert r.status_code == 200, r.text
    reply = r.json()
    text = "".join(b["text"] for b in reply["content"] if b["type"] == "text")
    assert text == chat.choices[0].message.content
    assert reply["usage"]["input_tokens"] == chat.usage.prompt_tokens


def test_messages_bad_images_are_400(server):
    png = _png(make_image(34))
    bad = {
        "truncated": [_image_block(png[: len(png) // 2])],
        "not an image": [_image_block(b"hello, world")],
        "not image/*": [_image_block(png, "text/plain")],
        "too many pixels": [_image_block(_png(make_image(35, 200, 200)))],
        "too many images": [_image_block(png)] * 3,
        "remote host": [
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:1/a"}}
        ],
    }
    for name, content in bad.items():
        r = _message(server, content)
        assert r.status_code == 400, (name, r.text)
        body = r.json()  # the Messages routes answer in Anthropic's error shape
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", name
    assert _message(server, [_image_block(png), {"type": "text", "text": "w1"}]).status_code == 200
