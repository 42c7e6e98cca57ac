"""Image content parts of chat messages: extracted in order for the chat template, refused
for a text-only model; LLM.chat with images equals LLM.generate with the same prompt and
transformers."""

from __future__ import annotations

import base64
import io

import pytest

import xlm
from tests.multimodal_fixtures import make_image, transformers_greedy
from xlm.engine.exceptions import RequestValidationError
from xlm.multimodal.chat import extract_images, with_images
from xlm.multimodal.image import MediaPolicy

GREEDY = xlm.SamplingParams(max_tokens=6, temperature=0)


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_parts_become_template_parts_in_order():
    first, second = make_image(0), make_image(1)
    messages = [
        {"role": "system", "content": "w1"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": _data_url(first)}},
                {"type": "text", "text": "w2"},
                {"type": "image_pil", "image_pil": second},
            ],
        },
    ]
    out, images = extract_images(messages, MediaPolicy(), accepts_images=True)
    assert out[0] == messages[0]
    assert out[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "w2"},
        {"type": "image"},
    ]
    assert [im.size for im in images] == [first.size, second.size]
    assert with_images({"prompt_token_ids": [1]}, []) == {"prompt_token_ids": [1]}
    assert with_images({"prompt_token_ids": [1]}, images)["multi_modal_data"]["image"] == images


def test_images_for_a_text_only_model_are_refused():
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": make_image(0)}]}]
    with pytest.raises(RequestValidationError, match=r"content\[0\] is an image.*text only"):
        extract_images(messages, MediaPolicy(), accepts_images=False)
    bare = [{"role": "user", "content": [{"type": "image"}]}]
    with pytest.raises(RequestValidationError, match="needs its image as an image_url part"):
        extract_images(bare, MediaPolicy(), accepts_images=True)


def test_llm_chat_with_images_equals_generate_and_transformers(tiny_llava_llm, tiny_llava):
    image = make_image(30)
    content = [
        {"type": "text", "text": "w11"},
        {"type": "image_url", "image_url": {"url": _data_url(image)}},
        {"type": "text", "text": "w12 w13"},
    ]
    out = tiny_llava_llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    prompt = "<|im_start|> user w11 <image> w12 w13 <|im_end|> <|im_start|> assistant "
    ids = tiny_llava_llm.get_tokenizer().encode(prompt)
    want = transformers_greedy(tiny_llava, ids, [image], 6)
    assert list(out.outputs[0].token_ids) == want
    generated = tiny_llava_llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False
    )[0]
    assert list(generated.outputs[0].token_ids) == want
    with pytest.raises(RequestValidationError, match="--allowed-local-media-path"):
        tiny_llava_llm.chat(
            [{"role": "user", "content": [{"type": "image_url", "image_url": "file:///x.png"}]}],
            GREEDY,
        )
