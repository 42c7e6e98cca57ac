"""Images over HTTP for the other vision-language families: one `xlm serve` each on the
tiny Qwen2.5-VL and the tiny Gemma 3, with the official openai client.

A chat completion with one data-URL image, then with two, answers transformers' greedy
tokens on the same images (each family's own processor as the reference), and
usage.prompt_tokens counts the image's expanded tokens (Qwen's h * w / 4 after its
resize; Gemma 3's begin/end-of-image tokens, soft tokens and newlines).
"""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest

from tests.e2e.server_utils import RemoteServer
from tests.engine.reference import TINY_ENGINE, cli_engine_flags
from tests.multimodal_fixtures import gemma3_transformers_greedy, make_blocky_image, make_image
from tests.qwen2_vl_fixtures import MAX_PIXELS, MERGE_SIZE, MIN_PIXELS, image_processor
from tests.qwen2_vl_fixtures import transformers_greedy as qwen_transformers_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 4


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _parts(images: list, texts: list[str]) -> list[dict]:
    """image, text, image, text, ...: the openai content parts."""
    parts = []
    for image, text in zip(images, texts, strict=True):
        parts.append({"type": "image_url", "image_url": {"url": _data_url(image)}})
        parts.append({"type": "text", "text": text})
    return parts


def _template_messages(parts: list[dict]) -> list[dict]:
    """The same message for a chat template (an image part becomes {"type": "image"})."""
    content = [p if p["type"] == "text" else {"type": "image"} for p in parts]
    return [{"role": "user", "content": content}]


def _serve(model: str):
    args = [*cli_engine_flags(TINY_ENGINE), "--startup-programs", "all"]
    return RemoteServer([*args, "--limit-mm-per-prompt", '{"image": 2}'], model=model)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)


def _chat(client: openai.OpenAI, parts: list[dict]):
    """A greedy chat completion; the reply's token ids through its logprobs' tokens."""
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": parts}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
    )


def _check(response, tokenizer, want_ids: list[int], num_prompt: int) -> None:
    choice = response.choices[0]
    got_ids = tokenizer.convert_tokens_to_ids([t.token for t in choice.logprobs.content])
    assert got_ids == want_ids
    want_text = tokenizer.decode(want_ids, skip_special_tokens=True)
    assert choice.message.content.strip() == want_text.strip()
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.completion_tokens == len(want_ids)


# ---- Qwen2.5-VL ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    from tests.qwen2_vl_fixtures import write_tiny_qwen_vl

    path = write_tiny_qwen_vl(str(tmp_path_factory.mktemp("qwen2_5_vl") / "m"), v25=True)
    with _serve(path) as srv:
        yield srv, path


def _qwen_tokens(image) -> int:
    """An image's tokens after transformers' smart_resize."""
    out = image_processor(MIN_PIXELS, MAX_PIXELS)([image], return_tensors="np")
    return int(np.prod(out["image_grid_thw"][0])) // MERGE_SIZE**2


def test_qwen2_5_vl_chat_equals_transformers(qwen_server):
    from transformers import AutoTokenizer

    server, path = qwen_server
    client = _client(server)
    tokenizer = AutoTokenizer.from_pretrained(path)
    one, two = make_image(40, 40, 33), make_image(41, 20, 30)  # different token counts
    for images, texts in (([one], ["w5 w9"]), ([one, two], ["w3", "w7 w8"])):
        parts = _parts(images, texts)
        prompt = tokenizer.apply_chat_template(
            _template_messages(parts), add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        want = qwen_transformers_greedy(path, ids, images, MAX_TOKENS)
        # Each <|image_pad|> placeholder expanded to its image's tokens.
        num_prompt = len(ids) - len(images) + sum(_qwen_tokens(im) for im in images)
        _check(_chat(client, parts), tokenizer, want, num_prompt)


# ---- Gemma 3 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_server(tiny_gemma3):
    with _serve(tiny_gemma3) as srv:
        yield srv


def test_gemma3_chat_equals_transformers(gemma3_server, tiny_gemma3):
    from transformers import AutoTokenizer

    client = _client(gemma3_server)
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3)
    one, two = make_blocky_image(40), make_blocky_image(41, 20, 30)
    for images, texts in (([one], ["w5 w9"]), ([one, two], ["w3", "w7 w8"])):
        parts = _parts(images, texts)
        prompt = tokenizer.apply_chat_template(
            _template_messages(parts), add_generation_prompt=True, tokenize=False
        )
        want, want_prompt_ids = gemma3_transformers_greedy(tiny_gemma3, prompt, images, MAX_TOKENS)
        _check(_chat(client, parts), tokenizer, want, len(want_prompt_ids))
